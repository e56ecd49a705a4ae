"""POST /v1/tts: audio streamed back while it is synthesized, in four formats, with the gateway's limits."""

import io
import wave

import aiohttp
import av
import numpy as np
import pytest

from voxgate.engine import tone
from voxgate.gateway.media.encoder import ulaw_decode

TEXT = "Streaming speech over plain HTTP."


async def post(url: str, body, headers: dict | None = None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as http:
        kwargs = {"json": body} if not isinstance(body, (bytes, str)) else {"data": body}
        async with http.post(url + "/v1/tts", headers=headers or {}, **kwargs) as resp:
            return resp.status, dict(resp.headers), await resp.read()


def decode_opus(data: bytes) -> tuple[np.ndarray, int]:
    with av.open(io.BytesIO(data)) as container:
        assert container.format.name == "ogg"
        assert container.streams.audio[0].codec_context.name == "opus"
        frames = [f for f in container.decode(audio=0)]
    pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    if pcm.dtype.kind == "f":
        pcm = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
    return pcm, frames[0].sample_rate


async def test_wav_streams_with_an_open_ended_header_and_decodes_to_the_text(tone_server):
    status, headers, body = await post(tone_server.url, {"text": TEXT, "format": "wav"})
    assert status == 200, body
    assert headers["Content-Type"].startswith("audio/wav")
    assert headers.get("Transfer-Encoding") == "chunked"
    assert body[4:8] == b"\xff\xff\xff\xff"  # size unknown while streaming
    with wave.open(io.BytesIO(body)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, tone.SAMPLE_RATE)
        pcm = np.frombuffer(wav.readframes(10**9), dtype=np.int16)
    assert len(pcm) / tone.SAMPLE_RATE == pytest.approx(len(TEXT.encode()) * tone.SYMBOL_S, abs=0.05)
    assert tone.decode(pcm, tone.SAMPLE_RATE) == TEXT


@pytest.mark.parametrize("fmt", ["pcm", "mulaw", "opus"])
async def test_pcm_mulaw_and_ogg_opus_are_valid_and_decode_to_the_text(tone_server, fmt):
    status, headers, body = await post(tone_server.url, {"text": TEXT, "format": fmt})
    assert status == 200, body
    rate = int(headers["X-Sample-Rate"])
    if fmt == "pcm":
        assert rate == tone.SAMPLE_RATE and headers["Content-Type"].startswith("audio/L16")
        pcm = np.frombuffer(body, dtype="<i2")
    elif fmt == "mulaw":
        assert rate == 8000 and headers["Content-Type"] == "audio/basic"
        pcm = ulaw_decode(body)
    else:
        assert rate == 48000 and headers["Content-Type"].startswith("audio/ogg")
        pcm, rate = decode_opus(body)
        assert rate == 48000
    assert len(pcm) / rate == pytest.approx(len(TEXT.encode()) * tone.SYMBOL_S, abs=0.08)
    assert tone.decode(pcm, rate) == TEXT


async def test_first_bytes_leave_before_the_last_unit_is_synthesized(server_factory):
    # The server logs, per request, when its first bytes were handed to the
    # connection and when the engine began the last unit, on the monotonic clock
    # that the gateway and its worker share. A response buffered until synthesis
    # ended would send its first bytes after the last unit had started.
    server = server_factory("piper", ["--log-json"])
    text = " ".join(f"This is sentence number {i} of a long text that the voice reads out." for i in range(1, 6))
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/tts", json={"text": text, "format": "pcm"}) as resp:
            assert resp.status == 200
            body = await resp.read()
    assert len(body) / 2 / 22050 > 6.0  # five sentences of speech
    entry = await server.wait_log(lambda e: e["message"].startswith("tts request"))
    assert entry["units"] == 5, entry
    assert entry["first_bytes_ms"] < entry["last_unit_synthesis_started_ms"], entry


async def test_tags_work_over_http(tone_server):
    status, _, body = await post(tone_server.url, {"text": 'Hi <whispering>there</whispering> <say-as interpret-as="characters">ok</say-as>', "format": "pcm"})
    assert status == 200
    assert tone.decode(np.frombuffer(body, dtype="<i2"), tone.SAMPLE_RATE) == "Hi there O, K"


@pytest.mark.parametrize(
    "body, code",
    [
        (b"not json", "invalid_json"),
        (b"\xff\xfe", "invalid_utf8"),
        (b"[1, 2]", "invalid_json"),
        ({"text": ""}, "invalid_field"),
        ({"text": 5}, "invalid_field"),
        ({"text": "hi", "format": "mp3"}, "invalid_field"),
        ({"text": "hi", "rate": 9}, "invalid_field"),
        ({"text": "hi", "voice": "nobody"}, "unknown_voice"),
        ({"text": "x" * 20001}, "text_too_long"),
    ],
)
async def test_bad_requests_get_json_errors(tone_server, body, code):
    status, headers, data = await post(tone_server.url, body)
    assert status == 400
    assert headers["Content-Type"].startswith("application/json")
    import json

    assert json.loads(data)["error"]["code"] == code


async def test_an_oversized_body_is_refused(tone_server):
    status, _, data = await post(tone_server.url, b'{"text": "' + b"a" * 200_000 + b'"}')
    assert status == 413 and b"too_large" in data


async def test_a_client_that_hangs_up_mid_stream_leaves_the_server_serving(server_factory):
    server = server_factory("tone", ["--log-json"])
    async with aiohttp.ClientSession() as http:
        # 156 s of 16 kHz PCM, 5 MB: more than the sockets' buffers hold, so the server is
        # still writing when the client leaves, however fast it synthesizes and encodes.
        async with http.post(server.url + "/v1/tts", json={"text": "Long. " * 650, "format": "pcm"}) as resp:
            assert resp.status == 200
            assert await resp.content.readany()
        # Leaving the block closes the connection with most of the body unread.
    # The server notices on its next write, and says so as what it is: not a server error.
    await server.wait_log(lambda e: "client went away" in e["message"])
    assert not [e for e in server.log_entries() if "Error handling request" in e["message"]]
    status, _, body = await post(server.url, {"text": "Still here.", "format": "pcm"})
    assert status == 200 and tone.decode(np.frombuffer(body, dtype="<i2"), tone.SAMPLE_RATE) == "Still here."


async def test_api_key_is_required_when_configured(server_factory):
    server = server_factory("tone", ["--api-key", "secret-1"])
    status, _, data = await post(server.url, {"text": "Hi."})
    assert status == 401 and b"unauthorized" in data
    status, _, data = await post(server.url, {"text": "Hi."}, {"Authorization": "Bearer wrong"})
    assert status == 401 and b"invalid_api_key" in data
    status, _, data = await post(server.url, {"text": "Hi.", "format": "pcm"}, {"Authorization": "Bearer secret-1"})
    assert status == 200 and tone.decode(np.frombuffer(data, dtype="<i2"), tone.SAMPLE_RATE) == "Hi."
