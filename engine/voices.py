"""The one voice check: clients name a voice from the engine's list, nothing else.

The engine worker reports its voices' names when it starts (`info["voices"]`);
they come only from the operator's configuration (`--voice`, `--voice-dir`).
Every way a client can ask for a voice (the data channel's `session.update`,
`/v1/offer`, `POST /v1/sessions`, `POST /v1/tts`, a Twilio `voice` parameter)
goes through `check_voice`, so a client can never make the worker load a file.
"""

from __future__ import annotations

from typing import Sequence


class UnknownVoice(ValueError):
    code = "unknown_voice"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def check_voice(voices: Sequence[str], voice: object) -> str | None:
    """`voice` if it is one of `voices`; None stays None (the default voice)."""
    if voice is None:
        return None
    if not isinstance(voice, str):
        raise UnknownVoice("'voice' must be a string, the name of one of the server's voices")
    if voice not in voices:
        shown = voice if len(voice) <= 80 else voice[:77] + "..."
        raise UnknownVoice(f"unknown voice {shown!r}; this server's voices are: {', '.join(voices)}")
    return voice
