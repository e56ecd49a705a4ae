"""gateway/backends/relay_play.py's pure parts: a container named by its first bytes, decoded at the output's rate
(48 kHz for WebRTC's Opus, 8 kHz for a phone) within the duration cap, and a clip's loops within it."""

from __future__ import annotations

import numpy as np
import pytest

from voxgate.gateway.backends.relay_play import ClipStream, PlayRefused, container_of, decode

from tests.relay.audio_server import TONE_HZ, mp3_file, tone, wav_file


def dominant_hz(pcm: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64)))
    return float(np.argmax(spectrum) * rate / len(pcm))


@pytest.mark.parametrize("rate", [48000, 8000])
def test_wav_and_mp3_decode_at_the_outputs_rate_within_the_cap(rate):
    for data in (wav_file(tone(0.6)), mp3_file(tone(0.6))):
        pcm = decode(data, rate, max_s=10.0)
        assert abs(len(pcm) / rate - 0.6) < 0.08, len(pcm) / rate  # an MP3 adds its encoder's delay
        assert abs(dominant_hz(pcm, rate) - TONE_HZ) < 5
        assert len(decode(data, rate, max_s=0.25)) == int(0.25 * rate)  # decoding stops at the cap


def test_only_audio_containers_named_by_their_first_bytes_are_opened():
    assert container_of(wav_file(tone(0.1))[:16]) == "wav" and container_of(mp3_file(tone(0.1))[:16]) == "mp3"
    for head in (b"#EXTM3U\n#EXT-X-VERSION:3\n", b"ffconcat version 1.0\n", b"\x89PNG\r\n\x1a\n", b"<html>",
                 b"RIFF\x00\x00\x00\x00AVI "):
        assert container_of(head) is None, head
        with pytest.raises(PlayRefused, match="not audio"):
            decode(head + bytes(1000), 8000, 10.0)


async def test_a_clips_loops_and_loop_zero_stay_within_the_cap():
    async def played(loops: int, max_s: float) -> int:
        clip = ClipStream(8000, loops, max_s)
        clip.set_audio(np.ones(4000, np.int16))  # 0.5 s
        return sum([len(chunk.pcm) async for chunk in clip])

    assert await played(1, 10.0) == 4000 and await played(3, 10.0) == 12000
    assert await played(3, 1.2) == 9600 and await played(0, 2.0) == 16000
