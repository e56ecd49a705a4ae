"""Voxgate's voice as a pipecat TTS service: `pip install ".[pipecat]"` in the clone.

    from voxgate.integrations.pipecat import VoxgateTTSService
    tts = VoxgateTTSService(url="http://127.0.0.1:8080")
    pipeline = Pipeline([..., llm, tts, transport.output()])

It keeps one `GET /v1/tts/ws` connection open. Each of the bot's turns is one
context on it: the turn's text goes in as pipecat hands it over (a sentence at a
time, or token by token with `text_aggregation_mode=TextAggregationMode.TOKEN`),
and the audio comes back as the gateway makes it, as `TTSAudioRawFrame`s, with
each word's start time, so pipecat emits `TTSTextFrame`s in step with the speech
and an interrupted turn adds only what was heard to the LLM's context. An
interruption cancels the context on the gateway, which stops within one chunk.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

try:
    from loguru import logger
    from pipecat.frames.frames import ErrorFrame, Frame, StartFrame, TTSAudioRawFrame, TTSStoppedFrame
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
    from websockets.exceptions import InvalidStatus
    from websockets.protocol import State
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError('voxgate.integrations.pipecat needs pipecat: pip install ".[pipecat]" in the voxgate clone') from exc

from ._tts_ws import READY_TIMEOUT_S, TTSWebSocketError, ws_url


@dataclass
class VoxgateTTSSettings(TTSSettings):
    """Runtime-updatable settings: `voice` (one of the gateway's voice names; None for its default)."""


class VoxgateTTSService(WebsocketTTSService):
    """Streams a bot's speech from a Voxgate gateway over `/v1/tts/ws`, with word timestamps."""

    Settings = VoxgateTTSSettings
    _settings: VoxgateTTSSettings
    _websocket: Any  # websockets' connection, opened by _connect_websocket

    def __init__(self, *, url: str = "http://127.0.0.1:8080", api_key: str | None = None,
                 voice: str | None = None, sample_rate: int | None = None,
                 text_aggregation_mode: TextAggregationMode | None = None,
                 settings: VoxgateTTSSettings | None = None, **kwargs) -> None:
        """`url`: the gateway (http(s):// or ws(s)://); `api_key`: one of its keys, if it has any;
        `voice`: one of the gateway's voice names (its default if None); `sample_rate`: the
        pipeline's output rate unless given (the gateway resamples, 8000 to 48000)."""
        default_settings = self.Settings(model=None, voice=voice, language=None)
        if settings is not None:
            default_settings.apply_update(settings)
        super().__init__(
            text_aggregation_mode=text_aggregation_mode,
            # Word timestamps make the TTSTextFrames, so pipecat does not push the text itself.
            push_text_frames=False,
            push_start_frame=True,
            pause_frame_processing=False,
            sample_rate=sample_rate,
            settings=default_settings,
            **kwargs,
        )
        ws_url(url, {})  # a bad URL fails here, not at the first word
        self._url = url
        self._api_key = api_key
        self._receive_task: asyncio.Task | None = None
        self._open_contexts: set[str] = set()  # contexts this connection has had text for
        self.ready: dict = {}

    def can_generate_metrics(self) -> bool:
        return True

    async def start(self, frame: StartFrame):
        await super().start(frame)  # the output sample rate is known from here on
        await self._connect()

    async def _connect(self):
        await super()._connect()
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self):
        await super()._disconnect()
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self):
        try:
            if self._websocket and self._websocket.state is State.OPEN:
                return
            url = ws_url(self._url, {"format": "pcm16", "sample_rate": str(self.sample_rate), "words": "true"})
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            self._websocket = await self._websocket_connect(url, additional_headers=headers, max_size=2**22)
            # The server's first message says the connection is usable.
            ready = json.loads(await asyncio.wait_for(self._websocket.recv(), READY_TIMEOUT_S))
            if ready.get("type") != "ready":
                raise TTSWebSocketError(str(ready.get("code", ready.get("type"))), str(ready.get("message", "")))
            self.ready = ready
            self._open_contexts.clear()
            await self._call_event_handler("on_connected")
        except Exception as e:
            error: Exception = e
            if isinstance(e, InvalidStatus):
                body = e.response.body.decode("utf-8", "replace")[:300] if e.response.body else ""
                error = TTSWebSocketError(str(e.response.status_code), body, e.response.status_code)
            await self.push_error(error_msg=f"Voxgate /v1/tts/ws: {error}", exception=error)
            if self._websocket:
                await self._websocket.close()
            self._websocket = None
            await self._call_event_handler("on_connection_error", f"{error}")

    async def _disconnect_websocket(self):
        try:
            await self.stop_all_metrics()
            if self._websocket:
                await self._websocket.close()
        except Exception as e:
            await self.push_error(error_msg=f"Voxgate: closing the connection failed: {e}", exception=e)
        finally:
            self._websocket = None
            self._open_contexts.clear()
            await self._call_event_handler("on_disconnected")

    def _get_websocket(self):
        if self._websocket:
            return self._websocket
        raise ConnectionError("the Voxgate /v1/tts/ws connection is not open")

    async def _send(self, message: dict) -> None:
        await self._get_websocket().send(json.dumps(message, separators=(",", ":")))

    async def on_audio_context_interrupted(self, context_id: str):
        """The bot was interrupted: the gateway stops this context's synthesis at once."""
        await self.stop_all_metrics()
        if context_id in self._open_contexts and self._websocket:
            self._open_contexts.discard(context_id)
            try:
                await self._send({"type": "cancel", "context_id": context_id})
            except Exception as e:  # the connection is gone, and the context with it
                logger.debug(f"{self}: cancel of {context_id} not sent: {e}")
        await super().on_audio_context_interrupted(context_id)

    async def flush_audio(self, context_id: str | None = None):
        """The turn's text is complete: the context ends after its last audio."""
        flush_id = context_id or self.get_active_audio_context_id()
        if not flush_id or flush_id not in self._open_contexts or not self._websocket:
            return
        await self._send({"type": "end", "context_id": flush_id})

    async def _receive_messages(self):
        async for message in self._get_websocket():
            msg = json.loads(message)
            kind = msg.get("type")
            ctx_id = msg.get("context_id")
            if kind == "error" and ctx_id is None:
                if msg.get("code") == "idle_timeout":  # the gateway closes an idle connection: reconnect quietly
                    logger.debug(f"{self}: {msg.get('message')}")
                else:
                    await self.push_error(error_msg=f"Voxgate: {msg.get('code')}: {msg.get('message')}")
                continue
            if kind in ("done", "cancelled", "error"):
                self._open_contexts.discard(ctx_id)
            if not ctx_id or not self.audio_context_available(ctx_id):
                continue  # an interrupted context's last messages
            if kind == "audio":
                words = msg.get("words")
                if words:
                    await self.add_word_timestamps([(w["word"], w["start_ms"] / 1000.0) for w in words], ctx_id)
                audio = base64.b64decode(msg["audio"])
                if audio:
                    await self.append_to_audio_context(
                        ctx_id, TTSAudioRawFrame(audio=audio, sample_rate=self.sample_rate, num_channels=1,
                                                 context_id=ctx_id))
            elif kind == "done":
                await self.stop_ttfb_metrics()
                await self.append_to_audio_context(ctx_id, TTSStoppedFrame(context_id=ctx_id))
                await self.remove_audio_context(ctx_id)
            elif kind == "error":
                await self.stop_all_metrics()
                await self.push_error(error_msg=f"Voxgate: {msg.get('code')}: {msg.get('message')}")
                await self.append_to_audio_context(ctx_id, TTSStoppedFrame(context_id=ctx_id))
                await self.remove_audio_context(ctx_id)

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send the text to the turn's context; its audio arrives on the receive task."""
        try:
            if not self._websocket or self._websocket.state is State.CLOSED:
                await self._connect()
            message: dict = {"type": "text", "context_id": context_id, "text": text}
            if context_id not in self._open_contexts:
                if self._settings.voice:
                    message["voice"] = self._settings.voice
                self._open_contexts.add(context_id)
            await self._send(message)
            if not self._is_streaming_tokens:
                # A whole sentence from pipecat's aggregator: speak it now rather than
                # wait for what follows it.
                await self._send({"type": "flush", "context_id": context_id})
            await self.start_tts_usage_metrics(text)
            yield None
        except Exception as e:
            self._open_contexts.discard(context_id)
            yield ErrorFrame(error=f"Voxgate: sending text failed: {e}")
            yield TTSStoppedFrame(context_id=context_id)


__all__ = ["VoxgateTTSService", "VoxgateTTSSettings"]
