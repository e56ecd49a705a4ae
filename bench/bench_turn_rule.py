"""The end-of-turn rule, offline (issue 54): how often a pause inside a sentence reads as its end, and a
sentence's end as finished, on Whisper tiny.en's text and the turn's pitch.

    python bench/bench_turn_rule.py --out bench/results/turn-rule.json

Each case is what the endpointer (gateway/caller/endpoint.py) has when it decides: the
turn's audio up to its last voiced frame plus SPECULATE_MS of silence,
recognized by `--stt whisper` (gateway/caller/stt_whisper.py). Cases: espeak-ng
sentences spoken with a 600 ms pause inside (SSML break, so the intonation runs
on), cut at the pause ("pause": must not read as finished) and whole ("end":
should), and plain sentences ("end"). Two sets: `tune`, the bench_conversation
sentences and 8 voices the rule was chosen on, and `held`, other sentences in 6
other voice variants, never looked at while choosing it. Each is judged by the
rule as it is (`judge` after `cut_restart`) and as it was before
(`reads_finished`, every statement's pitch checked, no restart cut), same run.
A "finished" answer ends the turn after min_silence_ms; "level" and "short" wait
halfway to max_silence_ms (725 ms by default: longer than the 600 ms pause);
"unfinished" waits max_silence_ms.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from _common import arg_parser, finish, machine, print_machine  # noqa: E402
from bench_conversation import PAUSE_MS, PAUSED  # noqa: E402

from tests.listening_corpus import CALLER_VOICES, espeak  # noqa: E402
from tests.transcripts import QUESTIONS, espeak_paused  # noqa: E402
from voxgate.gateway.caller.endpoint import FALLING_ST, SPECULATE_MS, end_pitch_st, judge, reads_finished  # noqa: E402

HELD_PAUSED = (
    ("I was wondering if", "you could help me with my bill."), ("Do you know", "where I left my keys?"),
    ("We need", "a room for three nights."), ("I'm calling about", "the letter you sent me."),
    ("Please remind me", "to call the doctor."), ("Could I speak", "to the manager please?"),
    ("I have a question about", "my last invoice."), ("Tell me", "the fastest way to the airport."),
)
HELD_ENDS = (
    "I lost my password.", "Where is the nearest bank?", "The heater in my room is broken.", "Can I pay by card?",
    "We would like two more chairs.", "Thank you very much.", "My flight was cancelled yesterday.",
    "Is breakfast included in the price?",
)
HELD_VOICES = ("en-us+m3", "en-gb+m4", "en-us+f4", "en-gb-x-rp+m7", "en-029+m2", "en-gb-scotland+f2")
RATE = 16000
VOICED = 300.0


def _last_voiced(x: np.ndarray) -> int:
    hop = RATE // 50
    n = len(x) // hop
    rms = np.sqrt(np.mean(x[: n * hop].astype(np.float64).reshape(n, hop) ** 2, axis=1))
    return int((np.flatnonzero(rms > VOICED)[-1] + 1) * hop)


def _at_decision(x: np.ndarray) -> np.ndarray:
    return x[: _last_voiced(x) + RATE * SPECULATE_MS // 1000]


def _before_pause(x: np.ndarray) -> np.ndarray:
    level = np.convolve(np.abs(x.astype(np.int32)) > VOICED, np.ones(RATE * 300 // 1000), "same")
    pause = int(np.flatnonzero((level == 0) & (np.arange(len(x)) > RATE * 300 // 1000))[0])
    return _at_decision(x[:pause])


def decide_now(text: str, pitch: float | None) -> str:
    rule = judge(text)
    if rule == "pitch":
        rule = "finished" if pitch is not None and pitch <= FALLING_ST else "level"
    return rule


def decide_before(raw: str, pitch: float | None) -> str:
    if not reads_finished(raw):
        return "unfinished"
    if raw.rstrip().endswith(".") and (pitch is None or pitch > FALLING_ST):
        return "level"
    return "finished"


def main() -> None:
    parser = arg_parser(__doc__)
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    from voxgate.gateway.caller.stt_whisper import Whisper, cut_restart

    whisper = Whisper()
    raw_text = whisper.recognize  # with cut_restart inside; the raw text for the old rule is taken before it
    import voxgate.gateway.caller.stt_whisper as module

    rows = []
    sets = (("tune", CALLER_VOICES, PAUSED, QUESTIONS), ("held", HELD_VOICES, HELD_PAUSED, HELD_ENDS))
    for split, voices, paused, ends in sets[:1] if args.quick else sets:
        for voice in voices[:2] if args.quick else voices:
            cases = []
            for first, second in paused:
                clip = espeak_paused(first, second, voice, RATE, PAUSE_MS)
                cases += [("pause", f"{first} | {second}", _before_pause(clip)), ("end", f"{first} {second}",
                                                                                  _at_decision(clip))]
            cases += [("end", phrase, _at_decision(espeak(phrase, voice, RATE))) for phrase in ends]
            for kind, phrase, audio in cases:
                module.cut_restart = lambda text: text  # the raw text, for the rule before
                try:
                    raw = raw_text(audio)
                finally:
                    module.cut_restart = cut_restart
                pitch = end_pitch_st(audio)
                text = cut_restart(raw)
                rows.append({"split": split, "voice": voice, "kind": kind, "phrase": phrase, "raw": raw, "text": text,
                             "pitch": None if pitch is None else round(pitch, 2),
                             "now": decide_now(text, pitch), "before": decide_before(raw, pitch)})
    results: dict = {"machine": info, "args": vars(args), "label": (
        "end-of-turn rule offline: Whisper tiny.en (--stt whisper) text and end pitch of espeak-ng turns at the "
        f"decision (last voiced frame + {SPECULATE_MS} ms); tune = bench_conversation's sentences and voices, "
        "held = others, never used to choose the rule")}
    for split in ("tune", "held"):
        for kind in ("pause", "end"):
            mine = [r for r in rows if r["split"] == split and r["kind"] == kind]
            if not mine:
                continue
            for which in ("before", "now"):
                counts = {rule: sum(r[which] == rule for r in mine) for rule in ("finished", "level", "short", "unfinished")}
                results[f"{split}_{kind}_{which}"] = {"n": len(mine), **counts}
                print(f"{split:4s} {kind:5s} {which:6s} n={len(mine):3d} {counts}", flush=True)
        restarts = sum(r["raw"] != r["text"] for r in rows if r["split"] == split and r["kind"] == "end")
        results[f"{split}_ends_restart_cut"] = restarts
        print(f"{split}: {restarts} sentence ends had a restart cut", flush=True)
    results["rows"] = rows
    finish("turn-rule", results, started, args.out)


if __name__ == "__main__":
    main()
