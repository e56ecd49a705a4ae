"""TextPump (gateway/sessions/text_pump.py): text reaches each stream in order, a slice per loop turn; a failed stream costs only its own text."""

from __future__ import annotations

import asyncio

from voxgate.gateway.sessions.text_pump import TEXT_SLICE_CHARS, TextPump


class Sink:
    def __init__(self, fail: bool = False) -> None:
        self.texts: list[str] = []
        self.ended = False
        self.fail = fail

    def push_text(self, text: str) -> None:
        if self.fail:
            raise RuntimeError("stream cancelled")
        self.texts.append(text)

    def end_input(self) -> None:
        self.ended = True


async def test_slices_in_order_across_streams_and_a_failed_stream_is_skipped():
    pump, a, broken, b = TextPump(), Sink(), Sink(fail=True), Sink()
    pump.push(a, "x" * (TEXT_SLICE_CHARS + 10))
    pump.push(broken, "lost")
    pump.push(b, "hello")
    pump.push(a, None)
    await asyncio.sleep(0)
    assert a.texts == ["x" * TEXT_SLICE_CHARS] and not b.texts  # one slice per turn
    for _ in range(6):
        await asyncio.sleep(0)
    assert a.texts == ["x" * TEXT_SLICE_CHARS, "x" * 10] and a.ended
    assert b.texts == ["hello"] and broken.texts == []


async def test_clear_drops_what_has_not_reached_its_stream():
    pump, a = TextPump(), Sink()
    pump.push(a, "y" * (3 * TEXT_SLICE_CHARS))
    await asyncio.sleep(0)
    pump.clear()
    for _ in range(4):
        await asyncio.sleep(0)
    assert a.texts == ["y" * TEXT_SLICE_CHARS]
    pump.push(a, "again")  # the pump still works after a clear
    await asyncio.sleep(0)
    assert a.texts[-1] == "again"
