"""A session relayed to a ConversationRelay application: Voxgate opens a WebSocket to the
application's URL and plays the vendor's part (Twilio's and Telnyx's hosted speech loop),
so an application written for them runs on Voxgate unchanged. docs/relay.md.

The link is the session's writer and one of its listeners, like a backend WebSocket
(gateway/backends/backend_link.py), but the connection is outbound and the words are the vendors'
(gateway/backends/relay_messages.py): the session's transcripts go out as `prompt`, its barge-ins
as `interrupt` (exactly what the caller heard), a phone's keys as `dtmf`; the application's
`text` tokens stream into one utterance at a time through the session's own messages
(`text.delta`, `text.end`), so every check and limit a backend meets applies here too. Its
`play` is an utterance of fetched audio (gateway/backends/relay_play.py); when the conversation ends,
the session's status callback hears how (gateway/backends/relay_status.py).

The connection is bounded: a connect timeout, WebSocket pings for a dead peer, a size cap
per message, a rate cap, and an address check (loopback and private ranges only with
--relay-allow-private, on every address a name resolves to). An application that cannot be
reached, closes, floods or sends what is not JSON costs its own conversation only: the
caller hears a short apology (--relay-apology) and the session ends, with one log line.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import itertools
import json
import logging
import re
import time
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from ..phone import dtmf
from . import relay_messages as wire
from ..sessions.protocol import RateLimiter
from .outbound import PrivateAddress, guarded_http, private_refusal, refuse_private_host, shown_url
from .relay_options import SENSITIVITY_MS, RelayOptions
from .relay_play import PlayRefused, RelayPlayer
from .relay_status import post_status, status_form
from ..load.view import GatewayView

if TYPE_CHECKING:
    from ..sessions.session import Session
    from ..caller.stt import SpeechToText

log = logging.getLogger(__name__)

_link_ids = itertools.count(1)
# Messages waiting to go to the application; past this it is not reading, and the conversation ends.
MAX_OUTBOX = 1000
# Over the rate for this long in a row, or this many invalid messages in a row (Telnyx's number), ends it.
MAX_FLOOD_S = 2.0
MAX_INVALID_IN_ROW = 10
# How long the apology may take to play, and speech queued before an `end` may take to finish.
APOLOGY_TIMEOUT_S = 15.0
END_DRAIN_S = 30.0
GREETING_ID = "relay-greeting"
APOLOGY_ID = "relay-apology"
# A voice's language from its name: piper's en_US-lessac-medium; names without one speak any language.
VOICE_LANGUAGE = re.compile(r"^([a-z]{2,3})[_-]([A-Z]{2})(?:[-_.]|$)")


class RelayFailure(Exception):
    """The application failed; `kind` is the metric's label, str() the log line's detail."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def twilio_signature(auth_token: str, url: str) -> str:
    """X-Twilio-Signature for a request with no POST parameters: base64(HMAC-SHA1(token, url))."""
    return base64.b64encode(hmac.new(auth_token.encode(), url.encode(), hashlib.sha1).digest()).decode("ascii")


def voice_for_language(voices: list[str], tag: str) -> str | None:
    """An installed voice that speaks the language `tag` (en-US, es): the same language and
    region first, then the same language; a voice whose name carries no language speaks any."""
    lang, _, region = tag.replace("_", "-").partition("-")
    same_language = None
    for voice in voices:
        match = VOICE_LANGUAGE.match(voice)
        if match is None:
            return voice
        if match.group(1) == lang.lower():
            if not region or match.group(2) == region.upper():
                return voice
            same_language = same_language or voice
    return same_language


def recognizer_speaks(recognizer: str | None, tag: str) -> bool:
    """Whether the server's recognizer takes `tag`: pocketsphinx's model is English; an
    OpenAI-compatible server is asked and answers for itself; none recognizes nothing."""
    if recognizer is None:
        return False
    if recognizer == "pocketsphinx":
        return tag.lower().split("-")[0].split("_")[0] == "en"
    return True


class RelayHost(GatewayView, Protocol):
    """What a relay link uses of the gateway (gateway/gateway.py's Gateway, which makes the links):
    besides the view every part has (the settings, the metrics, the engine's voices), the speech
    recognizer's name."""

    @property
    def stt(self) -> SpeechToText | None: ...


