"""Torch engine vs the ONNX engine: first-chunk latency, parity, batched throughput, memory.

    python bench/bench_torch.py                 # CPU, about 2-3 minutes on 2 cores
    python bench/bench_torch.py --device cuda   # the same on a GPU
    python bench/bench_torch.py --streams 1 4   # fewer throughput points
    python bench/bench_torch.py --out bench/results/torch.json

First chunk: wall time from asking for a unit until its first audio chunk,
median of --repeats runs (engines interleaved run by run), with the voice's
default noise, in this process (no worker, no gateway). The units timed are
the ones the gateway sends: each reply goes through the segmenter
(`engine/text/segmenter.py`) and its first unit is timed, both for a reply given
whole (`speak`: the first unit is the whole first sentence when its end is
already there) and for one streamed word by word (`text.delta`: the segmenter
may cut at the first comma). Three engines: the ONNX engine as
the gateway runs it (split graph, windows inside the sentence), the ONNX
engine on whole units (`split=False`: the same-run baseline for "the whole
unit"), and the torch engine (windows, its own schedule). Ratios are torch
over each ONNX figure.

Parity: with noise scales at 0, the torch whole-sentence output against
onnxruntime's whole graph on the same phoneme ids: SNR in dB.

Throughput: seconds of audio per second of wall time for N streams speaking at
once, batched through TorchEngine.step() vs one stream's call at a time (what
a scheduler without batching does).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, print_machine, write_json  # noqa: E402

from voxgate.engine.base import SynthesisOptions  # noqa: E402
from voxgate.engine.piper.piper_engine import PiperEngine, embedded_voice_path  # noqa: E402
from voxgate.engine.text.segmenter import Segmenter  # noqa: E402
from voxgate.engine.torch_voices.torch_engine import TorchEngine  # noqa: E402

# Replies as the gateway receives them; the first unit the segmenter cuts is timed.
REPLIES = {
    "1 word": "Hello.",
    "1 clause": "Please hold the line for a moment.",
    # The old figure timed this whole sentence; the gateway sends "The weather today is sunny, " first.
    "sentence with a comma": "The weather today is sunny, with a light breeze from the west.",
    "3 s sentence, no comma": "Your package left our warehouse this morning and will arrive tomorrow.",
}
PARITY_TEXT = "Parity matters: the quick brown fox jumps over the lazy dog."


def first_unit(text: str, streamed: bool = False) -> str:
    """The first unit the segmenter sends: for text given whole (`speak`), or streamed
    word by word (`text.delta`, an LLM's tokens), where it may cut at the first comma."""
    import re

    seg = Segmenter()
    pieces = re.findall(r"\s*[\w']+|\s*[^\w\s]", text) if streamed else [text]
    units = [u for piece in pieces for u in seg.push(piece)] + seg.end()
    return next(u.speak for u in units if u.speak)
THROUGHPUT_TEXTS = [
    "Please hold the line for a moment.",
    "Your call is important to us.",
    "I can help you with that right away.",
    "Let me check the details of your order.",
]


def peak_mb() -> float:
    # ru_maxrss is in kilobytes on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# Pause before each timed run. onnxruntime's pool threads spin for a while
# after a run, and torch's OpenMP threads after theirs; on 2 cores a run that
# starts right after the other engine's loses the CPU to those spinning
# threads (it made torch's first chunk 50-70 ms slower). A gateway runs one
# engine, so each is timed on a settled machine.
SETTLE_S = 0.2


def first_chunk(engines, text: str, repeats: int) -> list[tuple[float, float, int]]:
    """Per engine: median seconds to the first chunk, audio seconds, chunks per unit."""
    return [(statistics.median(t), a, c) for t, a, c in first_chunk_times(engines, text, repeats)]


def first_chunk_times(engines, text: str, repeats: int) -> list[tuple[list[float], float, int]]:
    """Per engine: every run's seconds to the first chunk, audio seconds, chunks per unit.

    The engines take turns run by run, so a load spike on a shared machine
    hits both rather than one.
    """
    times: list[list[float]] = [[] for _ in engines]
    audio = [0.0] * len(engines)
    chunks = [0] * len(engines)
    for _ in range(repeats):
        for i, engine in enumerate(engines):
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            gen = engine.synthesize(text, SynthesisOptions())
            first = next(gen)
            times[i].append(time.perf_counter() - t0)
            rest = list(gen)
            audio[i] = first.duration + sum(c.duration for c in rest)
            chunks[i] = 1 + len(rest)
    return list(zip(times, audio, chunks))


def whole_time(engine, text: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        for _chunk in engine.synthesize(text, SynthesisOptions()):
            pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    """Signal-to-noise ratio of `out` against `ref` (same length), in dB."""
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    out = np.asarray(out, dtype=np.float64).reshape(-1)
    return float(10 * np.log10((ref**2).sum() / max(((ref - out) ** 2).sum(), 1e-20)))


def parity_snr_db(torch_engine: TorchEngine) -> dict:
    """Torch whole-sentence output vs onnxruntime's whole graph, noise scales 0, same ids."""
    import onnxruntime
    import torch

    job = torch_engine.start(PARITY_TEXT, SynthesisOptions(noise_scale=0.0, noise_w_scale=0.0))
    ids = job.pending[0].ids
    session = onnxruntime.InferenceSession(str(embedded_voice_path()), providers=["CPUExecutionProvider"])
    ref = session.run(None, {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32),
    })[0].reshape(-1).astype(np.float64)
    with torch.inference_mode():
        out = torch_engine._voice(None).model.synthesize(ids, noise_scale=0.0, length_scale=1.0, noise_w=0.0).numpy()
    same = out.size == ref.size
    snr = snr_db(ref, out) if same else float("nan")
    return {"text": PARITY_TEXT, "same_length": same, "samples": int(ref.size), "snr_db": round(snr, 1)}


def throughput(engine: TorchEngine, streams: int, batched: bool) -> tuple[float, float]:
    """Audio seconds per wall second and wall seconds, for `streams` units at once."""
    requests = [(THROUGHPUT_TEXTS[i % len(THROUGHPUT_TEXTS)], SynthesisOptions()) for i in range(streams)]
    t0 = time.perf_counter()
    audio = 0.0
    if batched:
        for chunks in engine.synthesize_batch(requests):
            audio += sum(c.duration for c in chunks)
    else:
        # Round robin, one chunk per stream per turn, as the worker schedules them.
        gens = [engine.synthesize(text, opts) for text, opts in requests]
        while gens:
            alive = []
            for g in gens:
                chunk = next(g, None)
                if chunk is not None:
                    audio += chunk.duration
                    alive.append(g)
            gens = alive
    wall = time.perf_counter() - t0
    return audio / wall, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16, 64], help="stream counts for throughput; none to skip it")
    parser.add_argument("--max-batch", type=int, default=None, help="jobs per forward pass (default: 4 on CPU, 64 on CUDA)")
    parser.add_argument("--out", default=None, help="JSON path (default artifacts/bench-torch.json)")
    args = parser.parse_args()

    info = machine()
    print_machine(info, "machine at start")
    results: dict = {"args": vars(args), "machine_start": info}
    t0 = time.perf_counter()
    onnx = PiperEngine(device=args.device, threads=args.threads)
    onnx.load()
    onnx_whole = PiperEngine(device=args.device, threads=args.threads, split=False)
    onnx_whole.load()
    rss_onnx = peak_mb()
    torch_engine = TorchEngine(device=args.device, threads=args.threads, max_batch=args.max_batch)
    torch_engine.load()
    import torch

    print(f"torch {torch.__version__}, device {torch_engine.device}, threads {args.threads}, "
          f"windows {torch_engine.first_window}->{torch_engine.max_window} frames, "
          f"max batch {torch_engine.info()['max_batch']}, load {time.perf_counter() - t0:.1f}s")
    results["torch"] = {"version": torch.__version__, "device": str(torch_engine.device), "threads": args.threads,
                        "first_window_frames": torch_engine.first_window, "max_window_frames": torch_engine.max_window}
    engines = (onnx, onnx_whole, torch_engine)
    for engine in engines:  # warm every engine: first runs allocate
        for text in REPLIES.values():
            whole_time(engine, first_unit(text), 1)
            whole_time(engine, first_unit(text, streamed=True), 1)

    print("\nFirst chunk of the first unit the gateway sends (median of %d, engines interleaved, default noise)" % args.repeats)
    print(f"{'reply (how it arrives)':<36}{'audio s':>8}{'onnx stream s':>14}{'onnx whole s':>13}{'torch s':>9}{'t/stream':>9}{'t/whole':>8}  first unit")
    rows = {}
    for label, text in REPLIES.items():
        for mode in ("typed", "streamed"):
            unit = first_unit(text, streamed=(mode == "streamed"))
            if mode == "streamed" and unit == first_unit(text):
                continue  # the same unit either way
            name = f"{label} ({mode})"
            (o, audio, oc), (w, _, _), (t, _, tc) = first_chunk(engines, unit, args.repeats)
            rows[name] = {"reply": text, "mode": mode, "first_unit": unit, "audio_s": round(audio, 3),
                          "onnx_stream_first_chunk_s": round(o, 4), "onnx_stream_chunks": oc,
                          "onnx_whole_unit_s": round(w, 4), "torch_first_chunk_s": round(t, 4), "torch_chunks": tc,
                          "torch_over_onnx_stream": round(t / o, 3), "torch_over_onnx_whole": round(t / w, 3)}
            print(f"{name:<36}{audio:>8.2f}{o:>14.4f}{w:>13.4f}{t:>9.4f}{t / o:>8.2f}x{t / w:>7.2f}x  {unit!r}")
    results["first_chunk"] = rows

    print("\nReal-time factor, one stream (compute s / audio s; lower is faster)")
    text = REPLIES["3 s sentence, no comma"]
    audio = first_chunk([onnx], text, 1)[0][1]
    rtf = {name: round(whole_time(e, text, args.repeats) / audio, 3) for name, e in
           (("onnx_stream", onnx), ("onnx_whole", onnx_whole), ("torch", torch_engine))}
    print("   ".join(f"{k} {v:.3f}" for k, v in rtf.items()))
    results["rtf"] = {"text": text, **rtf}

    results["parity"] = parity_snr_db(torch_engine)
    p = results["parity"]
    print(f"\nParity (noise 0, whole sentence): same length {p['same_length']}, SNR {p['snr_db']} dB against onnxruntime")

    print("\nThroughput (audio s per wall s), torch engine")
    print(f"{'streams':>8}{'per stream':>12}{'batched':>10}{'speedup':>9}{'batched wall s':>16}")
    results["throughput"] = []
    for n in args.streams:
        single, _ = throughput(torch_engine, n, batched=False)
        batch, wall = throughput(torch_engine, n, batched=True)
        results["throughput"].append({"streams": n, "per_stream": round(single, 2), "batched": round(batch, 2),
                                      "speedup": round(batch / single, 3), "batched_wall_s": round(wall, 2)})
        print(f"{n:>8}{single:>12.1f}{batch:>10.1f}{batch / single:>8.2f}x{wall:>16.2f}")

    results["peak_rss_mb"] = {"after_onnx_engines": round(rss_onnx), "end": round(peak_mb())}
    print(f"\nPeak RSS: {rss_onnx:.0f} MB after the ONNX engines loaded, {peak_mb():.0f} MB at the end")
    if torch_engine.device.type == "cuda":
        print(f"Peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**20:.0f} MB")
    results["machine_end"] = machine()
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print_machine(results["machine_end"], "machine at end")
    print(f"Total bench time {results['elapsed_s']:.0f}s; figures in {write_json('torch', results, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
