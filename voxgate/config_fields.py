"""How one setting is declared, shown and checked (voxgate/config.py declares them all).

`setting(default, group, help, range)` makes a dataclass field whose metadata
carries its --help group and line and its range; the rest reads that metadata:
its flag, its default as --help and docs/settings.md show it, its allowed values
in words, and the check that refuses a value outside them. No setting is
defined here, and nothing here reads the environment; a secret's file is read here
(`read_secret_files`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, Field, field, fields
from collections.abc import Iterable
from typing import Any

# --help fits each flag on one line of this many columns.
HELP_WIDTH = 120


class ConfigError(ValueError):
    """A setting that cannot work; the message says what to do."""


def setting(
    default: Any,
    group: str,
    help: str,
    *,
    low: float | None = None,
    high: float | None = None,
    zero: str | None = None,
    choices: tuple[str, ...] | None = None,
    shown: str | None = None,
    metavar: str | None = None,
) -> Any:
    """One setting: its default (written only here), its --help group and one line of help, and its range.

    `low`..`high` bound a number; `zero` says what 0 means where 0 is allowed outside that range;
    `choices` lists the allowed words (with `low`/`high` too: a word or a number); `shown` is how
    --help and the README show a default that is not a plain value.
    """
    meta = {"group": group, "help": help, "low": low, "high": high, "zero": zero, "choices": choices,
            "shown": shown, "metavar": metavar}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[operator]


def shown_default(f: Field) -> str:
    """A setting's default the way --help and the README show it."""
    if f.metadata.get("shown"):
        return f.metadata["shown"]
    value = default_of(f)
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == []:
        return "none"
    return _number(value)


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def allowed_values(f: Field) -> str | None:
    """What a setting may be, in words: '1 to 65535', 'auto, always or never', '0, or 50 to 100000'."""
    m = f.metadata
    parts = []
    if m.get("choices"):
        parts.append(", ".join(m["choices"]))
    if m.get("low") is not None:
        span = f"{_number(m['low'])} to {_number(m['high'])}"
        parts.append(f"0 ({m['zero']}), or {span}" if m.get("zero") else span)
    return " or ".join(parts) or None


def _check_field(f: Field, value: Any) -> None:
    m = f.metadata
    choices, low = m.get("choices"), m.get("low")
    if choices is None and low is None:
        return
    flag = flag_of(f.name)
    if isinstance(value, str) and choices is not None:
        # Words in capitals (the log levels) are taken in any case.
        word = value.upper() if all(c.isupper() for c in choices) else value
        if word in choices:
            return
        if low is None:
            raise ConfigError(f"{flag} {value!r}: choose one of {', '.join(choices)}")
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(f"{flag} {value!r}: give {allowed_values(f)}") from None
    number_ok = (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        and (isinstance(value, int) or isinstance(default_of(f), float))
    )
    if not number_ok or not ((value == 0 and m.get("zero")) or low <= value <= m["high"]):
        raise ConfigError(f"{flag} {value!r}: give {allowed_values(f)}")


def check_ranges(settings: Any) -> None:
    """Every setting inside its range, before anything loads; raises ConfigError naming the flag and the range."""
    for f in fields(settings):
        _check_field(f, getattr(settings, f.name))


def bounds(kind: type, name: str) -> tuple[float, float]:
    """A number setting's range, for the modules that check the same quantity from clients."""
    meta = next(f for f in fields(kind) if f.name == name).metadata
    return meta["low"], meta["high"]


def _metavar(f: Field) -> str:
    if f.metadata.get("metavar"):
        return f.metadata["metavar"]
    if f.metadata.get("choices") and f.metadata.get("low") is None:
        return "WORD"
    return "S" if f.name.endswith("_s") else "MS" if f.name.endswith("_ms") else "N"


def help_line(f: Field) -> str:
    """One line of --help: what it does, its range, its default."""
    m = f.metadata
    if m.get("choices") and m.get("low") is None:
        tail = f"{'|'.join(m['choices'])}; default {shown_default(f)}"
    elif m.get("low") is not None:
        tail = f"{_number(m['low'])}-{_number(m['high'])}{', 0: ' + m['zero'] if m.get('zero') else ''}; default {shown_default(f)}"
    else:
        tail = f"default {shown_default(f)}"
    return f"{m['help']} [{tail}]".replace("%", "%%")


class HelpFormatter(argparse.HelpFormatter):
    """One line per flag: a wide help column, and `--[no-]name` for a switch."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=HELP_WIDTH)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, argparse.BooleanOptionalAction):
            return "--[no-]" + action.option_strings[0][2:]
        return super()._format_action_invocation(action)


def _parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean; use true or false")


def _parse_number(raw: str, kind: type) -> float:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError("not a whole number" if kind is int else "not a number") from None


def parse_raw(raw: str, current: Any) -> Any:
    """A setting's value from the environment's text, as the type of its `current` value
    (a list is comma-separated); ValueError when it does not parse."""
    if isinstance(current, bool):
        return _parse_bool(raw)
    if isinstance(current, list):
        return [v.strip() for v in raw.split(",") if v.strip()]
    if isinstance(current, int):
        return _parse_number(raw, int)
    if isinstance(current, float):
        return _parse_number(raw, float)
    return raw


def add_flag(group: argparse._ArgumentGroup, f: Field) -> None:
    """A setting as its flag, one line of --help: a switch, a repeatable flag, or a value."""
    flag, default = flag_of(f.name), default_of(f)
    if isinstance(default, bool):
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_line(f))
    elif isinstance(default, list):
        group.add_argument(flag, dest=f.name, action="append", default=None, metavar=_metavar(f), help=help_line(f))
    else:
        arg_type = type(default) if default is not None else str
        group.add_argument(flag, dest=f.name, type=arg_type, default=None, metavar=_metavar(f), help=help_line(f))


def read_secret_files(settings: Any, names: Iterable[str], listed: str) -> None:
    """Each secret of `names` whose `<name>_file` is set, read from that file (its first line that
    is neither blank nor a # comment; for the `listed` one, a list, every such line, added)."""
    for name in names:
        path = getattr(settings, name + "_file")
        if not path:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f.read().splitlines() if line.strip() and not line.startswith("#")]
        except OSError as exc:
            raise ConfigError(f"{flag_of(name)}-file {path}: {exc.strerror or exc}") from None
        if not lines:
            raise ConfigError(f"{flag_of(name)}-file {path} is empty; put the secret in it")
        if name == listed:
            setattr(settings, name, [*getattr(settings, name), *lines])
        else:
            setattr(settings, name, lines[0])


def secrets_on_command_line(argv: list[str], names: Iterable[str]) -> list[str]:
    """Secret flags given on the command line, where every user of the machine can read them."""
    flags = {flag_of(name) for name in names}
    return sorted({arg.split("=", 1)[0] for arg in argv if arg.split("=", 1)[0] in flags})
