"""Voxgate's voice as a LiveKit Agents TTS: `pip install ".[livekit]"` in the clone.

    from voxgate.integrations.livekit import VoxgateTTS
    session = AgentSession(tts=VoxgateTTS(url="http://127.0.0.1:8080"), ...)

It streams: the agent's LLM tokens go to the gateway as they arrive, over one
`GET /v1/tts/ws` connection shared by every utterance of this TTS (each is its own
context), and the audio comes back as it is made, with each word's start and end
(`aligned_transcript`), so LiveKit's transcription follows the speech word by word.
`synthesize(text)` goes through the same stream. Closing a stream early (an
interruption) cancels its context on the gateway, which stops within one chunk.
"""

from __future__ import annotations

import asyncio
import base64
import weakref

import aiohttp

try:
    from livekit.agents import tts, utils
    from livekit.agents._exceptions import APIConnectionError, APIError, APIStatusError, APITimeoutError
    from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions, TimedString
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError('voxgate.integrations.livekit needs LiveKit Agents: pip install ".[livekit]" in the voxgate clone') from exc

from ._tts_ws import ConnectionLost, TTSWebSocket, TTSWebSocketError

# The embedded voice's own rate, so by default the gateway does not resample.
DEFAULT_SAMPLE_RATE = 22050


class VoxgateTTS(tts.TTS):
    def __init__(self, *, url: str = "http://127.0.0.1:8080", api_key: str | None = None,
                 voice: str | None = None, sample_rate: int = DEFAULT_SAMPLE_RATE,
                 http_session: aiohttp.ClientSession | None = None) -> None:
        """`url`: the gateway (http(s):// or ws(s)://); `api_key`: one of its keys, if it has any;
        `voice`: one of the gateway's voice names (its default if None); `sample_rate`: of the
        PCM16 the gateway sends (it resamples to it, 8000 to 48000)."""
        if not 8000 <= int(sample_rate) <= 48000:
            raise ValueError("sample_rate must be from 8000 to 48000")
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
                         sample_rate=int(sample_rate), num_channels=1)
        self._url = url
        self._api_key = api_key
        self._voice = voice
        self._session = http_session
        self._conn: TTSWebSocket | None = None
        self._connecting = asyncio.Lock()
        self._streams: weakref.WeakSet[SynthesizeStream] = weakref.WeakSet()

    @property
    def model(self) -> str:
        return "voxgate"

    @property
    def provider(self) -> str:
        return "voxgate"

    def update_options(self, *, voice: str | None = None) -> None:
        """The voice of streams opened from now on (the connection's default if None)."""
        self._voice = voice

    async def _connection(self, timeout: float) -> TTSWebSocket:
        async with self._connecting:
            if self._conn is None or self._conn.closed:
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                conn = TTSWebSocket(self._url, api_key=self._api_key, sample_rate=self.sample_rate,
                                    session=self._session)
                try:
                    await conn.connect(timeout)
                except asyncio.TimeoutError:
                    raise APITimeoutError("the Voxgate gateway did not answer in time") from None
                except TTSWebSocketError as exc:
                    if exc.status is not None:
                        raise APIStatusError(f"Voxgate refused the connection: {exc.message}",
                                             status_code=exc.status) from None
                    raise APIError(f"Voxgate: {exc}", retryable=False) from None
                except (aiohttp.ClientError, OSError) as exc:
                    raise APIConnectionError(f"cannot reach the Voxgate gateway at {self._url}: {exc}") from None
                self._conn = conn
            return self._conn

    def prewarm(self) -> None:
        async def _warm() -> None:
            try:
                await self._connection(DEFAULT_API_CONNECT_OPTIONS.timeout)
            except APIError:
                pass  # the first stream reports it

        asyncio.ensure_future(_warm())

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> tts.ChunkedStream:
        return self._synthesize_with_stream(text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        stream = SynthesizeStream(tts=self, conn_options=conn_options)
        self._streams.add(stream)
        return stream

    async def aclose(self) -> None:
        for stream in list(self._streams):
            await stream.aclose()
        self._streams.clear()
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


class SynthesizeStream(tts.SynthesizeStream):
    """One utterance: one context on the TTS's connection."""

    def __init__(self, *, tts: VoxgateTTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: VoxgateTTS = tts
        self._voice = tts._voice
        self._pending_cancels: set[asyncio.Task] = set()

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        context_id = utils.shortuuid("vg_")
        output_emitter.initialize(request_id=context_id, sample_rate=self._tts.sample_rate, num_channels=1,
                                  mime_type="audio/pcm", stream=True)
        conn = await self._tts._connection(self._conn_options.timeout)
        try:
            ctx = conn.context(context_id)
        except ConnectionLost as exc:  # it closed just now (the gateway's idle timeout): LiveKit retries
            raise APIConnectionError(f"Voxgate: {exc.message}") from None
        opened = False
        finished = False

        async def send_input() -> None:
            nonlocal opened
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    if opened:
                        await ctx.flush()
                    continue
                if not data:
                    continue
                message = {"type": "text", "context_id": context_id, "text": data}
                if not opened:
                    if self._voice:
                        message["voice"] = self._voice
                    output_emitter.start_segment(segment_id=context_id)
                    opened = True
                self._mark_started()
                await conn.send(message)
            if opened:
                await ctx.end()
            else:  # no text at all: nothing will come back
                ctx.queue.put_nowait({"type": "done", "context_id": context_id, "duration_ms": 0})

        async def receive() -> None:
            nonlocal finished
            async for message in ctx:
                kind = message["type"]
                if kind == "audio":
                    for w in message.get("words") or ():
                        output_emitter.push_timed_transcript(
                            TimedString(f"{w['word']} ", start_time=w["start_ms"] / 1000.0,
                                        end_time=w["end_ms"] / 1000.0))
                    if message["audio"]:
                        output_emitter.push(base64.b64decode(message["audio"]))
                elif kind in ("done", "cancelled"):
                    finished = True
            if opened:
                output_emitter.end_segment()

        tasks = [asyncio.ensure_future(send_input()), asyncio.ensure_future(receive())]
        try:
            await asyncio.gather(*tasks)
        except TTSWebSocketError as exc:
            if isinstance(exc, ConnectionLost):
                raise APIConnectionError(f"Voxgate: {exc.message}") from None
            raise APIError(f"Voxgate refused the text: {exc}", retryable=False) from None
        finally:
            await utils.aio.gracefully_cancel(*tasks)
            if opened and not finished and not conn.closed:
                # Interrupted (the stream was closed) or failed: stop the gateway's work on it.
                task = asyncio.ensure_future(_quiet(ctx.cancel()))
                self._pending_cancels.add(task)
                task.add_done_callback(self._pending_cancels.discard)
            ctx.close()


async def _quiet(coro) -> None:
    try:
        await coro
    except (TTSWebSocketError, OSError):
        pass


__all__ = ["VoxgateTTS", "SynthesizeStream"]
