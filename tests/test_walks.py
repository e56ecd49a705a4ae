"""docs/architecture.md's walks are checked against the code.

Each walk (an utterance's text, a cancel, a caller's turn, a setting) follows one thing through the
code and names the modules it passes, at most MAX_MODULES of them (issue 55: a newcomer can hold a
walk in their head). Every module path a walk names must exist, and every `Class.member` or
`module.name` it names must be found in one of the walk's own modules: a rename or a move that the
doc does not follow turns this red.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
MAX_MODULES = 12
WALKS = ("An utterance's text", "A cancel", "A caller's turn", "The Opus bitrate")
SUBPACKAGES = ("gateway", "engine", "signaling")

PATH = re.compile(r"`((?:gateway|engine|signaling|voxgate|web)/[\w/]+\.(?:py|js))`")
# `Class.member` or `Class.member(...)`, and `module.name` for a module the walk names.
DOTTED = re.compile(r"`([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\([^`]*\))?`")
CLASS = re.compile(r"`([A-Z]\w*[a-z]\w*)`")  # a class name; not `VOXGATE_OPUS_BITRATE`
# The protocol's event and message names (`text.delta`, `speech.started`, `session.ready`) look dotted too.
EVENTS = {"text", "speech", "utterance", "session", "call"}


def walks() -> dict[str, str]:
    text = DOC.read_text()
    section = text.split("\n## Walks\n", 1)[1].split("\n## ", 1)[0]
    found = {}
    for part in section.split("\n### ")[1:]:
        title, _, body = part.partition("\n")
        found[title.strip()] = body
    return found


def module_name(path: str) -> str | None:
    """The importable name of a product module path (None for web/ files)."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[0] in SUBPACKAGES:
        parts = ["voxgate", *parts]
    return ".".join(parts)


def resolve(modules: list, first: str, second: str) -> bool:
    """Whether `first.second` is in one of `modules`: a class and its member, or a module and its name."""
    for module in modules:
        if module.__name__.rsplit(".", 1)[-1] == first:  # `proto.CancelStream`: a module the walk names
            return hasattr(module, second)
        owner = getattr(module, first, None)
        if inspect.isclass(owner) and owner.__module__ == module.__name__:
            if hasattr(owner, second):
                return True
            # An attribute each instance sets (`Gateway.sessions`), or a dataclass field.
            return (re.search(rf"self\.{second}\b", inspect.getsource(owner)) is not None
                    or second in getattr(owner, "__dataclass_fields__", {}))
    return False


def test_the_four_walks_are_there():
    assert set(WALKS) <= set(walks()), sorted(walks())


@pytest.mark.parametrize("title", WALKS)
def test_a_walk_names_few_modules_and_each_name_is_in_one_of_them(title):
    body = walks()[title]
    paths = sorted(set(PATH.findall(body)))
    assert 0 < len(paths) <= MAX_MODULES, (len(paths), paths)
    for path in paths:
        assert (ROOT / path).exists(), path
    modules = [importlib.import_module(name) for name in map(module_name, paths) if name]
    names = [(a, b) for a, b in DOTTED.findall(body) if a not in EVENTS]
    missing = [f"{a}.{b}" for a, b in names if not resolve(modules, a, b)]
    missing += [c for c in CLASS.findall(body) if not any(inspect.isclass(getattr(m, c, None)) for m in modules)]
    assert not missing, missing


def test_a_name_that_moved_is_caught():
    modules = [importlib.import_module("voxgate.gateway.sessions.session_queue")]
    assert resolve(modules, "UtteranceQueue", "interrupt")
    assert not resolve(modules, "UtteranceQueue", "vad_events")  # the caller side's, not the queue's
    assert not resolve(modules, "CallerSide", "vad_events")  # right name, but its module is not in the walk
    caller = [importlib.import_module("voxgate.gateway.caller.caller_side")]
    assert resolve(caller, "CallerSide", "echo") and not resolve(caller, "CallerSide", "ech")  # set in __init__
