"""How long one unit of text may be, in characters and in phonemes.

An engine step runs the text encoder over one whole unit, so the longest unit
bounds the longest step, and with it how long one session's text can hold a
core that another session's first audio is waiting for. Units are capped twice:

- in characters, by the segmenter (it cuts at `MAX_UNIT_CHARS` even inside an
  unfinished `<...>` tag) and again by the engines, for text that reaches them
  another way (spelled-out tags grow, clients may skip the segmenter);
- in phonemes, by the engines after phonemizing, because a few characters can
  expand to many phonemes ("1234567890123" is read out as words).

Over-long text is split at the last word gap before the cap; never handed on whole.
"""

from __future__ import annotations

# A long sentence (about 35 words): longer than almost any sentence people
# write, short enough that its encoder pass stays a bounded step.
MAX_UNIT_CHARS = 220
# MAX_UNIT_CHARS of English prose phonemizes to about 230; this leaves room so
# that only expanded text (numbers, spelled letters) is ever split here.
MAX_UNIT_PHONEMES = 300


def cap_text(text: str, limit: int = MAX_UNIT_CHARS) -> list[str]:
    """`text` in pieces of at most `limit` characters, cut after whitespace where possible."""
    pieces = []
    while len(text) > limit:
        cut = last_gap(text, limit, lambda ch: ch.isspace())
        pieces.append(text[:cut])
        text = text[cut:]
    if text or not pieces:
        pieces.append(text)
    return pieces


def cap_phonemes(phonemes: list[str], limit: int = MAX_UNIT_PHONEMES) -> list[list[str]]:
    """A phoneme list in pieces of at most `limit`, cut after a word gap (espeak's " ") where possible."""
    pieces = []
    while len(phonemes) > limit:
        cut = last_gap(phonemes, limit, lambda ph: ph == " ")
        pieces.append(phonemes[:cut])
        phonemes = phonemes[cut:]
    if phonemes:
        pieces.append(phonemes)
    return pieces


def last_gap(seq, limit: int, is_gap) -> int:
    """Index just past the last gap before `limit`, if it keeps at least half; else `limit`."""
    for k in range(limit - 1, limit // 2 - 1, -1):
        if is_gap(seq[k]):
            return k + 1
    return limit
