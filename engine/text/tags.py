"""Inline speech tags: pauses, rate changes and spelling inside the text.

    Hello <break time="500ms"/> world.
    <prosody rate="slow">Take your time.</prosody>
    Your code is <say-as interpret-as="characters">XKCD</say-as>.

A stream keeps one `TagState`. Each unit's raw text (as the segmenter cut it)
goes through `TagState.pieces()`, which returns what to render: text with a
rate factor, breaks (silence), and nothing else. Open tags carry over from one
unit to the next, so a `<prosody>` that spans sentences keeps applying. The
engine worker renders the pieces with `render()` (`RenderJob` on a stepwise
engine, step by step): breaks become silence at the
engine's rate, text goes to the engine with the rate multiplied in.

Tags outside the set are never spoken: the engine's own `supported_tags` are
left in its text for it to render (CosyVoice-style `<laughing>`), every other
tag is dropped. See docs/speech-tags.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..base import AudioChunk, Engine, StopSignal, SynthesisJob, SynthesisOptions
from .segmenter import speakable

# Tags this module renders itself, whatever the engine.
RENDERED_TAGS = frozenset({"break", "prosody", "say-as"})

MAX_BREAK_MS = 10000
# All breaks of one stream together: 2,000 breaks of 10 s would be 5.5 hours of
# silence to synthesize and send for a few kilobytes of text.
MAX_TOTAL_BREAK_MS = 30000
MIN_RATE, MAX_RATE = 0.25, 4.0
RATE_WORDS = {"x-slow": 0.6, "slow": 0.8, "medium": 1.0, "default": 1.0, "fast": 1.25, "x-fast": 1.6}
BREAK_STRENGTHS = {"none": 0, "x-weak": 100, "weak": 200, "medium": 400, "strong": 700, "x-strong": 1000}
SPELL_KINDS = ("characters", "spell-out", "letters", "verbatim")

# These patterns run on the event loop over text a client chose. Lengths are
# capped before any of them runs, and each is linear: a match starts only where
# the character before cannot belong to it, and no two adjacent repeats can
# trade characters (the source of quadratic backtracking).
MAX_TAG_CHARS = 512  # longer "<...>" spans are not tags: dropped, never parsed
MAX_VALUE_CHARS = 64  # attribute values a number is read from
_TAG = re.compile(r"<([^<>]*)>")
_NAME = re.compile(r"[A-Za-z][\w:.-]*")
_ATTR = re.compile(r"""(?<![\w:.-])([A-Za-z_][\w:.-]*)[ \t\n]*=[ \t\n]*(?:"([^"]*)"|'([^']*)'|([^\s"'/>]+))""")
_TIME = re.compile(r"(\d+(?:\.\d+)?)(ms|s)?", re.IGNORECASE)
_PERCENT = re.compile(r"([+-]?)(\d+(?:\.\d+)?)%")


@dataclass(frozen=True)
class Speech:
    """Text for the engine, spoken at `rate` times the stream's rate."""

    text: str
    rate: float = 1.0


@dataclass(frozen=True)
class Pause:
    ms: int


Piece = Speech | Pause


@dataclass(frozen=True)
class Tag:
    name: str
    closing: bool
    self_closing: bool
    attrs: dict
    raw: str


def parse_tag(inner: str) -> Tag | None:
    """The tag inside `<...>`, or None for text that only looks like one ("a < b > c")."""
    if len(inner) > MAX_TAG_CHARS:
        return None
    body = inner.strip()
    closing = body.startswith("/")
    if closing:
        body = body[1:].lstrip()
    slash = body.endswith("/")
    if slash:
        body = body[:-1].rstrip()
    m = _NAME.match(body)
    if m is None:
        return None
    name, rest = m.group(0), body[m.end() :]
    attrs = {a.lower(): (v1 if v1 is not None else v2 if v2 is not None else v3) for a, v1, v2, v3 in _ATTR.findall(rest)}
    return Tag(name.lower(), bool(closing), bool(slash), attrs, "<" + inner + ">")


