"""What listening costs per 20 ms microphone frame: the VAD alone, and with the echo canceller (issue 40).

    python bench/bench_echo_cost.py          # about 20 s
    python bench/bench_echo_cost.py --quick

In this process, on one thread, with the product's classes and a clock of its
own: the bot's reply (the real voice, Opus-coded as the gateway sends it)
leaves every 20 ms into the session's reference tap, and the microphone hears
it back 250 ms later at -10 dB over room noise. Each frame goes through what
a session runs for it (gateway/caller/caller_side.py's `_hear`): the echo canceller's
`process` (decoding the reference, envelopes, the delay estimate, libspeexdsp
once the delay is known) and the VAD with its guard, or the VAD alone.
Figures: microphone-side CPU per frame (µs), median and p95 of the per-frame
times over several rounds, and the share of one core per session; the
baseline is the VAD alone on the same frames in the same run. "silent" is a
frame while the bot has said nothing for a second: the canceller's idle path.
Figures go to stdout and to artifacts/bench-echo-cost.json (--out).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import soxr  # noqa: E402
from _common import arg_parser, finish, machine, percentile, print_machine, section  # noqa: E402

from tests import listening_corpus as corpus  # noqa: E402
from voxgate.engine.base import SynthesisOptions  # noqa: E402
from voxgate.engine.piper.piper_engine import PiperEngine  # noqa: E402
from voxgate.gateway.media import opus  # noqa: E402
from voxgate.gateway.caller.echo import EchoCanceller, ReferenceTap  # noqa: E402
from voxgate.gateway.caller.vad import VadSettings, VoiceActivityDetector  # noqa: E402

DELAY_S = 0.25
ECHO_DB = -10.0


def reply_packets(text: str) -> tuple[list[bytes], np.ndarray]:
    engine = PiperEngine(threads=1)
    engine.load()
    pcm = np.concatenate([c.pcm for c in engine.synthesize(text, SynthesisOptions())])
    pcm48 = soxr.resample(pcm, 22050, 48000).astype(np.int16)
    pcm48 = pcm48[: len(pcm48) // 960 * 960]
    packets = opus.Encoder(48000, 32000, 0, True, 10, False).encode(pcm48)
    decoder = opus.Decoder(48000)
    heard = np.concatenate([decoder.decode(p) for p in packets])
    return packets, soxr.resample(heard, 48000, 16000).astype(np.int16)


def run(packets: list[bytes], heard16: np.ndarray, echo: bool, silent_tail_s: float = 2.0) -> dict:
    delay = int(DELAY_S * 16000)
    n = len(heard16) + delay + int(silent_tail_s * 16000)
    mic = np.zeros(n)
    mic[delay : delay + len(heard16)] += heard16 * 10 ** (ECHO_DB / 20)
    mic += np.resize(corpus.room_noise(n / 16000 + 0.1, -60.0, 1, rate=16000), n)
    mic = mic.astype(np.int16)
    tap = ReferenceTap()
    canceller = EchoCanceller("opus", tap, epoch=0.0) if echo else None
    vad = VoiceActivityDetector(VadSettings())
    talking: list[float] = []
    silent: list[float] = []
    false_starts = 0
    for j in range(n // 320):
        tap(packets[j] if j < len(packets) else None, j * 0.02)
        frame = mic[j * 320 : (j + 1) * 320]
        t0 = time.perf_counter()
        if canceller is None:
            events = vad.process(frame)
        else:
            events = []
            for out, guard in canceller.process(frame, (j + 1) * 0.02, vad.floor_db):
                events.extend(vad.frame(out, guard))
                canceller.learn(caller_quiet=vad.quiet)
        took = time.perf_counter() - t0
        false_starts += "speech.started" in events
        (talking if j * 0.02 < len(packets) * 0.02 + DELAY_S + 0.2 else silent).append(took)
    out = {"talking_us": _us(talking), "silent_us": _us(silent), "false_starts": false_starts}
    if canceller is not None:
        out.update(delay_ms=None if canceller.delay_hops is None else canceller.delay_hops * 10, cancelled=canceller.cancelled)
    return out


def _us(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(percentile(xs, 50) * 1e6, 1), "p95": round(percentile(xs, 95) * 1e6, 1),
            "mean": round(sum(xs) / max(1, len(xs)) * 1e6, 1)}


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds of each side")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    packets, heard = reply_packets(" ".join(corpus.BOT_REPLIES[:2]))
    results: dict = {"machine": info, "args": vars(args), "label": "microphone-side CPU per 20 ms frame, in process, "
                     "one thread, real voice (Piper joe) echoed at -10 dB after 250 ms, normal priority",
                     "rounds": []}
    section("per frame: VAD alone against the echo canceller and its guarded VAD")
    for r in range(rounds):
        for side in (("vad", False), ("echo", True)) if r % 2 == 0 else (("echo", True), ("vad", False)):
            row = {"side": side[0], "round": r, **run(packets, heard, side[1])}
            results["rounds"].append(row)
            print(f"round {r} {side[0]:5s}: talking p50 {row['talking_us']['p50']:6.1f} us (p95 {row['talking_us']['p95']:6.1f}), "
                  f"silent p50 {row['silent_us']['p50']:6.1f} us, false starts {row['false_starts']}", flush=True)
    for key in ("talking_us", "silent_us"):
        vad = [row[key]["mean"] for row in results["rounds"] if row["side"] == "vad"]
        echo = [row[key]["mean"] for row in results["rounds"] if row["side"] == "echo"]
        vad_mean, echo_mean = sum(vad) / len(vad), sum(echo) / len(echo)
        results[key.replace("_us", "")] = {
            "vad_mean_us": round(vad_mean, 1), "echo_mean_us": round(echo_mean, 1),
            "ratio": round(echo_mean / vad_mean, 2), "core_share_per_session_pct": round(echo_mean / 20000 * 100, 2),
        }
        print(f"{key[:-3]}: echo canceller {echo_mean:.1f} us a frame against {vad_mean:.1f} us for the VAD alone "
              f"(x{echo_mean / vad_mean:.2f}); {echo_mean / 200:.2f} % of a core per session")
    finish("echo-cost", results, started, args.out)


if __name__ == "__main__":
    main()