class RelayLink:
    """One session's connection to its ConversationRelay application, until the session closes."""

    def __init__(self, gw: RelayHost, session: Session, options: RelayOptions) -> None:
        self.gw = gw
        self.session = session
        self.options = options
        self.settings = gw.settings
        self.name = f"relay:{next(_link_ids)}"
        self._outcomes = gw.metrics.relay_connections
        if session.writer is None:
            session.writer = self.name
        session.add_listener(self.name, self._on_event)
        session.on_close.append(self._session_closed)
        self._outbox: asyncio.Queue[dict] = asyncio.Queue(MAX_OUTBOX)
        self._task: asyncio.Task | None = None
        self._call: dict | None = None  # the call.started event, on a phone call
        self._utterance: str | None = None  # the utterance the application's tokens go to
        self._utterance_ids = itertools.count(1)
        self._interruptible: dict[str, bool] = {}  # utterance id -> its text's `interruptible`
        self._waiting: dict[str, asyncio.Future] = {}  # utterance id -> done or interrupted
        self._settled = asyncio.Event()  # set whenever an utterance is done or interrupted
        self._over = False  # failed or ended: nothing more is taken from the application
        self._failed = False  # failed: nothing more goes to it either
        self._digits_until = 0.0  # when the DTMF tones queued by sendDigits will have been sent (monotonic)
        self._player = RelayPlayer(session, self.settings, self.name, lambda why: self._send(wire.error(why)))
        self._play_ids = itertools.count(1)
        # How the conversation ended, for the status callback: `completed` unless the application ended or failed it.
        self._outcome: tuple[str, str | None] = ("completed", None)
        self._started = time.monotonic()
        self._from_to = ("", "")
        if options.interrupt_sensitivity is not None:
            session.caller.update({"barge_in": {"min_interrupt_ms": SENSITIVITY_MS[options.interrupt_sensitivity]}})
        # The caller side decides a barge-in (gateway/caller/caller_side.py); the application's `interruptible` is its policy.
        session.caller.dtmf_interrupts = lambda uid: self._may_interrupt(uid, "dtmf")
        if options.voice is not None and options.voice in gw.engine.info.get("voices", []):
            session.options.voice = options.voice
        elif options.tts_language or options.language:
            voice = voice_for_language(gw.engine.info.get("voices", []), options.tts_language or options.language)
            if voice is not None and VOICE_LANGUAGE.match(voice):
                session.options.voice = voice
        if session.has_output:
            self._begin()

    def describe(self) -> dict:
        return {"url": shown_url(self.options.url), "connected": self._task is not None and not self._over,
                "action": shown_url(self.options.action) if self.options.action else None,
                "ignored": self.options.ignored}

    # Session events -> the application
    def _on_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "connection.state" and event.get("state") == "connected" or kind == "call.started":
            if kind == "call.started":
                self._call = event
            self._begin()
        elif kind == "speech.transcript":
            text = str(event.get("text") or "").strip()
            final = event.get("final", True) is not False
            if text and (final or self.options.partial_prompts):
                self._send(wire.prompt(text, self.options.prompt_language, final))
        elif kind == "utterance.started":
            self.session.caller.speech_interrupts = self._may_interrupt(event.get("id"), "speech")
        elif kind == "utterance.interrupted":
            uid = event.get("id")
            if uid == self._utterance:
                self._utterance = None
            if event.get("reason") == "barge_in" and int(event.get("played_ms") or 0) > 0:
                self._send(wire.interrupt(str(event.get("played_text") or ""), int(event["played_ms"])))
            self._settle(uid)
        elif kind == "utterance.done":
            self._settle(event.get("id"))
        elif kind == "call.dtmf":
            digit = str(event.get("digit"))
            if self.options.dtmf_detection:
                self._send(wire.dtmf(digit))
        elif kind == "session.closed":
            self._report_end(str(event.get("reason") or ""), event.get("handoff_data"))
        elif kind == "error":
            if event.get("id") is not None:
                self._settle(event.get("id"))
            self._send(wire.error(f"{event.get('code')}: {event.get('message')}"))

    def _may_interrupt(self, uid: object, by: str) -> bool:
        policy = self.options.welcome_greeting_interruptible if uid == GREETING_ID else self.options.interruptible
        return policy in (by, "any") and self._interruptible.get(str(uid), True)

    def _settle(self, uid: object) -> None:
        self._settled.set()
        waiter = self._waiting.pop(str(uid), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _send(self, message: dict) -> None:
        # After `end` the application still hears of what happens while the queue drains (a play that fails).
        if self._task is None or self._failed or self.session.closed:
            return
        try:
            self._outbox.put_nowait(message)
        except asyncio.QueueFull:
            self._give_up(RelayFailure("slow", f"the application left {MAX_OUTBOX} messages unread"))

    # The connection
    def _begin(self) -> None:
        if self._task is not None or self.session.closed:
            return
        call = self._call or {}
        given = call.get("custom_parameters")
        params = {str(k): str(v) for k, v in (given if isinstance(given, dict) else {}).items()
                  if k not in ("session_id", "token", "relay_url")}
        params = {**params, **self.options.custom_parameters}
        self._from_to = (params.get("from", ""), params.get("to", ""))
        self._task = asyncio.ensure_future(self._run())
        self._outbox.put_nowait(wire.setup(
            session_id="VX" + self.session.id, call_sid=str(call.get("call_sid") or ""),
            from_=params.get("from", ""), to=params.get("to", ""), direction="inbound",
            call_type="PSTN" if self._call is not None else "CLIENT", custom_parameters=params))
        if self.options.welcome_greeting:
            self._submit({"type": "speak", "id": GREETING_ID, "text": self.options.welcome_greeting})

    async def _run(self) -> None:
        http: aiohttp.ClientSession | None = None
        ws: aiohttp.ClientWebSocketResponse | None = None
        sender: asyncio.Task | None = None
        try:
            http = guarded_http(self.settings.relay_allow_private)
            ws = await self._connect(http)
            self._outcomes.labels("connected").inc()
            log.info("session %s: relay connected to %s", self.session.id, shown_url(self.options.url),
                     extra={"session_id": self.session.id})
            sender = asyncio.ensure_future(self._pump(ws))
            await self._read(ws)
        except RelayFailure as exc:
            self._give_up(exc)
        except asyncio.CancelledError:
            pass
        finally:
            if sender is not None:
                sender.cancel()
            # No closing handshake: aiohttp's close() reads until the peer's close frame without giving
            # the loop a turn while data is buffered, so a flooding application would stall every session.
            # Closing the client session drops the connection instead.
            if http is not None:
                await http.close()

    async def _connect(self, http: aiohttp.ClientSession) -> Any:
        url = self.options.url
        try:
            refuse_private_host(urlsplit(url).hostname or "", self.settings.relay_allow_private)
        except PrivateAddress as exc:
            raise RelayFailure("private", str(exc)) from None
        token = self.options.auth_token or self.settings.twilio_auth_token
        headers = {"X-Twilio-Signature": twilio_signature(token, url)} if token else {}
        timeout = self.settings.relay_connect_timeout_s
        connecting: Any = http.ws_connect(
            url, headers=headers, heartbeat=self.settings.relay_read_timeout_s, autoping=True,
            max_msg_size=self.settings.relay_max_message_bytes, autoclose=True,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=2.0))
        try:
            return await asyncio.wait_for(connecting, timeout)
        except asyncio.TimeoutError:
            raise RelayFailure("timeout", f"no WebSocket handshake within {timeout:g} s") from None
        except aiohttp.WSServerHandshakeError as exc:
            raise RelayFailure("connect", f"the application refused the WebSocket: HTTP {exc.status}") from None
        except aiohttp.ClientConnectorError as exc:
            kind = "private" if private_refusal(exc) is not None else "connect"
            raise RelayFailure(kind, f"could not connect: {_first_line(exc.os_error)}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RelayFailure("connect", f"could not connect: {_first_line(exc)}") from None

    async def _pump(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while True:
            message = await self._outbox.get()
            try:
                await ws.send_str(json.dumps(message))
            except (ConnectionError, RuntimeError):
                return

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        limiter = RateLimiter(self.settings.relay_max_messages_per_s)
        flooding_since: float | None = None  # refusals with no second free of them since
        last_refused = 0.0
        invalid = 0
        broken: BaseException | None = None
        async for msg in ws:
            if self._over:
                return
            if msg.type == aiohttp.WSMsgType.BINARY:
                raise RelayFailure("garbage", "the application sent a binary message; the protocol is JSON text")
            if msg.type != aiohttp.WSMsgType.TEXT:
                broken = msg.data if isinstance(msg.data, BaseException) else None
                break
            if not limiter.allow():
                # Over the rate, reading pauses for a message's share of a second: the application's
                # socket backs up, and a flood costs this loop no more than the rate's worth of reads.
                await asyncio.sleep(1.0 / self.settings.relay_max_messages_per_s)
                now = time.monotonic()
                if flooding_since is None or now - last_refused > 1.0:
                    flooding_since = now
                    self._send(wire.error(f"more than {self.settings.relay_max_messages_per_s:g} messages per second; "
                                          "messages are being dropped"))
                elif now - flooding_since > MAX_FLOOD_S:
                    raise RelayFailure("flood", f"over {self.settings.relay_max_messages_per_s:g} messages per second "
                                                f"for {MAX_FLOOD_S:g} s")
                last_refused = now
                continue
            try:
                decoded = json.loads(msg.data, parse_constant=_no_constant)
            except (ValueError, RecursionError):
                raise RelayFailure("garbage", "the application sent a message that is not JSON") from None
            try:
                await self._handle(wire.check(decoded))
                invalid = 0
                await asyncio.sleep(0)  # a burst read from the socket's buffer gives other sessions their turn
            except wire.RelayMessageError as exc:
                invalid += 1
                self._send(wire.error(str(exc)))
                if invalid >= MAX_INVALID_IN_ROW:
                    raise RelayFailure("garbage", f"{MAX_INVALID_IN_ROW} invalid messages in a row") from None
        if self._over or self.session.closed:
            return
        broken = broken or ws.exception()
        if ws.close_code == 1009 or isinstance(broken, aiohttp.WebSocketError):
            raise RelayFailure("garbage", f"the application's message broke the protocol: {_first_line(broken)}")
        if isinstance(broken, aiohttp.ServerTimeoutError) and time.monotonic() - last_refused < 1.0:
            # Its pong waited behind the messages reading skipped past: a flood, not a dead peer.
            raise RelayFailure("flood", f"over {self.settings.relay_max_messages_per_s:g} messages per second "
                                        "until a ping went unanswered behind them")
        if isinstance(broken, aiohttp.ServerTimeoutError):
            raise RelayFailure("unresponsive", f"no answer to a ping within {self.settings.relay_read_timeout_s / 2:g} s")
        if broken is not None:
            raise RelayFailure("closed", f"the connection failed: {_first_line(broken)}")
        raise RelayFailure("closed", f"the application closed the connection (code {ws.close_code})")

    # The application's messages -> the session
    async def _handle(self, msg: dict) -> None:
        kind = msg["type"]
        if kind == "text":
            self._text(msg)
        elif kind == "play":
            self._play(msg)
        elif kind == "sendDigits":
            send = self.session.send_digits
            if send is None:
                raise wire.RelayMessageError("sendDigits needs a phone call: a WebRTC caller has no keypad to hear them")
            if not send(msg["digits"]):
                raise wire.RelayMessageError("sendDigits: too many digits waiting to be sent; wait for them to play")
            tones_s = len(dtmf.tones(msg["digits"])) * dtmf.FRAME / dtmf.RATE
            self._digits_until = max(time.monotonic(), self._digits_until) + tones_s
        elif kind == "language":
            self._language(msg)
        elif kind == "end":
            self._over = True
            asyncio.ensure_future(self._end(msg["handoffData"]))

    def _submit(self, message: dict) -> None:
        self.session.handle_message(json.dumps(message), source=self.name)

    def _text(self, msg: dict) -> None:
        token, last = msg["token"], msg["last"]
        if self._utterance is None:
            if not token:
                return  # nothing to say: `last` ends nothing
            self._utterance = f"r{next(self._utterance_ids)}"
            self._interruptible[self._utterance] = msg["interruptible"]
            if len(self._interruptible) > 256:
                self._interruptible.pop(next(iter(self._interruptible)))
        uid = self._utterance
        if token:
            self._submit({"type": "text.delta", "id": uid, "text": token})
        if last and self._utterance == uid:
            self._utterance = None
            self._submit({"type": "text.end", "id": uid})

    def _play(self, msg: dict) -> None:
        """`play`: after whatever was said before it, as an utterance of its own (an open text utterance ends
        here, as the vendors play in order). `preemptible` is taken as on `text`: ignored."""
        if self._utterance is not None:
            self._submit({"type": "text.end", "id": self._utterance})
            self._utterance = None
        uid = f"p{next(self._play_ids)}"
        try:
            self._player.play(uid, msg["source"], msg["loop"])
        except PlayRefused as exc:
            raise wire.RelayMessageError(f"play: {exc}") from None
        self._interruptible[uid] = msg["interruptible"]
        if len(self._interruptible) > 256:
            self._interruptible.pop(next(iter(self._interruptible)))

    def _report_end(self, reason: str, handoff: object) -> None:
        """The status callback (`action`), if the session has one: how and why the conversation ended."""
        url = self.options.action
        if url is None:
            return
        status, error = self._outcome
        call_sid = str((self._call or {}).get("call_sid") or "")
        form = status_form(session_id="VX" + self.session.id, call_sid=call_sid, from_=self._from_to[0],
                           to=self._from_to[1], status=status, started=self._started,
                           handoff=handoff if isinstance(handoff, str) else None, error=error, reason=reason)
        post_status(url, form, self.settings, self.options.auth_token or self.settings.twilio_auth_token, self.session.id)

    def _language(self, msg: dict) -> None:
        tts, stt = msg["ttsLanguage"], msg["transcriptionLanguage"]
        voice = None
        if tts is not None:
            voice = voice_for_language(self.gw.engine.info.get("voices", []), tts)
            if voice is None:
                raise wire.RelayMessageError(f"no installed voice speaks {tts!r}")
        if stt is not None:
            recognizer = self.gw.stt.name if self.gw.stt is not None else None
            if not recognizer_speaks(recognizer, stt):
                raise wire.RelayMessageError(f"the server's recognizer ({recognizer or 'none'}) does not take {stt!r}")
            self.options.transcription_language = stt
        if voice is not None:
            self.options.tts_language = tts
            if VOICE_LANGUAGE.match(voice):
                self.session.options.voice = voice  # the next utterance speaks it

    async def _until_settled(self, uid: str, timeout: float) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[uid] = waiter
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            pass

    async def _end(self, handoff: str | None) -> None:
        """`end`: what is queued plays to its end (bounded), then the session closes with `handoffData`."""
        session = self.session
        if self._utterance is not None:
            self._submit({"type": "text.end", "id": self._utterance})
            self._utterance = None
        deadline = time.monotonic() + END_DRAIN_S
        while session.speaking and not session.closed and time.monotonic() < deadline:
            self._settled.clear()
            try:
                await asyncio.wait_for(self._settled.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        # Digits sent just before `end` are heard before the call ends (they wait for speech, then take their time).
        if self._digits_until > time.monotonic() and not session.closed:
            await asyncio.sleep(min(END_DRAIN_S, self._digits_until - time.monotonic()))
        self._outcomes.labels("ended").inc()
        self._outcome = ("ended", None)
        log.info("session %s: the relay application ended the conversation", session.id, extra={"session_id": session.id})
        await session.close("ended by the relay application", handoff_data=handoff)

    def _give_up(self, failure: RelayFailure) -> None:
        if self._over or self.session.closed:
            return
        self._over = self._failed = True
        self._outcome = ("failed", f"{failure.kind}: {failure}")
        self._outcomes.labels(failure.kind).inc()
        log.warning("session %s: relay %s: %s; ending the conversation", self.session.id, failure.kind, failure,
                    extra={"session_id": self.session.id})
        asyncio.ensure_future(self._apologize(failure.kind))

    async def _apologize(self, kind: str) -> None:
        session = self.session
        if session.queue.utterances:
            session.interrupt("cancel")
        text = self.settings.relay_apology
        if text and session.has_output and not session.closed:
            waiter = asyncio.ensure_future(self._until_settled(APOLOGY_ID, APOLOGY_TIMEOUT_S))
            self._submit({"type": "speak", "id": APOLOGY_ID, "text": text})
            await waiter
        await session.close(f"relay failed: {kind}")

    async def _session_closed(self, session: Session) -> None:
        self._over = True
        self._player.close()
        session.remove_listener(self.name)
        for waiter in self._waiting.values():
            waiter.cancel()
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait([task], timeout=3.0)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _first_line(exc: BaseException | None) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0][:200] if exc is not None else "no detail"

