"""The one module that reaches into asyncio's internals: the event loop's queue of waiting callbacks.

Encoding on the event loop (gateway/media/encode_pool.py) runs only in a turn where no other
callback waits, so a frame clock's sends never wait behind it. asyncio has no public way
to ask whether callbacks wait; its own loops (`BaseEventLoop`, the default on Linux and
macOS) keep them in the deque `_ready`. A loop without it (uvloop) never says so, and
encoding there runs on its time budget alone: the server says so at start, in its
"fast paths:" line (`summary`), and suggests `--encode-threads auto`.

asyncio comes with Python, so no pin in pyproject.toml can hold it: `check` runs at start
on the running loop, and tests/test_compat_homes.py fails where the installed Python's
loop has no such queue.
"""

from __future__ import annotations

import asyncio
import platform

# The attribute of asyncio.BaseEventLoop that holds the callbacks due this turn (a deque).
_READY = "_ready"


def callbacks_waiting(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether other callbacks wait to run on `loop` this turn or the next (False where it cannot say)."""
    return bool(getattr(loop, _READY, None))


def shows_waiting(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether `loop` shows its waiting callbacks: asyncio's own loops do, at the versions tested."""
    return hasattr(loop, _READY)


def check() -> bool:
    """`shows_waiting` for the running loop: called once at the server's start."""
    return shows_waiting(asyncio.get_running_loop())


def summary(shows: bool) -> str:
    """The start-up line's words for `check()`'s result."""
    loop = type(asyncio.get_running_loop()).__name__
    if shows:
        return f"the event loop's waiting callbacks read ({loop}, Python {platform.python_version()})"
    return f"the event loop ({loop}) hides its waiting callbacks: encoding on it cannot give way to them"
