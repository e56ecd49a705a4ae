"""Torch engine vs the ONNX engine: first-chunk latency, batched throughput, memory.

    python bench/bench_torch.py                 # CPU, about 2 minutes on 2 cores
    python bench/bench_torch.py --device cuda   # the same on a GPU
    python bench/bench_torch.py --streams 1 4   # fewer throughput points

First chunk: wall time from asking for a unit until its first audio chunk,
median of --repeats runs, with the voice's default noise. The ONNX engine's
first chunk is its whole sentence. Throughput: seconds of audio per second of
wall time for N streams speaking at once, batched through TorchEngine.step()
vs one stream's call at a time (what a scheduler without batching does).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

from voxgate.engine.base import SynthesisOptions
from voxgate.engine.piper_engine import PiperEngine
from voxgate.engine.torch_engine import TorchEngine

SENTENCES = {
    "1 word": "Hello.",
    "1 clause": "Please hold the line for a moment.",
    "3 s sentence": "The weather today is sunny, with a light breeze from the west.",
}
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
    """Per engine: median seconds to the first chunk, audio seconds, chunks per unit.

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
    return [(statistics.median(t), a, c) for t, a, c in zip(times, audio, chunks)]


def whole_time(engine, text: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        time.sleep(SETTLE_S)
        t0 = time.perf_counter()
        for _chunk in engine.synthesize(text, SynthesisOptions()):
            pass
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 4, 16, 64], help="stream counts for throughput; none to skip it")
    parser.add_argument("--max-batch", type=int, default=None, help="jobs per forward pass (default: 4 on CPU, 64 on CUDA)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    onnx = PiperEngine(device=args.device, threads=args.threads)
    onnx.load()
    rss_onnx = peak_mb()
    torch_engine = TorchEngine(device=args.device, threads=args.threads, max_batch=args.max_batch)
    torch_engine.load()
    import torch

    print(f"torch {torch.__version__}, device {torch_engine.device}, threads {args.threads}, "
          f"windows {torch_engine.first_window}->{torch_engine.max_window} frames, "
          f"max batch {torch_engine.info()['max_batch']}, load {time.perf_counter() - t0:.1f}s, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for engine in (onnx, torch_engine):  # warm both: first runs allocate
        for text in SENTENCES.values():
            whole_time(engine, text, 1)

    print("\nFirst chunk (median of %d, default noise)" % args.repeats)
    print(f"{'unit':<14}{'audio s':>8}{'onnx whole s':>14}{'torch first s':>15}{'ratio':>8}{'chunks':>8}")
    for label, text in SENTENCES.items():
        (o, audio, _), (t, _, chunks) = first_chunk([onnx, torch_engine], text, args.repeats)
        print(f"{label:<14}{audio:>8.2f}{o:>14.4f}{t:>15.4f}{t / o:>7.2f}x{chunks:>8}")

    print("\nReal-time factor, one stream (compute s / audio s; lower is faster)")
    text = SENTENCES["3 s sentence"]
    audio = first_chunk([onnx], text, 1)[0][1]
    ro = whole_time(onnx, text, args.repeats) / audio
    rt = whole_time(torch_engine, text, args.repeats) / audio
    print(f"onnx {ro:.3f}   torch {rt:.3f}")

    print("\nThroughput (audio s per wall s), torch engine")
    print(f"{'streams':>8}{'per stream':>12}{'batched':>10}{'speedup':>9}{'batched wall s':>16}")
    for n in args.streams:
        single, _ = throughput(torch_engine, n, batched=False)
        batch, wall = throughput(torch_engine, n, batched=True)
        print(f"{n:>8}{single:>12.1f}{batch:>10.1f}{batch / single:>8.2f}x{wall:>16.2f}")

    print(f"\nPeak RSS: {rss_onnx:.0f} MB after the ONNX engine loaded, {peak_mb():.0f} MB at the end")
    if torch_engine.device.type == "cuda":
        print(f"Peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**20:.0f} MB")
    print(f"Total bench time {time.perf_counter() - t0:.0f}s, load average now {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
