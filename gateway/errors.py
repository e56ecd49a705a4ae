"""The one error a client is shown: a code, a message, and the HTTP status it maps to.

Everything that refuses a client's request or message raises `GatewayError`:
the session API, the offer, the data-channel protocol, a Twilio call. Each
surface maps it one way: HTTP routes to a JSON response `{"error": {"code",
"message"}}` with `status` (signaling/errors.py, `error_response`); the data
channel and the session WebSocket to an `error` event (`event()`); a Twilio
stream to its `error` event, closing the stream when `fatal`.
"""

from __future__ import annotations

from ..engine.voices import UnknownVoice


class GatewayError(Exception):
    def __init__(
        self,
        code: str,
        message: str,
        status: int = 400,
        *,
        headers: dict[str, str] | None = None,
        id: str | None = None,
        fatal: bool = False,
        detail: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.headers = headers or {}
        self.id = id  # the utterance a data-channel error is about, if any
        # The connection that carried it ends after it is reported (a phone call's stream).
        self.fatal = fatal
        # More fields of the error object (why a capacity refusal happened, a gateway with room).
        self.detail = detail or {}

    def event(self) -> dict:
        """The error as a data-channel or WebSocket event."""
        event = {"type": "error", **self.detail, "code": self.code, "message": self.message}
        if self.id is not None:
            event["id"] = self.id
        return event


def checked_voice(engine, voice: object) -> str | None:
    """A client's choice of voice, checked against the engine's list (engine/voices.py,
    through `engine.check_voice`): the one voice check every surface uses."""
    try:
        return engine.check_voice(voice)
    except UnknownVoice as exc:
        raise GatewayError(exc.code, exc.message) from None


class SttError(GatewayError):
    """A caller turn the recognizer gave no text for (gateway/caller/stt.py): stt_timeout, stt_failed, stt_busy."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
