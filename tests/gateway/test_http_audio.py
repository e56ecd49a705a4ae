"""gateway/peerless/http_audio.py: speech audio as it leaves without a peer. Each format's bytes from the
engine's PCM, the WebSocket's pieces, and a compressed format's price (slots, one thread, a pace,
its CPU charged to its caller). End to end over HTTP: tests/http/, tests/security/test_compressed_cost.py."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from voxgate.gateway.media import opus
from voxgate.gateway.peerless.http_audio import (
    COMPRESSED_CORE_SHARE, FORMAT_FAMILIES, FormatRun, OpusPackets, Pcm16Pieces, WavFormatter,
    pause_after, slots_of, threads_of,
)
from voxgate.gateway.load.late_blame import LateBlame

RATE = 16000  # the tone engine's and Piper's low voices' rate


def tone(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (np.sin(2 * np.pi * 440 * t) * 8000).astype(np.int16)


def formatted(formatter, pcm: np.ndarray, piece: int = RATE // 10) -> bytes:
    data = formatter.start()
    for i in range(0, len(pcm), piece):
        data += formatter.feed(pcm[i : i + piece])
    return data + formatter.finish()


def test_wav_has_an_open_ended_header_and_the_pcm_as_it_came():
    pcm = tone(0.5)
    data = formatted(WavFormatter(RATE), pcm)
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[36:40] == b"data"
    assert struct.unpack("<I", data[4:8])[0] == 0xFFFFFFFF  # the size unknown while streaming
    assert struct.unpack("<I", data[24:28])[0] == RATE
    assert np.array_equal(np.frombuffer(data[44:], dtype="<i2"), pcm)


@pytest.mark.parametrize("family, fmt, rate", [("tts", "pcm", RATE), ("openai", "pcm", 24000), ("tts", "mulaw", 8000)])
def test_raw_formats_come_at_their_rate(family, fmt, rate):
    formatter = FORMAT_FAMILIES[family][fmt](RATE)
    assert formatter.sample_rate == rate
    data = formatted(formatter, tone(1.0))
    width = 1 if fmt == "mulaw" else 2
    assert abs(len(data) / width - rate) < rate * 0.01  # one second, resampled, nothing lost at the end


@pytest.mark.parametrize("fmt, magic", [("opus", b"OggS"), ("mp3", None), ("aac", b"\xff"), ("flac", b"fLaC")])
def test_compressed_formats_stream_their_container(fmt, magic):
    formatter = FORMAT_FAMILIES["openai"][fmt](RATE)
    try:
        data = formatted(formatter, tone(1.0))
    finally:
        formatter.close()
    assert len(data) > 1000
    if magic is not None:
        assert data.startswith(magic)


def test_the_websockets_opus_packets_are_20_ms_each_and_decode_back():
    packets = OpusPackets(RATE)
    out = packets.feed(tone(0.51)) + packets.finish()
    assert len(out) == 26  # 0.51 s at 48 kHz, the last frame padded with silence
    decoder = opus.Decoder(48000)
    decoded = np.concatenate([decoder.decode(p) for p in out])
    assert len(decoded) == 26 * 960
    assert np.abs(decoded[4800:19200]).mean() > 1000  # the tone came through, not silence
    pieces = Pcm16Pieces(RATE, 24000)
    assert sum(len(p) for p in pieces.feed(tone(1.0)) + pieces.finish()) == pytest.approx(48000, rel=0.01)


def test_a_compressed_format_costs_more_slots_has_one_thread_and_is_priced():
    assert slots_of("aac") > slots_of("wav") and slots_of("mp3") > slots_of("pcm") and slots_of("opus") > 1
    assert threads_of("aac") is threads_of("mp3") is not threads_of("wav")
    assert pause_after("wav", 0.1) == 0.0
    assert pause_after("aac", 0.1) == pytest.approx(0.1 * (1 / COMPRESSED_CORE_SHARE - 1))


async def test_a_format_run_paces_a_compressed_encode_charges_its_tenant_and_sheds_through_its_route():
    blame = LateBlame(10.0)
    shed: list[str] = []

    def burn() -> int:
        until = time.thread_time() + 0.02
        n = 0
        while time.thread_time() < until:
            n += 1
        return n

    run = FormatRun("aac", blame, "key:a", shed.append)
    started = time.monotonic()
    assert await run.run(burn) > 0
    elapsed = time.monotonic() - started
    charged = blame.load("key:a") * blame.window_s
    assert charged >= 0.02
    # The pace: after t of CPU it waits t * (1 / share - 1), so the call took at least t / share.
    assert elapsed >= charged / COMPRESSED_CORE_SHARE * 0.95, (elapsed, charged)
    run.shed("late frames")
    assert shed == ["late frames"]
    run.forget()
    assert not blame._sources  # nothing left of it to shed