def break_ms(attrs: dict) -> int:
    time = attrs.get("time")
    if time is not None:
        m = _TIME.fullmatch(time.strip().replace(" ", "")) if len(time) <= MAX_VALUE_CHARS else None
        if m is None:
            return BREAK_STRENGTHS["medium"]
        value = float(m.group(1))
        ms = value * 1000.0 if (m.group(2) or "ms").lower() == "s" else value
        return int(min(max(ms, 0.0), MAX_BREAK_MS))
    return BREAK_STRENGTHS.get(str(attrs.get("strength", "medium")).lower(), BREAK_STRENGTHS["medium"])


def rate_factor(value: str | None) -> float:
    """SSML-style rate: a word, a percentage ("150%", "+20%"), or a plain factor."""
    if value is None:
        return 1.0
    v = value.strip().lower()
    if len(v) > MAX_VALUE_CHARS:
        return 1.0
    if v in RATE_WORDS:
        return RATE_WORDS[v]
    m = _PERCENT.fullmatch(v.replace(" ", ""))
    if m is not None:
        sign, number = m.group(1), float(m.group(2))
        factor = 1.0 + number / 100.0 if sign == "+" else 1.0 - number / 100.0 if sign == "-" else number / 100.0
    else:
        try:
            factor = float(v)
        except ValueError:
            return 1.0
    if not math.isfinite(factor):
        return 1.0  # "nan" passes min/max unchanged; "inf" is no rate either
    return min(max(factor, MIN_RATE), MAX_RATE)


def spell(text: str) -> str:
    """Letters and digits one by one, comma-separated, so a voice names each ("A, B, C")."""
    items = [ch.upper() for ch in text if not ch.isspace()]
    return ", ".join(items)


@dataclass
class TagState:
    """Open tags of one stream, carried from unit to unit."""

    engine_tags: frozenset[str] = frozenset()
    rates: list[float] = field(default_factory=list)
    spelling: int = 0  # depth of open say-as characters
    say_as: list[bool] = field(default_factory=list)  # per open say-as: does it spell?
    break_budget_ms: int = MAX_TOTAL_BREAK_MS  # silence this stream's breaks may still add

    @property
    def rate(self) -> float:
        factor = 1.0
        for r in self.rates:
            factor *= r
        return min(max(factor, MIN_RATE), MAX_RATE)

    def pieces(self, raw: str) -> list[Piece]:
        """What to render for one unit of raw text; empty when there is nothing to say."""
        out: list[Piece] = []
        run: list[str] = []  # text of the current span, engine tags kept in place

        def close_run() -> None:
            joined = "".join(run)
            text = self._clean(joined)
            run.clear()
            if text:
                if self.spelling:
                    text = spell(text)
                if out and isinstance(out[-1], Speech) and out[-1].rate == self.rate and not self.spelling:
                    before = out[-1].text
                    # speakable() drops a run's leading space; keep the words apart.
                    gap = " " if joined[:1].isspace() and not before[-1:].isspace() else ""
                    out[-1] = Speech(before + gap + text, self.rate)
                else:
                    out.append(Speech(text, self.rate))

        pos = 0
        for m in _TAG.finditer(raw):
            run.append(raw[pos : m.start()])
            pos = m.end()
            tag = parse_tag(m.group(1))
            if tag is None:
                run.append(" ")
                continue
            if tag.name in self.engine_tags and tag.name not in RENDERED_TAGS:
                run.append(tag.raw)
                continue
            if tag.name not in RENDERED_TAGS:
                run.append(" ")  # dropped, but it still parts the words around it
                continue
            close_run()
            self._apply(tag, out)
        run.append(raw[pos:])
        close_run()
        return out

    def _apply(self, tag: Tag, out: list[Piece]) -> None:
        if tag.name == "break":
            if not tag.closing:
                ms = min(break_ms(tag.attrs), self.break_budget_ms)
                self.break_budget_ms -= ms
                if ms > 0:
                    if out and isinstance(out[-1], Pause):
                        out[-1] = Pause(min(out[-1].ms + ms, MAX_BREAK_MS))
                    else:
                        out.append(Pause(ms))
        elif tag.name == "prosody":
            if tag.closing:
                if self.rates:
                    self.rates.pop()
            elif not tag.self_closing:
                self.rates.append(rate_factor(tag.attrs.get("rate")))
        elif tag.name == "say-as":
            if tag.closing:
                if self.say_as and self.say_as.pop():
                    self.spelling -= 1
            elif not tag.self_closing:
                spells = str(tag.attrs.get("interpret-as", "")).lower() in SPELL_KINDS
                self.say_as.append(spells)
                self.spelling += int(spells)

    def _clean(self, text: str) -> str:
        """speakable() on the text between engine tags, the tags kept for the engine."""
        if not self.engine_tags or "<" not in text:
            return speakable(text)
        parts = re.split(r"(<[^<>]*>)", text)
        cleaned = [p if p.startswith("<") else speakable(p) for p in parts]
        if not any(p and not p.startswith("<") for p in cleaned):
            # Nothing to say but engine tags (a lone <laughing>): still worth sending.
            return "".join(p for p in cleaned if p.startswith("<"))
        return "".join(cleaned)


