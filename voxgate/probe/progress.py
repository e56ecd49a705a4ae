"""Progress while a probe runs: counts kept by the runner, and a one-line terminal bar."""

from __future__ import annotations

import sys
import time
from typing import Callable

from .config import ProbeConfig
from .results import ProbeProgress, UtteranceResult, percentile


class ProgressTracker:
    def __init__(self, config: ProbeConfig, callback: Callable[[ProbeProgress], None] | None) -> None:
        self.state = ProbeProgress(sessions=config.sessions, utterances_total=config.sessions * max(1, len(config.texts) or config.utterances))
        self.callback = callback

    def _changed(self) -> None:
        if self.callback is not None:
            self.callback(self.state)

    def connected(self) -> None:
        self.state.connected += 1
        self._changed()

    def failed(self) -> None:
        self.state.failed += 1
        self._changed()

    def finished(self) -> None:
        self.state.finished += 1
        self._changed()

    def utterance_done(self, utt: UtteranceResult) -> None:
        self.state.utterances_done += 1
        if utt.server_ttfa_ms is not None:
            self.state.ttfa_ms.append(utt.server_ttfa_ms)
        self._changed()


class TerminalProgress:
    """A one-line progress bar, redrawn with \\r on a terminal; silent elsewhere."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def __call__(self, p: ProbeProgress) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and p.finished < p.sessions:
            return
        self._last = now
        width = 30
        total = max(1, p.utterances_total)
        filled = int(width * min(p.utterances_done, total) / total)
        ttfa = f"  ttfa p50 {percentile(p.ttfa_ms, 50):.0f} ms" if p.ttfa_ms else ""
        line = (
            f"\r[{'#' * filled}{'.' * (width - filled)}] {p.utterances_done}/{total} utterances"
            f"  {p.connected}/{p.sessions} connected  {p.failed} failed{ttfa}"
        )
        self.stream.write(line)
        self.stream.flush()

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
