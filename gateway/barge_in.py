"""When the caller's voice interrupts the bot: echo cancellation and the backchannel policy.

Settings only; their defaults and ranges are voxgate/config.py's. The work is in gateway/echo.py (the bot's own voice taken out of the
microphone) and gateway/vad.py (how much speech a turn has had).

- `echo_cancel`: take the bot's own voice out of the microphone before the VAD
  hears it (gateway/echo.py). Off, a session pays nothing for it.
- `min_interrupt_ms`: how much of the caller's speech a turn needs before it
  interrupts the bot. A shorter turn while the bot speaks ("okay", "mm-hmm")
  does not, and is reported as `speech.backchannel`. At or under the VAD's
  `min_speech_ms`, every turn that starts while the bot speaks interrupts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MIN_INTERRUPT_RANGE, Settings


@dataclass
class BargeInSettings:
    echo_cancel: bool = Settings.echo_cancel
    min_interrupt_ms: int = Settings.min_interrupt_ms

    def update(self, data: dict) -> None:
        """Apply a client's `barge_in` object; raises ValueError with a message for the client."""
        unknown = set(data) - {"echo_cancel", "min_interrupt_ms"}
        if unknown:
            raise ValueError(f"barge_in has no field {sorted(unknown)[0]!r}; it takes echo_cancel and min_interrupt_ms")
        if "echo_cancel" in data:
            if not isinstance(data["echo_cancel"], bool):
                raise ValueError("barge_in 'echo_cancel' must be true or false")
        if "min_interrupt_ms" in data:
            value = data["min_interrupt_ms"]
            low, high = MIN_INTERRUPT_RANGE
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or not low <= value <= high:
                raise ValueError(f"barge_in 'min_interrupt_ms' must be a number from {low} to {high}")
            self.min_interrupt_ms = int(value)
        if "echo_cancel" in data:
            self.echo_cancel = data["echo_cancel"]

    def describe(self) -> dict:
        return {"echo_cancel": self.echo_cancel, "min_interrupt_ms": self.min_interrupt_ms}