def to_wire(pieces: list[Piece]) -> list[tuple]:
    """Pieces as plain tuples for the worker pipe."""
    return [("speech", p.text, p.rate) if isinstance(p, Speech) else ("pause", p.ms) for p in pieces]


def from_wire(items: list[tuple]) -> list[Piece]:
    return [Speech(i[1], float(i[2])) if i[0] == "speech" else Pause(int(i[1])) for i in items]


def _piece_options(options: SynthesisOptions, piece: Speech) -> SynthesisOptions:
    if piece.rate == 1.0:
        return options
    return dataclasses.replace(options, rate=min(max(options.rate * piece.rate, MIN_RATE), MAX_RATE))


def _silence(engine: Engine, piece: Pause, options: SynthesisOptions, unit_end: bool) -> AudioChunk:
    rate = engine.sample_rate(options.voice)
    pcm = np.zeros(int(round(piece.ms * rate / 1000.0)), dtype=np.int16)
    return AudioChunk(pcm=pcm, sample_rate=rate, text="", words=[], unit_end=unit_end)


class RenderJob(SynthesisJob):
    """One unit's pieces on a stepwise engine, one bounded step at a time.

    A pause is one step (its silence); a speech piece is an engine job, stepped
    until done. Only the last piece's last chunk keeps unit_end.
    """

    def __init__(self, engine: Engine, pieces: list[Piece], options: SynthesisOptions) -> None:
        self.engine = engine
        self.pieces = list(pieces)
        self.options = options
        self.inner: SynthesisJob | None = None

    @property
    def done(self) -> bool:
        return self.inner is None and not self.pieces

    def step(self, threads: int = 1, stop: StopSignal | None = None) -> AudioChunk | None:
        if self.inner is None:
            piece = self.pieces.pop(0)
            if isinstance(piece, Pause):
                return _silence(self.engine, piece, self.options, unit_end=not self.pieces)
            self.inner = self.engine.start(piece.text, _piece_options(self.options, piece))
        self.inner.slack_s, self.inner.load = self.slack_s, self.load
        chunk = self.engine.step([self.inner], threads, stop)[0]
        if self.inner.done:
            self.inner = None
        if chunk is not None and self.pieces:
            chunk.unit_end = False
        return chunk


def render(engine: Engine, pieces: list[Piece], options: SynthesisOptions) -> Iterator[AudioChunk]:
    """One unit's audio from its pieces, in the worker: pauses are silence, rates multiply.

    Only the last chunk of the unit keeps unit_end; the chunks of earlier pieces
    say more is coming.
    """
    last = len(pieces) - 1
    for i, piece in enumerate(pieces):
        if isinstance(piece, Pause):
            yield _silence(engine, piece, options, unit_end=i == last)
            continue
        for chunk in engine.synthesize(piece.text, _piece_options(options, piece)):
            if i != last:
                chunk.unit_end = False
            yield chunk
