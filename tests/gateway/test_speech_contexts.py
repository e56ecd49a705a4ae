"""A /v1/tts/ws connection's contexts without the socket: each a peerless utterance of the gateway's
tone engine, its events collected in order, its slot watched in the admission counts. The wire
(JSON frames, the writer, the rate limit) is tests/http/test_tts_ws.py's."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from voxgate.gateway.errors import GatewayError
from voxgate.gateway.gateway import Gateway
from voxgate.gateway.peerless.speech_contexts import (
    ContextAudio, ContextCancelled, ContextDone, ContextError, ContextOutput, SpeechContexts,
)


class Events:
    """A ContextSink that keeps every event, and wakes whoever waits on one."""

    def __init__(self) -> None:
        self.events: list = []
        self.changed = asyncio.Event()

    async def send(self, event) -> None:
        self.events.append(event)
        self.changed.set()

    def send_now(self, event) -> None:
        self.events.append(event)
        self.changed.set()

    async def wait(self, predicate, timeout: float = 20.0):
        async def find():
            while True:
                for e in self.events:
                    if predicate(e):
                        return e
                self.changed.clear()
                await self.changed.wait()

        return await asyncio.wait_for(find(), timeout)

    def of(self, cid: str) -> list:
        return [e for e in self.events if _cid(e) == cid]


def _cid(event) -> str | None:
    if isinstance(event, (ContextAudio, ContextDone)):
        return event.context.id
    return event.context_id


# One tone-engine gateway for the module (`gw`, tests/gateway/conftest.py); each test its own
# connection's contexts, with its own limits.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture
def contexts(gw):
    made: list[SpeechContexts] = []

    def make(fmt: str = "pcm16", rate: int | None = None, **limits) -> tuple[Gateway, SpeechContexts, Events]:
        sink = Events()
        settings = dataclasses.replace(gw.settings, **limits)
        made.append(SpeechContexts(gw.engine, gw.admission, settings, "caller", None,
                                   ContextOutput(fmt, rate, True), sink))
        return gw, made[-1], sink

    yield make
    for ctxs in made:
        ctxs.close()
    assert gw.tts_active == 0


async def test_a_context_speaks_its_text_in_order_with_words_then_done_and_frees_its_slot(contexts):
    gw, ctxs, sink = contexts(rate=16000)
    ctxs.text("a", "Hello there, how are you?", None)
    assert gw.tts_active == 1  # its slot, held while it lives
    ctxs.end("a")
    done = await sink.wait(lambda e: isinstance(e, ContextDone))
    audio = [e for e in sink.of("a") if isinstance(e, ContextAudio)]
    assert [e.seq for e in audio] == list(range(len(audio))) and audio
    assert sum(len(e.data) for e in audio) > 0.3 * 2 * 16000  # PCM16 at the asked rate: some tenths of a second
    assert abs(done.duration_ms - sum(e.duration_ms for e in audio)) < 1.0
    words = [w for e in audio for w in e.words]
    assert "".join(w.word for w in words).startswith("Hello there"), words  # the tone engine's: a letter each
    assert all(a.end_ms <= b.start_ms + 1.0 for a, b in zip(words, words[1:]))
    await asyncio.sleep(0)  # its task's finally
    assert gw.tts_active == 0 and "a" not in ctxs.contexts


async def test_cancel_stops_one_context_and_frees_its_slot_while_another_goes_on(contexts):
    gw, ctxs, sink = contexts()
    # Neither has its `end` yet, so both are open whatever the tone engine's pace.
    ctxs.text("long", "This is a long answer that goes on and on. " * 6, None)
    ctxs.text("short", "Short one.", None)
    assert gw.tts_active == 2
    await sink.wait(lambda e: isinstance(e, ContextAudio) and e.context.id == "long")
    ctxs.cancel("long")
    assert isinstance(sink.events[-1], ContextCancelled) and sink.events[-1].context_id == "long"
    assert gw.tts_active == 1
    cancelled_at = len(sink.events)
    ctxs.end("short")
    await sink.wait(lambda e: isinstance(e, ContextDone) and e.context.id == "short")
    # The cancelled context's task is stopped: nothing of it was made after its cancel.
    assert not [e for e in sink.events[cancelled_at:] if _cid(e) == "long"]
    assert gw.tts_active == 0
    # A cancel of an ended context is acknowledged; an unknown one is an error naming it.
    ctxs.cancel("long")
    assert isinstance(sink.events[-1], ContextCancelled)
    with pytest.raises(GatewayError) as raised:
        ctxs.cancel("never")
    assert (raised.value.code, raised.value.id) == ("unknown_context", "never")


async def test_limits_refuse_with_a_retry_a_failure_is_the_last_word_and_close_frees_every_slot(contexts):
    gw, ctxs, sink = contexts(tts_ws_max_contexts=1, max_utterance_chars=40)
    ctxs.text("a", "Hi.", None)
    with pytest.raises(GatewayError) as raised:
        ctxs.text("b", "Hi.", None)
    assert (raised.value.code, raised.value.status, raised.value.id) == ("too_many_contexts", 429, "b")
    ctxs.flush("b")  # refused for want of room: ignored, not another error
    # Over the context's text limit: it fails, with one error naming it, and gives up its slot.
    ctxs.text("a", "x" * 40, None)
    error = sink.events[-1]
    assert isinstance(error, ContextError) and (error.code, error.context_id) == ("text_too_long", "a")
    assert gw.tts_active == 0
    ctxs.text("a", "more", None)  # its error was its last word
    ctxs.end("a")
    assert sink.events[-1] is error
    ctxs.text("b", "Now there is room.", None)  # the refused one, retried
    assert gw.tts_active == 1
    ctxs.close()
    assert gw.tts_active == 0 and not ctxs.contexts


async def test_a_context_with_only_flushes_ends_idle_and_gives_up_its_slot(contexts):
    gw, ctxs, sink = contexts(tts_ws_context_idle_s=0.3)
    ctxs.text("a", "   ", None)  # blank text is not new text
    assert gw.tts_active == 1
    ctxs.flush("a")
    error = await sink.wait(lambda e: isinstance(e, ContextError))
    assert (error.code, error.context_id) == ("context_idle", "a")
    assert gw.tts_active == 0


async def test_opus_contexts_send_20_ms_packets_on_a_48_khz_clock(contexts):
    gw, ctxs, sink = contexts(fmt="opus")
    assert ctxs.sample_rate == 48000
    ctxs.text("a", "One two three.", None)
    ctxs.end("a")
    await sink.wait(lambda e: isinstance(e, ContextDone))
    audio = [e for e in sink.events if isinstance(e, ContextAudio) and e.data]
    assert audio and all(e.duration_ms == 20.0 for e in audio)
    assert [e.start_ms for e in audio] == [20.0 * i for i in range(len(audio))]
