"""G.711 on the WebRTC path, for SIP-to-WebRTC gateways that offer only PCMU or PCMA.

A real aiortc peer offers one G.711 codec; the gateway must answer with it
and send 8 kHz speech. With the tone engine the audio decodes back to the
exact text; with the Piper voice, pocketsphinx (English model bundled with
the package) must understand it.
"""

from __future__ import annotations

import asyncio
import os
import wave

import numpy as np
import pytest
import soxr

from voxgate.engine import tone
from voxgate.rtc_client import RtcClient
from tests.speech import word_error_rate

TEXT = "Press one for sales, two for support."


@pytest.mark.parametrize("codec", ["pcmu", "pcma"])
async def test_g711_only_peer_gets_exact_audio(tone_server, codec):
    async with RtcClient(tone_server.url, codecs=[codec]) as client:
        assert client.ready["codec"] == codec
        assert client.ready["sample_rate"] == 8000
        client.send({"type": "speak", "text": TEXT})
        done = await client.wait_for("utterance.done")
        await client.wait_tail(done)  # the last packets are in flight
        assert client.audio.sample_rate == 8000
        assert tone.decode(client.audio.pcm(), client.audio.sample_rate) == TEXT
        assert done["text"] == TEXT


async def test_opus_stays_the_default(tone_server):
    async with RtcClient(tone_server.url) as client:
        assert client.ready["codec"] == "opus"


def recognize(pcm: np.ndarray, rate: int) -> str:
    from pocketsphinx import Decoder

    audio = soxr.resample(pcm.astype(np.int16), rate, 16000).astype(np.int16)
    decoder = Decoder(samprate=16000, loglevel="FATAL")
    decoder.start_utt()
    decoder.process_raw(audio.tobytes(), full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp is not None else ""


async def test_pcmu_speech_is_intelligible(piper_server, artifacts_dir):
    spoken = (
        "Please hold while I transfer your call to the billing department. "
        "Your appointment is confirmed for next Tuesday at three in the afternoon."
    )
    async with RtcClient(piper_server.url, codecs=["pcmu"]) as client:
        assert client.ready["codec"] == "pcmu"
        client.send({"type": "speak", "text": spoken})
        done = await client.wait_for("utterance.done", timeout=60)
        await client.wait_tail(done)
        pcm = client.audio.pcm()
        rate = client.audio.sample_rate
    assert rate == 8000
    with wave.open(os.path.join(artifacts_dir, "pcmu-webrtc-piper.wav"), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.astype(np.int16).tobytes())
    heard = await asyncio.get_running_loop().run_in_executor(None, recognize, pcm, rate)
    wer = word_error_rate(spoken, heard)
    print(f"\npcmu intelligibility: WER {wer:.2f}; heard {heard!r}")
    assert wer < 0.5
