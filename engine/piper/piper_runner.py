"""One Piper step's model calls (piper_engine.py), on the onnxruntime sessions for its
thread count, stoppable between and during runs."""

from __future__ import annotations

from typing import Callable

from ..base import StepStopped, StopSignal
from .piper_voice import LoadedVoice, StageSessions


class StepRunner:
    """Runs one step's model calls on the sessions for its thread count, stoppably.

    Which set of every-core sessions a call runs on (spinning threads or
    sleeping ones) is asked afresh before each call: a step that began alone
    on a quiet machine stops spinning from its next model run once another
    step starts beside it (the run under way spins to its end: one prior pass
    or one window, or a whole sentence for a voice that did not split).
    """

    def __init__(
        self,
        voice: LoadedVoice | None,
        threads: int,
        stop: StopSignal | None,
        quiet: Callable[[], bool] | None = None,
        on_spin: Callable[[], None] | None = None,
    ) -> None:
        self.threads = threads
        self.stop = stop
        self.quiet = quiet
        self.on_spin = on_spin
        self.pinned: StageSessions | None = None  # one set, whatever the machine (load()'s warm-up of each)
        self.voice: LoadedVoice | None = None
        if voice is not None:
            self.bind(voice)

    def bind(self, voice: LoadedVoice) -> None:
        self.voice = voice

    @property
    def sessions(self) -> StageSessions:
        if self.pinned is not None:
            return self.pinned
        assert self.voice is not None
        return self.voice.sessions_for(self.threads, self.quiet is not None and self.quiet())

    def __call__(self, stage: str, feed: dict) -> list:
        sessions = self.sessions
        session = getattr(sessions, stage)
        if self.stop is not None and self.stop.requested:
            raise StepStopped()
        if sessions.spin and sessions.threads > 1 and self.on_spin is not None:
            self.on_spin()
        if self.stop is None:
            return session.run(None, feed)
        import onnxruntime

        options = onnxruntime.RunOptions()
        self.stop.on_request(lambda: setattr(options, "terminate", True))
        try:
            return session.run(None, feed, options)
        except Exception:
            if self.stop.requested:
                raise StepStopped() from None
            raise
