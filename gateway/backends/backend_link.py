"""A backend's WebSocket on a session (`/v1/sessions/{id}/ws`), as the gateway sees it:
its role (the one writer, or a watcher), its place in the registry, the session's
events and, when asked, the caller's audio frames sent to it in the order they
happened, and the messages it sends. signaling/sessions_api.py checks the request
and hands the open socket here; everything about the session happens in this module.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import TYPE_CHECKING, Callable, Protocol

from ..errors import GatewayError
from ..media.frames import FRAME_MS
from ..sessions.protocol import parse
from ..load.view import GatewayView

if TYPE_CHECKING:
    from ..load.admission import Admission
    from ..sessions.session import Session

log = logging.getLogger(__name__)

# Events a slow backend may leave unread before it is disconnected.
MAX_PENDING_EVENTS = 10000
# One send's CPU time counts against its session's tenant up to this (gateway/load/late_blame.py): a
# send that waited on the socket yielded, and the time others' work took meanwhile is not its own.
MAX_SEND_CHARGE_S = 0.002
# What `?audio=` may ask for: 16 kHz mono PCM16 frames (gateway/caller/caller_audio.py).
AUDIO_FORMATS = ("pcm16",)

_connection_ids = itertools.count(1)


class Socket(Protocol):
    """What the link needs of a WebSocket (aiohttp's WebSocketResponse is one)."""

    async def send_str(self, data: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def close(self, *, code: int = ..., message: bytes = ...) -> bool: ...


class LinkHost(GatewayView, Protocol):
    """What a backend's link uses of the gateway (gateway/gateway.py's Gateway, which makes the links):
    besides the view every part has (the registry the link is filed in, the metrics), admission's charge
    for its work and the tenant a session is charged to."""

    @property
    def admission(self) -> Admission: ...

    def tenant_of(self, session_id: str) -> str: ...


def check_room(gw: LinkHost, session: Session, key: str | None) -> None:
    """Raises GatewayError (429 watcher_limit) unless one more backend may attach to `session`:
    --max-watchers-per-session on it, --max-watchers-per-key on all of `key`'s sessions. Each
    backend costs the loop a send per event and, with the caller's audio, per 20 ms frame: 250
    on one session made a quarter of every session's frames late (issue 53, finding 5)."""
    s, backends = gw.settings, gw.registry.backends
    if len(backends.get(session.id, ())) >= s.max_watchers_per_session:
        raise GatewayError("watcher_limit", f"this session has its maximum of {s.max_watchers_per_session} backend "
                           "WebSockets; close one first", 429)
    if key is not None:
        held = sum(len(backends.get(sid, ())) for sid in gw.registry.by_owner(key))
        if held >= s.max_watchers_per_key:
            raise GatewayError("watcher_limit", f"this API key has its maximum of {s.max_watchers_per_key} backend "
                               "WebSockets open; close one first", 429)


class BackendLink:
    """One backend attached to one session until `detach`. `abort`: cuts the connection at once,
    for a backend that takes none of the caller's audio for --write-stall-s (its socket's
    own close would wait on the very writes it does not take)."""

    def __init__(self, gw: LinkHost, session: Session, socket: Socket, role: str, audio: bool,
                 abort: Callable[[], None] | None = None) -> None:
        self.gw = gw
        self.session = session
        self.socket = socket
        self._abort = abort
        self._behind_since: float | None = None  # when its caller's audio buffer filled, while it stays full
        self._tenant = gw.tenant_of(session.id)
        self.name = f"ws:{next(_connection_ids)}"
        # Asked-for writer, but the session has one already: it watches instead.
        if role == "writer" and session.writer is None:
            session.writer = self.name
        else:
            role = "watcher"
        self.role = role
        self.audio = audio
        # Events (dicts) and, with audio, the caller's frames (bytes); None: disconnect it.
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._frames_queued = 0
        self._max_frames = max(1, gw.settings.caller_audio_buffer_ms // FRAME_MS)
        self._frames_sent = gw.metrics.caller_audio_frames.labels("sent")
        self._frames_dropped = gw.metrics.caller_audio_frames.labels("dropped")
        gw.registry.add_backend(session.id, self.name, role)
        session.add_listener(self.name, self._on_event)
        self._on_event({**session.ready_event(), "role": role, "writer": session.writer})
        self._sender = asyncio.ensure_future(self._pump())
        if audio:
            session.caller.add_audio_tap(self.name, self._on_audio)
        log.info("session %s: backend %s attached as %s%s", session.id, self.name, role, " with the caller's audio" if audio else "",
                 extra={"session_id": session.id})

    def _on_audio(self, message: bytes) -> None:
        started = time.thread_time()
        self._queue_audio(message)
        self.gw.admission.blame.charge(self._tenant, time.thread_time() - started, self)

    def _queue_audio(self, message: bytes) -> None:
        # A backend that reads too slowly loses frames, never memory: a gap in its sequence numbers.
        # One that stays behind for --write-stall-s is disconnected: it costs every frame's work for nothing.
        if self._frames_queued >= self._max_frames:
            self._frames_dropped.inc()
            now = time.monotonic()
            if self._behind_since is None:
                self._behind_since = now
            elif now - self._behind_since > self.gw.settings.write_stall_s:
                self._drop(f"took none of the caller's audio for {self.gw.settings.write_stall_s:g} s")
            return
        self._behind_since = None
        self._frames_queued += 1
        self._outbox.put_nowait(message)

    def shed(self, why: str) -> None:
        """Disconnect it: its caller's audio made the server's frames late (gateway/load/late_blame.py)."""
        if self.audio:
            self._drop(why)

    def _drop(self, why: str) -> None:
        log.warning("session %s: backend %s %s; disconnecting it", self.session.id, self.name, why,
                    extra={"session_id": self.session.id})
        self.session.caller.remove_audio_tap(self.name)
        self._outbox.put_nowait(None)
        if self._abort is not None:
            self._abort()

    def _on_event(self, event: dict) -> None:
        if self._outbox.qsize() - self._frames_queued >= MAX_PENDING_EVENTS:
            log.warning("session %s: backend %s reads too slowly; disconnecting it", self.session.id, self.name,
                        extra={"session_id": self.session.id})
            self._outbox.put_nowait(None)
            return
        self._outbox.put_nowait(event)

    async def _pump(self) -> None:
        ws = self.socket
        while True:
            event = await self._outbox.get()
            if isinstance(event, bytes):
                self._frames_queued -= 1
                started = time.thread_time()
                try:
                    await ws.send_bytes(event)
                except (ConnectionError, RuntimeError):
                    return
                self.gw.admission.blame.charge(self._tenant, min(MAX_SEND_CHARGE_S, time.thread_time() - started), self)
                self._frames_sent.inc()
                continue
            if event is None:
                await ws.close(code=1013, message=b"events not read fast enough")
                return
            try:
                await ws.send_str(json.dumps(event))
            except (ConnectionError, RuntimeError):
                return
            if event.get("type") == "session.closed":
                await ws.close()
                return

    def on_text(self, raw: str | bytes) -> None:
        """A text frame from the backend (bytes when it is not valid UTF-8: the session reports that)."""
        session = self.session
        if session.writer != self.name:
            # A watcher may ping; everything else is refused here, even while no
            # writer holds the session, so a watcher never races the writer.
            try:
                msg = parse(raw, session.options.limits)
            except GatewayError:
                msg = None  # let the session report the parse error itself
            if msg is not None and msg["type"] != "ping":
                session.emit(
                    GatewayError("read_only", "this backend watches the session; only its writer may send text, cancel or updates", id=msg.get("id")).event(),
                    only=self.name,
                )
                return
        session.handle_message(raw, source=self.name)

    def on_binary(self) -> None:
        self._on_event({"type": "error", "code": "binary_frame", "message": "binary frames are not accepted; send JSON text frames"})

    async def detach(self) -> None:
        """The socket ended: the session forgets the backend; what is left to send is
        sent only when the session closed (its last events), briefly."""
        session = self.session
        session.caller.remove_audio_tap(self.name)
        session.remove_listener(self.name)
        self.gw.admission.blame.forget(self)
        self.gw.registry.drop_backend(session.id, self.name)
        if session.writer == self.name:
            session.writer = None
        if not session.closed:
            session.writer_gone(self.name)  # what it left open must not hold the session
        if not self._sender.done():
            if session.closed:
                await asyncio.wait([self._sender], timeout=1.0)
            self._sender.cancel()
        log.info("session %s: backend %s detached", session.id, self.name, extra={"session_id": session.id})
