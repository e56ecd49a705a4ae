"""The server's state: settings, the engine, the sessions and peers, and the limits on making sessions.

One `Gateway` per server process. The HTTP surface (signaling/) holds one and
asks it for sessions; it knows nothing of HTTP, and refuses with `GatewayError`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..config import Settings
from ..engine.runtime.client import EngineClient, EngineConfig
from .media import av_internals, loop_internals, opus, priority, rtc_internals
from .load.admission import Admission
from .backends.backend_link import BackendLink, Socket, check_room
from .phone.call_link import CallLink
from .media.encoder import OpusSettings
from .errors import GatewayError, checked_voice
from .media.feeder import listener_lag_s
from .load.late_blame import address_tenant, key_tenant
from .load.mic_charge import MicCharge
from .webrtc.ice import IcePolicy, parse_ice_server, parse_networks, restrict_host_addresses
from .load.metrics import GatewayMetrics
from .webrtc.peer import PeerConnection
from .sessions.protocol import Limits
from .sessions.registry import SessionRegistry, TokenSigner
from .backends.relay import RelayLink
from .backends.relay_options import RelayOptions
from .sessions.session import Session, SessionOptions
from .caller.vad import VadSettings
from .caller.caller_side import BargeInSettings
from .caller.endpoint import TurnSettings
from .caller.stt import SpeechToText

log = logging.getLogger(__name__)



def _engine_client(settings: Settings) -> EngineClient:
    """The local worker, or the engine pool that --engine-url names (engine/cluster/remote.py)."""
    config = EngineConfig(
        engine=settings.engine,
        voice=settings.voice,
        voice_dir=settings.voice_dir,
        device=settings.device,
        parallel=settings.parallel,
        threads=settings.threads,
        first_unit_timeout=settings.first_unit_timeout_ms / 1000.0,
        ping_timeout=settings.engine_ping_timeout_s,
        hold_new=settings.engine_hold_new,
        reader_setup=priority.enter_media_thread,
        engine_options=settings.engine_options,
        log_level=settings.log_level,
        log_json=settings.log_json,
    )
    if settings.engine_url:
        from ..engine.cluster.remote import RemoteEngineClient

        return RemoteEngineClient(settings.engine_url, config, direct=settings.engine_direct)
    return EngineClient(config)


def _check_compat() -> list[str]:
    """The dependencies other than aiortc whose internals the gateway reaches, each checked by its
    one module, in the words of the server's start-up line: PyAV's wheel (the libopus loaded) and
    asyncio (the loop's waiting callbacks). Ray's is the engine pool's (engine/cluster/ray_internals.py)."""
    try:
        path, version = opus.library()
        libopus = av_internals.summary(path, version)
    except opus.OpusError as exc:
        libopus = f"NO libopus: {exc}"
    return [libopus, loop_internals.summary(loop_internals.check())]


class Gateway:
    """Everything one server process holds: settings, the engine, the sessions."""

    def __init__(self, settings: Settings, engine: EngineClient | None = None) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.engine = engine or _engine_client(settings)
        self.ice = IcePolicy(
            servers=[parse_ice_server(u) for u in settings.ice_server],
            allowed_networks=self._allowed_networks(),
            allow_public="public" in settings.ice_allow or not settings.ice_allow,
            turn_secret=settings.turn_secret,
            turn_ttl_s=settings.turn_ttl_s,
        )
        self.sessions: dict[str, Session] = {}
        self.peers: dict[str, PeerConnection] = {}
        self.relays: dict[str, RelayLink] = {}  # sessions relayed to a ConversationRelay application (gateway/backends/relay.py)
        # Who made each session and what is attached to it; the client tokens (gateway/sessions/registry.py).
        self.registry = SessionRegistry()
        self.tokens = TokenSigner(settings.token_secret, settings.token_ttl_s)
        # Sessions made without a key or token, and by which client address:
        # they have their own budget, so anonymous offers cannot take the slots
        # that keyed backends need.
        self.anonymous: dict[str, str] = {}  # session id -> client address
        self.tts_active = 0  # speech slots taken by requests (POST /v1/tts and its kin): session slots too; a compressed format takes more
        self.trusted_proxies = parse_networks(settings.trusted_proxy)
        self.accepting = True
        self.fast_paths: dict[str, bool] = {}  # rtc_internals.check_fast_paths(), at start
        self.compat: list[str] = []  # the other dependencies reached inside, as checked at start (_check_compat)
        # Called with the sessions and /v1/tts requests still open, after a session is forgotten.
        self.on_session_closed: list[Callable[[int], None]] = []
        # Called with each new session and the API key that made it (the fleet's directory records it).
        self.on_session_created: list[Callable[[Session, str | None], None]] = []
        self._tasks: list[asyncio.Task] = []
        # Every check that may refuse a new session or request (gateway/load/admission.py).
        self.admission = Admission(self)
        # The speech recognizer every session's turns share (--stt, --stt-url); None: --stt none.
        self.stt = SpeechToText.from_settings(settings)
        if self.stt is not None:
            self.stt.on_outcome = lambda outcome: self.metrics.stt_turns.labels(outcome).inc()

    def _allowed_networks(self):
        explicit = [v for v in self.settings.ice_allow if v != "public"]
        if explicit:
            return parse_networks(explicit)
        # Default: the networks our own host candidates live in.
        nets = []
        for host in self.settings.ice_hosts:
            nets.append(host + ("/8" if host.startswith("127.") else "/32" if ":" not in host else "/128"))
        return parse_networks(nets)

    async def start(self) -> None:
        self.fast_paths = rtc_internals.check_fast_paths()
        if self.settings.rtp_sender != "voxgate":
            self.fast_paths.update(rtp_sender=False, direct_wire=False)
        for path, active in self.fast_paths.items():
            self.metrics.fast_path.labels(path).set(1 if active else 0)
        self.compat = _check_compat()
        restrict_host_addresses(self.settings.ice_hosts or None)
        await self.engine.start()
        self.engine.listeners.append(self._on_engine_event)
        self._tasks.append(asyncio.ensure_future(self._watch_loop_lag()))
        self.metrics.watch_collections()
        self._tasks.append(asyncio.ensure_future(self._reap_idle()))
        rate = self.engine.info.get("sample_rate")
        if isinstance(rate, int) and rate > 0:
            # Measured once per pair of rates (a few ms of soxr): now, not on a first utterance's path.
            listener_lag_s(rate, OpusSettings().input_rate)
        log.debug("engine %s ready: %s", self.settings.engine, self.engine.info)
        self.admission.tick()  # the budget from the worker's measurement, before the first session

    async def drain(self, timeout: float) -> None:
        """Stop taking sessions, let current utterances finish, then close every session."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        # Polled: no one event says every session went quiet.
        while time.monotonic() < deadline and any(s.speaking for s in self.sessions.values()):  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await asyncio.gather(*(s.close("server shutting down") for s in list(self.sessions.values())), return_exceptions=True)

    async def stop(self) -> None:
        self.accepting = False
        self.metrics.unwatch_collections()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*(s.close("server shutting down") for s in list(self.sessions.values())), return_exceptions=True)
        await self.engine.close()
        if self.stt is not None:
            await self.stt.close()

    def _on_engine_event(self, event: str, data: dict) -> None:
        if event == "restart":
            self.metrics.worker_restarts.inc()

    async def _watch_loop_lag(self) -> None:
        interval = 0.1
        ticks = 0
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(interval)
            lag = max(0.0, time.monotonic() - t0 - interval)
            self.metrics.loop_lag.observe(lag)
            self.admission.loop_lag(lag)
            ticks += 1
            if ticks % 10 == 0:
                self.admission.tick()
            self.metrics.sessions.set(len(self.sessions))
            self.metrics.utterances_active.set(sum(len(s.queue.utterances) for s in self.sessions.values()))
            self.metrics.engine_streams.set(self.engine.active_streams)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if session.speaking:
                    session.last_activity = now
                if now - session.last_activity > self.settings.idle_timeout_s:
                    await session.close("idle timeout")
                elif now - session.created_at > self.settings.session_lifetime_s:
                    await session.close("session lifetime reached")

    def session_options(self, voice: str | None = None) -> SessionOptions:
        s = self.settings
        return SessionOptions(
            voice=voice,  # None: the engine's default voice, which the operator chose
            vad=VadSettings(enabled=s.vad, aggressiveness=s.vad_aggressiveness, min_speech_ms=s.vad_min_speech_ms),
            barge_in=BargeInSettings(echo_cancel=s.echo_cancel, min_interrupt_ms=s.min_interrupt_ms),
            turn=TurnSettings(min_silence_ms=s.turn_min_silence_ms, max_silence_ms=s.turn_max_silence_ms,
                              partial_ms=s.stt_partial_ms),
            opus=OpusSettings(bitrate=s.opus_bitrate, fec=s.opus_fec, dtx=s.opus_dtx, complexity=s.opus_complexity,
                              signal=s.opus_signal, dtx_when_asked=s.opus_dtx_when_asked,
                              packet_loss_pct=s.opus_loss_pct, fec_bitrate=s.opus_fec_bitrate),
            limits=Limits(max_message_bytes=s.max_message_bytes, max_text_chars=s.max_text_chars, max_messages_per_s=s.max_messages_per_s,
                          max_buffered_bytes=s.max_channel_buffer_kb * 1024),
            max_utterance_chars=s.max_utterance_chars,
            max_queued_utterances=s.max_queued_utterances,
        )

    # A session's WebRTC peer: attached, answered, given up; nothing outside gateway/ touches it.
    async def answer_offer(self, session: Session, sdp: str, created: bool) -> str:
        """Attach a new WebRTC peer to `session` and answer its offer (the answer's SDP).
        `created`: the session was made for this offer, and ends with it if the offer fails
        or the peer does not connect within --connect-timeout-s; a session made ahead stays
        for another offer. Refused with GatewayError."""
        peer = PeerConnection(session, self.ice, rtp_sender=self.settings.rtp_sender, max_ssrcs=self.settings.max_ssrcs,
                              mic_max_packets_per_s=self.settings.mic_max_packets_per_s,
                              peer_silence_timeout_s=self.settings.peer_silence_timeout_s,
                              charge=MicCharge(self.admission.blame, self.tenant_of(session.id), session))
        self.peers[session.id] = peer
        try:
            answer = await peer.answer(sdp)
        except GatewayError:
            await self._abandon_peer(peer, created, "offer rejected")
            raise
        except Exception as exc:
            log.exception("offer failed")
            await self._abandon_peer(peer, created, "offer failed")
            raise GatewayError("internal", f"could not answer the offer: {type(exc).__name__}", 500) from None
        self._connect_deadline(peer, created)
        return answer

    def _connect_deadline(self, peer: PeerConnection, created: bool) -> None:
        """A peer that has not connected within --connect-timeout-s gives its slot back:
        a session made for the offer ends; a session made ahead is freed for another offer."""
        timeout = self.settings.connect_timeout_s

        def expire() -> None:
            session = peer.session
            if session.closed or self.peers.get(session.id) is not peer or peer.pc.connectionState == "connected":
                return
            dropped = (f" ({peer.dropped_candidates} of the offer's candidates were outside --ice-allow)"
                       if peer.dropped_candidates else "")
            log.info("session %s: no connection within %g s%s", session.id, timeout, dropped,
                     extra={"session_id": session.id})
            session.emit({"type": "connection.state", "state": "timeout"})
            if created:
                asyncio.ensure_future(session.close(f"no connection within {timeout:g} s"))
            else:
                asyncio.ensure_future(self._abandon_peer(peer, created, "no connection"))

        if timeout > 0:
            asyncio.get_running_loop().call_later(timeout, expire)

    async def _abandon_peer(self, peer: PeerConnection, created: bool, reason: str) -> None:
        """Undo a failed offer: a session made for it ends; a session made ahead stays for another try."""
        session = peer.session
        if created:
            await session.close(reason)
            return
        if self.peers.get(session.id) is peer:
            del self.peers[session.id]
        await peer.detach()

    async def add_candidate(self, session_id: str, body: dict) -> None:
        """One trickled ICE candidate (`body["candidate"]`, None at the end) for the session's peer."""
        peer = self.peers.get(session_id)
        if peer is None:
            raise GatewayError("unknown_session", "no such session", 404)
        candidate = body.get("candidate")
        if candidate is not None and not isinstance(candidate, str):
            raise GatewayError("invalid_candidate", "'candidate' must be a string, or null to end the candidates")
        try:
            accepted = await peer.add_candidate(body if candidate else None)  # "" or null: the end of the candidates
        except GatewayError:
            raise
        except Exception as exc:
            raise GatewayError("invalid_candidate", f"the candidate could not be parsed: {type(exc).__name__}") from None
        if not accepted:
            raise GatewayError("candidate_refused", "the candidate's address is outside the allowed networks", 403)

    def join_session(self, session_id: str | None, token: object) -> Session:
        """The session made ahead that `token` was issued for, for a new output (a peer,
        a call) to attach to. `session_id`, when given, must name the same session."""
        token_sid = self.tokens.verify(token)
        if session_id is not None and session_id != token_sid:
            raise GatewayError("token_mismatch", "the token was issued for another session", 403)
        session = self.sessions.get(token_sid)
        if session is None or session.closed:
            raise GatewayError("unknown_session", "no such session; it may have ended", 404)
        if session.has_output or self.has_peer(token_sid):
            raise GatewayError("already_connected", "a listener is already attached to this session", 409)
        self.admission.admit_join(session)
        return session

    def tenant_of(self, session_id: str) -> str:
        """Who a session's work is charged to when frames are late (gateway/load/late_blame.py): the API key
        that made it, else the address of an anonymous one, else the session itself."""
        key = self.registry.owner.get(session_id)
        if key is not None:
            return key_tenant(key)
        address = self.anonymous.get(session_id)
        return address_tenant(address) if address is not None else "session:" + session_id

    def joined(self, session_id: str) -> bool:
        """Whether a peer has connected to the session, or a call is attached: until then it does not
        speak, and admission counts it for less, and only for a while (gateway/load/admission.py)."""
        if session_id in self.registry.calls:
            return True
        peer = self.peers.get(session_id)
        return peer is not None and peer.pc.connectionState == "connected"

    def session_for_offer(self, session_id: object, token: object, voice: object, address: str) -> tuple[Session, bool]:
        """The session a WebRTC offer attaches to, and whether it was made for it: with
        `session_id` and/or `token`, the session made ahead that the token names
        (join_session); without either, a new one (unless --require-token)."""
        if session_id is None and token is None:
            if self.settings.require_token:
                raise GatewayError("token_required", "this server needs a client token from POST /v1/sessions", 401)
            return self.create_session(voice=voice, anonymous_from=address), True
        if session_id is not None and not isinstance(session_id, str):
            raise GatewayError("invalid_field", "'session_id' must be a string")
        if token is None:
            raise GatewayError("token_required", "joining a session needs its client 'token'", 401)
        return self.join_session(session_id, token), False

    @property
    def session_count(self) -> int:
        """Sessions open now (/readyz, the fleet's published load)."""
        return len(self.sessions)

    def owned_session(self, session_id: str, key: str | None) -> Session:
        """The open session `session_id`, if the API key `key` made it; the same 404
        otherwise, so another key cannot even learn that it exists."""
        session = self.sessions.get(session_id)
        if session is None or session.closed or not self.registry.owned_by(session_id, key):
            raise GatewayError("unknown_session", "no such session", 404)
        return session

    def owned_sessions(self, key: str | None) -> list[Session]:
        """The open sessions the API key `key` made (None: those made without one)."""
        return [s for s in list(self.sessions.values()) if not s.closed and self.registry.owned_by(s.id, key)]

    def token_session(self, token: object) -> str:
        """The id of the open session a client token was issued for (GatewayError otherwise)."""
        session_id = self.tokens.verify(token)
        if session_id not in self.sessions:
            raise GatewayError("unknown_session", "no such session; it may have ended", 404)
        return session_id

    def backend_room(self, session: Session, key: str | None) -> None:
        """Raises GatewayError (429 watcher_limit) unless one more backend may attach (gateway/backends/backend_link.py)."""
        check_room(self, session, key)

    def attach_backend(self, session: Session, socket: Socket, role: str, audio: bool, key: str | None = None,
                       abort: Callable[[], None] | None = None) -> BackendLink:
        """A backend's WebSocket on the session (gateway/backends/backend_link.py), until its `detach`; refused
        (GatewayError) past the limits on backends, checked here again with nothing awaited before it attaches."""
        check_room(self, session, key)
        return BackendLink(self, session, socket, role, audio, abort)

    def attach_call(self, session: Session, call: object, stream_sid: str, send: Callable[[dict], Awaitable[None]],
                    on_session_close: Callable[[], Awaitable[None]]) -> CallLink:
        """A phone call as the session's output and input (gateway/phone/call_link.py), until its `end`."""
        return CallLink(self.registry, session, call, stream_sid, send, on_session_close)

    def describe(self, session: Session) -> dict:
        """A session as GET /v1/sessions/{id} shows it: what is attached, queued and set."""
        registry = self.registry
        now_mono, now_wall = time.monotonic(), time.time()
        call = registry.calls.get(session.id)
        backends = registry.backends.get(session.id, {})
        playing = session.playout.current
        return {
            "session_id": session.id,
            "made_ahead": session.id in registry.made_ahead,
            "codec": session.output.codec,
            "connected": {
                "webrtc": self.peer_state(session.id),
                "telephony": None if call is None else call.describe(),  # type: ignore[attr-defined]
            },
            "utterances": {
                "queued": len(session.queue.utterances),
                "playing": playing.id if playing is not None and playing.started else None,
                "ids": [u.id for u in session.queue.utterances],
            },
            "writer": session.writer,
            "relay": self.relays[session.id].describe() if session.id in self.relays else None,
            "watchers": sorted(name for name, role in backends.items() if role == "watcher"),
            "backends": len(backends),
            "options": session.describe_options(),
            "stats": dict(session.stats),
            "created_at": round(now_wall - (now_mono - session.created_at), 3),
            "last_activity": round(now_wall - (now_mono - session.last_activity), 3),
        }

    def has_peer(self, session_id: str) -> bool:
        return session_id in self.peers

    def peer_state(self, session_id: str) -> dict | None:
        """The session's WebRTC connection as GET /v1/sessions/{id} shows it; None without a peer."""
        peer = self.peers.get(session_id)
        return None if peer is None else {"state": peer.pc.connectionState}

    def create_session(
        self, voice: object = None, anonymous_from: str | None = None, key: str | None = None, made_ahead: bool = False,
        relay: RelayOptions | None = None,
    ) -> Session:
        """A new session; `voice` is a client's choice, checked against the engine's voices.

        `anonymous_from`: the client address of a session made without a key or
        token; such sessions count against their own budget and a per-address limit.
        `key`: the API key making it, its owner from now on (None: made without one), limited
        to the sessions a key may hold; `made_ahead`: made through the session API, for an
        output to join with a token. `relay`: the ConversationRelay application that drives it (gateway/backends/relay.py);
        a session made for an offer or a call without one takes --relay-url's. Refused (GatewayError) by admission
        (gateway/load/admission.py).
        """
        voice = checked_voice(self.engine, voice)
        registry = self.registry
        self.admission.admit_session(anonymous_from, key, len(registry.by_key.get(key, ())) if key is not None else 0,
                                     made_ahead=made_ahead)
        session = Session(self.engine, options=self.session_options(voice), metrics=self.metrics.for_session(self.settings.engine),
                          stt=self.stt)
        self.sessions[session.id] = session
        if anonymous_from is not None:
            self.anonymous[session.id] = anonymous_from
        registry.owner[session.id] = key
        if made_ahead:
            registry.made_ahead.add(session.id)
            if key is not None:
                registry.by_key.setdefault(key, set()).add(session.id)

        def forget(s: Session) -> None:
            self.sessions.pop(s.id, None)
            self.relays.pop(s.id, None)
            self.peers.pop(s.id, None)
            self.anonymous.pop(s.id, None)
            for callback in self.on_session_closed:
                callback(len(self.sessions) + self.tts_active)
            registry.forget(s.id)

        session.on_close.append(forget)
        if relay is None and self.settings.relay_url and not made_ahead:
            relay = RelayOptions(url=self.settings.relay_url)
        if relay is not None:
            self.relays[session.id] = RelayLink(self, session, relay)
        for hook in self.on_session_created:
            hook(session, key)
        return session
