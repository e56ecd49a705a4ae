"""Text as it arrives to units for the engine: the segmenter, then inline speech tags.

A `TTSStream` is handed one of these (as LiveKit's StreamAdapter is handed its
tokenizer), so the stream itself knows nothing of sentences or tags, and a
caller can pass another segmenter policy (bench/bench_streaming.py compares two).
"""

from __future__ import annotations

from ...config import Settings
from ..proto import UnitPayload
from .segmenter import Segmenter, SegmenterConfig, Unit
from .tags import Speech, TagState, to_wire

# The first unit is sent after this long even without a clause boundary.
FIRST_UNIT_TIMEOUT_S = Settings.first_unit_timeout_ms / 1000.0  # --first-unit-timeout-ms


class TextPipeline:
    """Pieces of text in, unit payloads out (plain text, or tag pieces for the wire).

    Open tags carry over between units; `first_unit_timeout` is how long the
    stream waits for a clause boundary before the first words go out anyway
    (0: never).
    """

    def __init__(
        self,
        *,
        segmenter: SegmenterConfig | None = None,
        engine_tags: frozenset[str] = frozenset(),
        first_unit_timeout: float = FIRST_UNIT_TIMEOUT_S,
    ) -> None:
        self.segmenter = Segmenter(segmenter)
        self.tags = TagState(engine_tags=engine_tags)
        self.first_unit_timeout = first_unit_timeout

    @property
    def started(self) -> bool:
        """Whether the first unit has gone out."""
        return self.segmenter.started

    def push(self, text: str) -> list[UnitPayload]:
        return self._payloads(self.segmenter.push(text))

    def end(self) -> list[UnitPayload]:
        """End of a segment: whatever text is pending, as units now."""
        return self._payloads(self.segmenter.end())

    def flush_first(self) -> list[UnitPayload]:
        """The first unit's words so far, when the first-unit timeout fires."""
        return self._payloads(self.segmenter.flush_first())

    def _payloads(self, units: list[Unit]) -> list[UnitPayload]:
        out: list[UnitPayload] = []
        for unit in units:
            pieces = self.tags.pieces(unit.raw)
            if not pieces:
                continue
            if len(pieces) == 1 and isinstance(pieces[0], Speech) and pieces[0].rate == 1.0:
                out.append(pieces[0].text)  # plain text, as before tags existed
            else:
                out.append(to_wire(pieces))
        return out
