"""Inline speech tags: parsed across units and deltas, rendered as silence, rate and spelling, never spoken."""

import io
import wave

import aiohttp
import numpy as np
import pytest

from voxgate.engine import tone
from voxgate.engine.runtime.client import EngineClient
from voxgate.engine.text.segmenter import Segmenter, speakable
from voxgate.engine.text.tags import Pause, Speech, TagState, break_ms, rate_factor
from voxgate.rtc_client import RtcClient


def units_pieces(pieces_in: list[str], engine_tags=frozenset()) -> list:
    seg, state, out = Segmenter(), TagState(engine_tags=engine_tags), []
    for piece in pieces_in:
        for unit in seg.push(piece):
            out.extend(state.pieces(unit.raw))
    for unit in seg.end():
        out.extend(state.pieces(unit.raw))
    return out


def longest_silence_s(pcm: np.ndarray, rate: int, threshold: int = 300) -> float:
    """The longest quiet run between the first and last loud samples."""
    loud = np.nonzero(np.abs(pcm.astype(np.int32)) > threshold)[0]
    if loud.size < 2:
        return 0.0
    return float(np.diff(loud).max()) / rate


# The parser
def test_text_without_tags_is_exactly_what_speakable_gives():
    for raw in ["Hello there, world. ", "**Bold** and `code` 😀 here", "See https://example.com/x now.", "a < b"]:
        assert TagState().pieces(raw) == ([Speech(speakable(raw))] if speakable(raw) else [])


def test_break_times_and_strengths():
    assert break_ms({"time": "500ms"}) == 500
    assert break_ms({"time": "1s"}) == 1000
    assert break_ms({"time": "1.5s"}) == 1500
    assert break_ms({"time": "99s"}) == 10000  # capped
    assert break_ms({"strength": "strong"}) == 700
    assert break_ms({}) == 400


def test_rates():
    assert rate_factor("slow") < 1 < rate_factor("fast") < rate_factor("x-fast")
    assert rate_factor("150%") == 1.5 and rate_factor("+20%") == pytest.approx(1.2) and rate_factor("-50%") == 0.5
    assert rate_factor("1000%") == 4.0 and rate_factor("nonsense") == 1.0


def test_a_tag_split_across_deltas_is_honoured_and_never_spoken():
    pieces = units_pieces(["Hello <br", 'eak time="300ms"/> world'])
    assert pieces == [Speech("Hello "), Pause(300), Speech("world")]


def test_prosody_spanning_sentences_keeps_applying_until_closed():
    pieces = units_pieces(['<prosody rate="slow">First sentence here. ', "Second one too.</prosody> ", "Then normal again."])
    texts = [(p.text.strip(), p.rate) for p in pieces if isinstance(p, Speech)]
    assert texts == [("First sentence here.", 0.8), ("Second one too.", 0.8), ("Then normal again.", 1.0)]


def test_nested_prosody_multiplies():
    pieces = TagState().pieces('<prosody rate="200%">a <prosody rate="fast">b</prosody> c</prosody>')
    assert [(p.text.strip(), p.rate) for p in pieces] == [("a", 2.0), ("b", 2.5), ("c", 2.0)]


def test_unknown_tags_are_dropped_but_engine_tags_are_kept():
    assert units_pieces(["<whispering>Quietly</whispering> now <laughing> ok."]) == [Speech("Quietly now ok.")]
    kept = units_pieces(["<laughing> ok."], engine_tags=frozenset({"laughing"}))
    assert kept == [Speech("<laughing>ok.")]


def test_say_as_characters_spells():
    pieces = units_pieces(['Code <say-as interpret-as="characters">abc1</say-as> works.'])
    assert pieces == [Speech("Code "), Speech("A, B, C, 1 works.")]
    assert units_pieces(['<say-as interpret-as="cardinal">42</say-as>']) == [Speech("42")]  # other kinds: said as written


def test_a_unit_that_is_only_a_break_still_renders():
    assert TagState().pieces('<break time="1s"/>') == [Pause(1000)]


# Rendering, through the real worker
async def speak(client: EngineClient, pieces: list[str]) -> np.ndarray:
    stream = client.stream()
    for piece in pieces:
        stream.push_text(piece)
    stream.end_input()
    return np.concatenate([c.pcm async for c in stream])


async def test_worker_renders_a_split_break_as_silence(tone_client):
    pcm = await speak(tone_client, ["Hello <br", 'eak time="300ms"/> world'])
    assert tone.decode(pcm, tone.SAMPLE_RATE) == "Hello world"
    gap = longest_silence_s(pcm, tone.SAMPLE_RATE)
    assert 0.300 <= gap <= 0.300 + tone.SYMBOL_S
    plain = await speak(tone_client, ["Hello world"])
    assert longest_silence_s(plain, tone.SAMPLE_RATE) < 0.05


async def test_worker_drops_unknown_tags_and_spells(tone_client):
    pcm = await speak(tone_client, ["<whisp", "ering>Quiet</whispering> ", 'code <say-as interpret-as="characters">xy</say-as>'])
    assert tone.decode(pcm, tone.SAMPLE_RATE) == "Quiet code X, Y"


# Over WebRTC, token by token
async def test_split_tag_over_the_data_channel_gives_a_gap_and_no_tag_text(tone_server):
    async with RtcClient(tone_server.url) as client:
        sent = client.send({"type": "text.delta", "text": "Hello <br", "id": "t"})
        client.send({"type": "text.delta", "text": 'eak time="300ms"/> world', "id": "t"})
        client.send({"type": "text.end", "id": "t"})
        done = await client.wait_for("utterance.done", id="t", timeout=20)
        await client.wait_tail(done)
        pcm = client.audio.pcm(since=sent)
        rate = client.audio.sample_rate
    decoded = tone.decode(pcm, rate)
    assert decoded.strip() == "Hello world"
    assert "<" not in decoded and "break" not in decoded
    assert done["text"].replace(" ", "") == "Helloworld"
    # A ~300 ms silence inside the speech: samples, not clocks.
    start, end = np.nonzero(np.abs(pcm.astype(np.int32)) > 300)[0][[0, -1]]
    assert 0.27 <= longest_silence_s(pcm[start : end + 1], rate) <= 0.45


# The voice: prosody changes the duration, breaks add silence
async def test_prosody_rate_and_break_change_the_voice_audio(piper_server):
    sentence = "The quick brown fox jumps over the lazy dog."

    async def duration(text: str) -> float:
        async with aiohttp.ClientSession() as http:
            async with http.post(piper_server.url + "/v1/tts", json={"text": text, "format": "wav"}) as resp:
                assert resp.status == 200
                data = await resp.read()
        with wave.open(io.BytesIO(data)) as wav:
            return len(wav.readframes(10**9)) / 2 / wav.getframerate()

    plain = await duration(sentence)
    slow = await duration(f'<prosody rate="x-slow">{sentence}</prosody>')
    fast = await duration(f'<prosody rate="x-fast">{sentence}</prosody>')
    paused = await duration('The quick brown fox <break time="1s"/> jumps over the lazy dog.')
    assert slow > plain * 1.3
    assert fast < plain * 0.8
    assert paused > plain + 0.8
