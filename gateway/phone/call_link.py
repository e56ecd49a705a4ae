"""A phone call on a session, as the gateway sees it: the call is the session's output
(μ-law through gateway/phone/twilio_output.py) and its caller's audio the session's input
(gateway/phone/twilio_input.py), filed in the registry while attached. signaling/twilio_stream.py
speaks the Media Streams protocol and hands each checked frame here; everything that
touches the session's media happens in this module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .twilio_input import TwilioInput
from .twilio_output import TwilioOutput

if TYPE_CHECKING:
    from ..sessions.registry import SessionRegistry
    from ..sessions.session import Session


class CallLink:
    """One call attached to one session until `end`."""

    def __init__(
        self, registry: SessionRegistry, session: Session, call: object, stream_sid: str,
        send: Callable[[dict], Awaitable[None]], on_session_close: Callable[[], Awaitable[None]],
    ) -> None:
        self.registry = registry  # the gateway's: the call is filed there while attached
        self.session = session
        self.call = call  # what GET /v1/sessions/{id} describes (its describe())
        self._on_closed = on_session_close
        self.input = TwilioInput(session)
        registry.add_call(session.id, call)
        session.attach_output("pcmu")
        self.output = TwilioOutput(session.output, stream_sid=stream_sid, send=send)
        session.send_digits = self.output.send_digits  # a relay's sendDigits (gateway/backends/relay.py)
        self._listener = f"telephony:{stream_sid}"
        session.add_listener(self._listener, self.output.on_event)
        session.on_close.append(self._session_closed)
        self.output.start()

    def feed(self, ulaw: bytes) -> None:
        """One frame of the caller's audio (8 kHz μ-law)."""
        self.input.feed(ulaw)

    def on_mark(self, name: str) -> None:
        self.output.on_mark(name)

    def describe(self) -> dict:
        return self.output.describe()

    async def _session_closed(self, session: Session) -> None:
        await self.output.stop()
        await self._on_closed()

    async def end(self, event: dict, reason: str) -> None:
        """The call ended: `event` (call.ended) goes to the session's listeners, then the session
        closes, for this call was its only output and it cannot speak any more."""
        await self.output.stop()
        session = self.session
        session.send_digits = None
        session.remove_listener(self._listener)
        self.registry.drop_call(session.id, self.call)
        if not session.closed:
            session.emit(event)
            await session.close(f"call ended: {reason}")
