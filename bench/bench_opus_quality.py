"""Opus complexity: encoder cost per frame against intelligibility (issue 15).

    python bench/bench_opus_quality.py            # about 2 minutes on 2 cores
    python bench/bench_opus_quality.py --quick    # fewer sentences and repetitions

What runs, all in this process:
- The embedded voice says a set of sentences (whole-unit synthesis), and the
  audio is fed exactly as the gateway feeds it: resampled to the encoder's
  input rate (`OpusSettings.input_rate`), cut into 20 ms frames.
- For each complexity in --complexities (signal voice: SILK or hybrid, with
  in-band FEC) and in --music-complexities (signal music: CELT alone, what
  `--opus-signal auto` codes while the listener reports no loss), the product's Opus encoder
  (`gateway.media.encoder.OpusEncoder`, the product's bitrate, FEC and loss settings)
  encodes every sentence; the time per frame is taken over the whole set,
  interleaved by complexity and repeated, on one thread (as the encode pool
  runs it).
- Every encoded sentence is decoded with libopus at 16 kHz and scored with
  pocketsphinx against its text (WER). The baseline is the same audio not
  encoded at all, in the same run; the figure is each complexity's WER minus
  the baseline's, and its cost per frame as a ratio to complexity 10's
  (libopus's own default and aiortc's setting).

The product's default (`--opus-complexity`) is chosen from this: the cheapest
complexity whose WER is within --tolerance of the uncoded audio's.
Figures go to stdout and to bench/results/opus-quality.json (--out).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import soxr  # noqa: E402
from _common import RESULTS, arg_parser, finish, machine, print_machine, section  # noqa: E402
from bench_streaming import FIRST_SENTENCES  # noqa: E402

# The streaming bench's first sentences, and three with commas and questions.
SENTENCES = FIRST_SENTENCES + [
    "Would you like me to send the receipt to your email address as well?",
    "The doctor can see you on Monday at nine or on Wednesday after lunch.",
    "Sorry, I did not catch that, could you say the last part again?",
]


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--complexities", default="0,1,2,3,5,10", help="comma-separated Opus complexities")
    parser.add_argument("--music-complexities", default="0,10",
                        help="complexities also run with the signal set to music (CELT alone, no in-band FEC)")
    parser.add_argument("--reps", type=int, default=5, help="timing repetitions per complexity")
    parser.add_argument("--tolerance", type=float, default=0.02, help="WER above the uncoded audio's still accepted")
    args = parser.parse_args()
    if args.quick:
        args.reps = 2
    sentences = SENTENCES[:6] if args.quick else SENTENCES
    complexities = [(int(c), "voice") for c in args.complexities.split(",")]
    complexities += [(int(c), "music") for c in args.music_complexities.split(",") if c]

    from tests.speech import recognize, word_error_rate
    from voxgate.engine.base import SynthesisOptions
    from voxgate.engine.piper.piper_engine import PiperEngine
    from voxgate.gateway.media import opus
    from voxgate.gateway.media.encoder import OpusEncoder, OpusSettings
    from voxgate.gateway.media.frames import Framer

    started = time.perf_counter()
    start = machine()
    print_machine(start, "machine at start")
    defaults = OpusSettings()
    rate = defaults.input_rate
    section(f"the voice says {len(sentences)} sentences; fed at {rate} Hz as the gateway feeds Opus")
    engine = PiperEngine()
    engine.load()
    audio: list[np.ndarray] = []
    for text in sentences:
        chunks = list(engine.synthesize(text, SynthesisOptions()))
        pcm = np.concatenate([c.pcm for c in chunks])
        resampled = soxr.resample(pcm, chunks[0].sample_rate, rate).astype(np.int16)
        framer = Framer(rate)
        audio.append(framer.push(resampled, last=True))
    frames = sum(len(a) // (rate // 50) for a in audio)
    print(f"{frames} frames of 20 ms ({frames / 50:.1f} s of speech)")

    def score(decoded: list[np.ndarray], decoded_rate: int) -> float:
        errors = [word_error_rate(t, recognize(pcm, decoded_rate)) for t, pcm in zip(sentences, decoded)]
        return round(float(np.mean(errors)), 4)

    baseline_wer = score(audio, rate)
    section("cost per 20 ms frame on one thread, and WER after a libopus decode at 16 kHz")
    print(f"uncoded audio: WER {baseline_wer:.3f}")
    cost: dict[tuple, list[float]] = {c: [] for c in complexities}
    for _ in range(args.reps):
        for c in complexities:
            encoders = [OpusEncoder(OpusSettings(complexity=c[0], signal=c[1])) for _ in audio]
            t0 = time.thread_time()
            for enc, pcm in zip(encoders, audio):
                enc.encode(pcm)
            cost[c].append((time.thread_time() - t0) / frames * 1e6)
    rows = {}
    for c in complexities:
        decoded = []
        for pcm in audio:
            dec = opus.Decoder(16000)
            packets = OpusEncoder(OpusSettings(complexity=c[0], signal=c[1])).encode(pcm)
            decoded.append(np.concatenate([dec.decode(p) for p in packets]))
        wer = score(decoded, 16000)
        rows[c] = {"us_per_frame_median": round(float(np.median(cost[c])), 1), "us_per_frame_all": [round(x, 1) for x in cost[c]],
                   "wer": wer, "wer_minus_uncoded": round(wer - baseline_wer, 4)}
    top = max(c for c in complexities if c[1] == "voice")
    for c in complexities:
        rows[c]["cost_ratio_to_complexity_%d" % top[0]] = round(rows[c]["us_per_frame_median"] / rows[top]["us_per_frame_median"], 3)
        print(f"complexity {c[0]:>2}, {c[1]:5s}: {rows[c]['us_per_frame_median']:6.1f} us/frame "
              f"({rows[c]['cost_ratio_to_complexity_%d' % top[0]]:.2f}x of complexity {top[0]}, voice), "
              f"WER {rows[c]['wer']:.3f} ({rows[c]['wer_minus_uncoded']:+.3f} vs uncoded)")
    good = [c for c in complexities if rows[c]["wer_minus_uncoded"] <= args.tolerance]
    choice = min(good, key=lambda c: rows[c]["us_per_frame_median"]) if good else top
    print(f"cheapest setting within {args.tolerance:+.2f} WER of the uncoded audio: complexity {choice[0]}, {choice[1]} "
          f"(the product's default: complexity {defaults.complexity}, {defaults.signal})")
    finish("opus-quality", {
        "bench": "opus-quality",
        "sentences": sentences,
        "frames": frames,
        "settings": {"bitrate": defaults.bitrate, "fec": defaults.fec, "packet_loss_pct": defaults.packet_loss_pct,
                     "input_rate": rate, "decoded_at": 16000},
        "uncoded_wer": baseline_wer,
        "complexities": {f"{c[0]}" if c[1] == "voice" else f"{c[0]}-music": r for c, r in rows.items()},
        "tolerance": args.tolerance,
        "cheapest_within_tolerance": f"{choice[0]}" if choice[1] == "voice" else f"{choice[0]}-music",
        "product_default": {"complexity": defaults.complexity, "signal": defaults.signal,
                            "note": "auto codes as music (CELT alone) while the listener reports no loss, as voice with FEC while it does"},
        "machine_start": start,
    }, started, out=args.out or os.path.join(RESULTS, "opus-quality.json"))


if __name__ == "__main__":
    main()
