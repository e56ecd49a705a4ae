"""Turning a token stream into speakable units.

The first unit is short: the first clause, or a few words once a timeout
fires in a token stream, because time to first audio matters most. The engine
streams inside a sentence, so a first sentence without a comma costs little
more first audio than a short one; `first_whole_sentence` (off by default, on
the figures in docs/engines.md) makes the whole first sentence the first unit
when its text is there. Later
units are whole sentences or long clauses, for natural prosody.

No unit is longer than `MAX_UNIT_CHARS` (engine/text/units.py): text without
punctuation is cut at the last space before it, and so is an unfinished
`<...>` tag, which could otherwise hold everything after it. Every unit keeps the exact
input span it came from (`raw`), so joining the raw spans gives back the input:
nothing is lost, duplicated or reordered. What the engine is asked to say
(`speak`) is the raw span cleaned of markdown, emoji and markup.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from .units import MAX_UNIT_CHARS, last_gap

SENTENCE_END = ".!?…"
CLOSERS = "\"')]}”’»*_"
ABBREVIATIONS = {
    "dr", "mr", "mrs", "ms", "prof", "sr", "jr", "st", "vs", "etc", "inc", "ltd", "co",
    "no", "fig", "approx", "dept", "est", "gen", "gov", "lt", "mt", "rev", "sgt", "capt",
    "col", "cmdr", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct",
    "nov", "dec", "mon", "tue", "wed", "thu", "fri", "sat", "sun", "a.m", "p.m", "e.g", "i.e",
    "u.s", "u.k", "ph.d",
}


@dataclass(frozen=True)
class Unit:
    raw: str
    speak: str
    first: bool = False


@dataclass
class SegmenterConfig:
    # The first unit may end at a comma once it has this many characters
    # ("Sure," and "Well," count: the first audio matters most).
    first_min_chars: int = 5
    # Later units end at a sentence, or at ; and : once this long.
    min_chars: int = 16
    # Later units end at a comma only once this long.
    comma_min_chars: int = 120
    # Text without punctuation is split at the last space before this length.
    max_chars: int = MAX_UNIT_CHARS
    # Whether the first unit is the whole first sentence when its end is already
    # in the buffer, rather than its first clause. Off: measured on replies with
    # an early comma, the first clause gave first audio ~20 ms sooner and no worse
    # pocketsphinx WER (bench/bench_streaming.py section 6, docs/engines.md).
    first_whole_sentence: bool = False


class Segmenter:
    def __init__(self, config: SegmenterConfig | None = None) -> None:
        self.config = config or SegmenterConfig()
        self._buf = ""
        self._emitted_first = False

    @property
    def pending(self) -> str:
        return self._buf

    @property
    def started(self) -> bool:
        return self._emitted_first

    def push(self, text: str) -> list[Unit]:
        self._buf += text
        return self._drain(final=False)

    def end(self) -> list[Unit]:
        units = self._drain(final=True)
        if self._buf:
            units.append(self._unit(len(self._buf)))
        return units

    def flush_first(self) -> list[Unit]:
        """Called when the first clause is slow to arrive: say the whole words so far."""
        if self._emitted_first or not speakable(self._buf):
            return []
        cut = _last_space(self._buf, len(self._buf))
        if cut is None or not speakable(self._buf[:cut]):
            return []
        if _open_tag(self._buf[:cut]):
            return []
        return [self._unit(cut)]

    def _unit(self, cut: int) -> Unit:
        raw, self._buf = self._buf[:cut], self._buf[cut:]
        first = not self._emitted_first and bool(speakable(raw))
        if first:
            self._emitted_first = True
        return Unit(raw=raw, speak=speakable(raw), first=first)

    def _drain(self, final: bool) -> list[Unit]:
        units: list[Unit] = []
        while True:
            cut = self._find_cut(final)
            if cut is None:
                return units
            units.append(self._unit(cut))

    def _find_cut(self, final: bool) -> int | None:
        buf = self._buf
        cfg = self.config
        first = not self._emitted_first
        n = len(buf)
        i = 0
        while i < n:
            c = buf[i]
            if c == "<":
                close = buf.find(">", i, cfg.max_chars + 1)
                if close < 0:
                    # An unfinished tag: nothing after it can be decided yet, but
                    # a unit never grows past max_chars waiting for its ">". The
                    # tag is given up on, so its spaces are fair places to cut.
                    return last_gap(buf, cfg.max_chars, str.isspace) if n >= cfg.max_chars else None
                i = close + 1
                continue
            if i >= cfg.max_chars:
                return self._hard_cut(i)
            length = len(buf[:i].strip())
            if c in SENTENCE_END:
                j = i + 1
                while j < n and (buf[j] in SENTENCE_END or buf[j] in CLOSERS):
                    j += 1
                if j >= n:
                    return None  # undecided until the next character, or end()
                if buf[j].isspace() and not _is_abbreviation(buf, i):
                    if first or length + 1 >= cfg.min_chars:
                        return _past_spaces(buf, j)
                i = j
                continue
            if c in ",;:":
                j = i + 1
                if j >= n:
                    return None
                if buf[j].isspace():
                    if c == ",":
                        need = cfg.first_min_chars if first else cfg.comma_min_chars
                    else:
                        need = cfg.first_min_chars if first else cfg.min_chars
                    whole = first and cfg.first_whole_sentence and _sentence_end_ahead(buf, j, cfg.max_chars)
                    if length + 1 >= need and not whole:
                        return _past_spaces(buf, j)
                i = j
                continue
            if c == "\n":
                if speakable(buf[:i]):
                    j = i + 1
                    while j < n and buf[j] == "\n":
                        j += 1
                    return j
            i += 1
        return None

    def _hard_cut(self, limit: int) -> int:
        cut = _last_space(self._buf, limit)
        if cut is None or cut < self.config.max_chars // 2:
            cut = limit
        return cut


def _sentence_end_ahead(buf: str, start: int, limit: int) -> bool:
    """Whether the buffer holds a sentence end after `start` and before `limit` (the text is already there)."""
    for k in range(start, min(len(buf), limit)):
        if buf[k] in SENTENCE_END and not _is_abbreviation(buf, k):
            after = k + 1
            if after >= len(buf) or buf[after].isspace() or buf[after] in CLOSERS:
                return True
    return False


def _past_spaces(buf: str, j: int) -> int:
    # The spaces after a boundary belong to the unit they end, so that units
    # joined back together keep the words apart.
    while j < len(buf) and buf[j] in " \t":
        j += 1
    return j


def _last_space(buf: str, limit: int) -> int | None:
    """Index just after the last whitespace before limit that is not inside a tag."""
    depth_start = None
    best = None
    for k in range(min(limit, len(buf))):
        ch = buf[k]
        if ch == "<":
            depth_start = k
        elif ch == ">":
            depth_start = None
        elif ch.isspace() and depth_start is None and k > 0:
            best = k + 1
    return best


def _open_tag(text: str) -> bool:
    return text.rfind("<") > text.rfind(">")


def _is_abbreviation(buf: str, dot: int) -> bool:
    if buf[dot] != ".":
        return False
    start = dot
    while start > 0 and not buf[start - 1].isspace():
        start -= 1
    token = buf[start:dot].lstrip("(\"'“‘").lower()
    if not token:
        return False
    if token in ABBREVIATIONS:
        return True
    if len(token) == 1 and token.isalpha():
        return True  # an initial, as in "J. Smith"
    if re.fullmatch(r"(?:[a-z]\.)+[a-z]", token):
        return True  # e.g, i.e, U.S
    if token.isdigit() and (start == 0 or buf[start - 1] == "\n"):
        return True  # "1. " starting a list item
    return False


# Every pattern here runs on the event loop over text a client chose, so each
# must be linear in the text: a match may start only where the previous
# character cannot continue it (no quadratic rescans from every position), and
# repeats that could scan far are bounded (nothing rescans more than a bound).
MAX_LINK_TEXT = 200
MAX_LINK_TARGET = 2048
_MD_LINK = re.compile(r"!?\[([^\[\]\n]{0,%d})\]\([^()\s]{0,%d}\)" % (MAX_LINK_TEXT, MAX_LINK_TARGET))
_URL = re.compile(r"(?<![\w/.:])(?:https?://|www\.)[^\s<>]{1,2048}", re.IGNORECASE)
# RFC 5321 bounds: local part up to 64 characters, labels up to 63, a few labels.
_EMAIL = re.compile(r"(?<![\w.+@-])([\w+-][\w.+-]{0,63})@([\w-]{1,63}(?:\.[\w-]{1,63}){1,8})\b")
_TAG = re.compile(r"<[^<>]*>")
_BULLET = re.compile(r"(?m)^[ \t]*(?:[-*+•]|#{1,6})[ \t]+")
# Emphasis marks; an underscore only at a word's edge, so snake_case survives.
_MD_MARKS = re.compile(r"(\*\*|\*|`+|~~|(?<![A-Za-z0-9])_+|_+(?![A-Za-z0-9]))")
_SPACES = re.compile(r"\s+")
# str.isalnum() as a pattern: \w is exactly isalnum() plus the underscore.
_ALNUM = re.compile(r"[^\W_]")
_SPACE_BEFORE_PUNCT = re.compile(r"(?<!\s)\s+([.,;:!?])")


def _say_host(host: str) -> str:
    return " dot ".join(part for part in host.split(".") if part)


def _url(match: re.Match) -> str:
    url = re.sub(r"^(?:https?://)", "", match.group(0), flags=re.IGNORECASE)
    url = url.rstrip(".,;:!?)")
    host = url.split("/", 1)[0]
    trailing = match.group(0)[len(match.group(0).rstrip(".,;:!?)")) :]
    return _say_host(host) + trailing


def _email(match: re.Match) -> str:
    return f"{match.group(1)} at {_say_host(match.group(2))}"


def _is_emoji(ch: str) -> bool:
    cp = ord(ch)
    if cp in (0x200D, 0xFE0F, 0xFE0E, 0x20E3):
        return True
    if 0x1F000 <= cp <= 0x1FAFF or 0x2600 <= cp <= 0x27BF or 0x1F1E6 <= cp <= 0x1F1FF:
        return True
    return unicodedata.category(ch) in ("So", "Cs", "Co", "Cn")


class _Unspoken(dict):
    """str.translate table: emoji and control characters to a space, the rest kept.

    Filled on first sight of each character, so translating runs at C speed
    instead of one Python call per character; its size is bounded by the
    characters seen, and it starts over past a cap.
    """

    CAP = 65536

    def __missing__(self, cp: int):
        ch = chr(cp)
        out = " " if _is_emoji(ch) or unicodedata.category(ch) == "Cc" else ch
        if len(self) >= self.CAP:
            self.clear()
        self[cp] = out
        return out


_UNSPOKEN = _Unspoken()


def speakable(raw: str) -> str:
    """What to say for a raw span: no markup, no emoji; '' if nothing is speakable."""
    # Each rule runs only when its trigger character is there: most spans have
    # none, and the segmenter calls this for every unit.
    text = _TAG.sub(" ", raw) if "<" in raw else raw
    if "[" in text:
        text = _MD_LINK.sub(r"\1", text)
    if "@" in text:
        text = _EMAIL.sub(_email, text)
    if "://" in text or "www." in text.lower():
        text = _URL.sub(_url, text)
    text = _BULLET.sub("", text)
    text = _MD_MARKS.sub("", text)
    text = text.translate(_UNSPOKEN)
    trailing = " " if text[-1:].isspace() else ""
    text = _SPACES.sub(" ", text).strip()
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    if _ALNUM.search(text) is None:
        return ""
    return text + trailing
