"""What a probe run does: the server, how many sessions, which texts, and whether and how they interrupt."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SILENCE_RMS = 300.0  # received frames quieter than this count as silence
UNDERRUN_GAP_S = 0.060  # a frame arriving this long after the previous one, inside speech
DRAIN_SILENCE_S = 0.35  # the tail of an utterance is over after this much received silence
FALLBACK_WORDS_PER_S = 2.6  # for the voice when no utterance of the run finished

WORDS = (
    "the a quick small bright quiet river window morning garden train number signal voice system "
    "message weather coffee city road answer question friend music paper light water minute today "
    "runs waits brings keeps finds opens sends hears makes takes starts turns slowly gently again "
    "before after around over under through every always never really simply"
).split()

BARGE_IN_SPEECH = "Wait, stop, I have a question about that."


@dataclass
class ProbeConfig:
    url: str
    sessions: int = 1
    ramp_s: float = 0.0
    texts: list[str] = field(default_factory=list)  # empty: random texts
    utterances: int = 1  # per session
    stream: bool = False
    tokens_per_s: float = 20.0
    interrupt_at_ms: float | None = None  # after the first audible audio
    interrupt_random: bool = False
    interrupt_share: float = 1.0  # share of sessions that interrupt, when interrupting
    barge_in: str = "cancel"  # or "voice"
    voice: str | None = None
    seed: int = 1
    timeout_s: float = 60.0  # per utterance
    pause_s: float = 0.2  # between a session's utterances

    @property
    def interrupting(self) -> bool:
        return self.interrupt_at_ms is not None or self.interrupt_random

    def interrupts(self, session_index: int) -> bool:
        if not self.interrupting:
            return False
        count = round(self.interrupt_share * self.sessions)
        return session_index < count


def random_text(rng: random.Random, words: int | None = None) -> str:
    n = words or rng.randint(8, 14)
    picked = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(picked).capitalize() + "."


def plan_texts(config: ProbeConfig) -> list[list[str]]:
    rng = random.Random(config.seed)
    plans = []
    for i in range(config.sessions):
        if config.texts:
            count = max(config.utterances, 1)
            plans.append([config.texts[(i + k) % len(config.texts)] for k in range(count)])
        else:
            plans.append([random_text(rng) for _ in range(max(config.utterances, 1))])
    return plans
