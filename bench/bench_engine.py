"""The engine worker: first-chunk latency, real-time factor, concurrency, memory.

    python bench/bench_engine.py           # about 3-4 minutes on 2 cores
    python bench/bench_engine.py --quick   # under 2 minutes, fewer repetitions

Every figure is set against a baseline measured in the same run, because the
machine is shared and its speed drifts:

1. Worker overhead. Time to first chunk and real-time factor (RTF: synthesis
   wall time / audio time) through `EngineClient` (segmenter, pipe, worker
   process, scheduler) against `PiperEngine` called directly in this process
   on the same unit text with the same thread settings, interleaved run by
   run (alternating which goes first). overhead = worker - direct, per run;
   the target is p50 <= 5 ms. Each median comes with a 95 % bootstrap
   interval; an interval wider than 5 ms means the run did not resolve the
   target. `--overhead-only --reps 100` runs just this, at the gateway's
   default engine settings, with enough rounds to resolve it.
   Through the worker, the first chunk is the first unit the segmenter cut
   (a clause or sentence), so the direct call synthesizes that same unit.
2. Token stream. Words pushed with `TTSStream.push_text` at 30 tokens/s.
   From the first token: when the first clause boundary (its punctuation)
   arrived, when the segmenter sent the first unit (it needs the character
   after the boundary), and when the first chunk came back. first chunk -
   boundary arrival is what aggregation plus synthesis add.
3. Concurrency. 1, 2, 4, 8, 16 streams started at once, each a four-sentence
   reply. Time to first chunk p50/p95 over the streams; per-stream RTF = wall
   time from start to last chunk / audio seconds (max over streams); and
   underruns: whether a listener who started playing at the first chunk would
   ever have run out of audio (the worst such gap is reported), and the least
   audio any stream still had in hand when a later chunk arrived.
4. Memory. Peak RSS (VmHWM) of each worker process.
5. Defaults. EngineConfig(parallel=2, threads=1) against (parallel=1,
   threads=2): single-stream first chunk and 8-stream throughput (audio
   seconds per wall second), both workers alive and used in alternation.

Figures go to stdout and to artifacts/bench-engine.json.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    arg_parser,
    finish,
    fmt_ms,
    machine,
    percentile,
    print_machine,
    proc_mem_mb,
    section,
    summary_ci_ms,
    summary_ms,
)

from voxgate.engine.base import SynthesisOptions  # noqa: E402
from voxgate.gateway.media.frames import FRAME_S  # noqa: E402
from voxgate.engine.runtime.client import EngineClient, EngineConfig  # noqa: E402
from voxgate.engine.piper.piper_engine import PiperEngine  # noqa: E402
from voxgate.engine.text.segmenter import Segmenter  # noqa: E402

TEXTS = {
    "1 word": "Hello.",
    "clause": "Please hold the line for a moment.",
    "3 s sentence": "Your package left our warehouse this morning and will arrive tomorrow.",
}
TOKEN_TEXTS = [
    "Of course, I can help you with that. Let me pull up your order right now.",
    "Sure thing. Your order shipped yesterday and it will arrive on Friday.",
    # "Sure," is shorter than the segmenter's first_min_chars (8): no cut at its comma.
    "Sure, I can help you with that. Let me pull up your order right now.",
]
TOKENS_PER_S = 30.0
REPLY = (
    "Thanks for calling. Your package left our warehouse this morning. "
    "It should arrive tomorrow afternoon. Is there anything else I can help you with today?"
)
CONCURRENCY = (1, 2, 4, 8, 16)


def first_unit(text: str) -> str:
    seg = Segmenter()
    units = [u for u in seg.push(text) + seg.end() if u.speak]
    return units[0].speak


def units_of(text: str) -> list[str]:
    seg = Segmenter()
    return [u.speak for u in seg.push(text) + seg.end() if u.speak]


def direct_run(engine: PiperEngine, units: list[str]) -> tuple[float, float, float]:
    """Direct in-process synthesis of the units in order: first-chunk s, total s, audio s."""
    t0 = time.perf_counter()
    first = None
    audio = 0.0
    for unit in units:
        for chunk in engine.synthesize(unit, SynthesisOptions()):
            if first is None:
                first = time.perf_counter() - t0
            audio += chunk.duration
    return first or 0.0, time.perf_counter() - t0, audio


async def worker_run(client: EngineClient, text: str) -> tuple[float, float, float, float]:
    """The same text through the worker: first-chunk s, last-chunk s, audio s, and the
    worker's own synthesis time for the first chunk (first chunk - that = pipe and scheduling)."""
    stream = client.stream(SynthesisOptions())
    t0 = time.perf_counter()
    stream.push_text(text)
    stream.end_input()
    first = None
    first_synth = 0.0
    audio = 0.0
    async for chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
            first_synth = chunk.synth_s
        audio += chunk.duration
    return first or 0.0, time.perf_counter() - t0, audio, first_synth


async def overhead(client: EngineClient, direct: PiperEngine, reps: int) -> dict:
    section(f"1. worker overhead: EngineClient vs PiperEngine in-process, {reps} interleaved rounds "
            f"(worker parallel={client.config.parallel} threads={client.config.threads or 'every core'}; direct threads={direct.threads})")
    loop = asyncio.get_running_loop()
    out = {}
    for label, text in TEXTS.items():
        units = units_of(text)
        w_first, d_first, diffs, w_rtf, d_rtf = [], [], [], [], []
        for rep in range(reps):
            # Alternate which goes first, so neither always runs on a machine the other just warmed or loaded.
            if rep % 2 == 0:
                df, dt, da = await loop.run_in_executor(None, direct_run, direct, units)
                wf, wt, wa, _ = await worker_run(client, text)
            else:
                wf, wt, wa, _ = await worker_run(client, text)
                df, dt, da = await loop.run_in_executor(None, direct_run, direct, units)
            d_first.append(df)
            w_first.append(wf)
            diffs.append(wf - df)
            d_rtf.append(dt / da)
            w_rtf.append(wt / wa)
        lo, hi = median_difference_ci(w_first, d_first)
        row = {
            "text": text,
            "first_unit": units[0],
            "audio_s": round(wa, 3),
            "reps": reps,
            "direct_first_chunk_ms": summary_ci_ms(d_first),
            "worker_first_chunk_ms": summary_ci_ms(w_first),
            "overhead_paired_ms": summary_ci_ms(diffs),
            "overhead_p50_difference_ms": round(row_p50(w_first) - row_p50(d_first), 2),
            "overhead_p50_difference_ci95_ms": [lo, hi],
            "direct_rtf_p50": round(percentile(d_rtf, 50), 3),
            "worker_rtf_p50": round(percentile(w_rtf, 50), 3),
            "worker_rtf_p95": round(percentile(w_rtf, 95), 3),
        }
        ci = row["overhead_paired_ms"].get("p50_ci95", [float("nan")] * 2)
        # Resolved: the interval of the paired median is narrower than the 5 ms target on either side.
        row["resolved_at_5ms"] = (ci[1] - ci[0]) < 5.0
        row["first_chunk_ratio_p50"] = round(row["worker_first_chunk_ms"]["p50"] / row["direct_first_chunk_ms"]["p50"], 3)
        out[label] = row
        print(f"{label:13s} first unit {units[0]!r} ({wa:.2f} s audio)")
        print(f"   direct  first chunk ms  {fmt_ms(row['direct_first_chunk_ms'])}   RTF p50 {row['direct_rtf_p50']:.3f}")
        print(f"   worker  first chunk ms  {fmt_ms(row['worker_first_chunk_ms'])}   RTF p50 {row['worker_rtf_p50']:.3f} p95 {row['worker_rtf_p95']:.3f}")
        print(f"   overhead ms (worker-direct, paired) {fmt_ms(row['overhead_paired_ms'])}  p50 95% CI {ci}")
        print(f"   p50 worker - p50 direct {row['overhead_p50_difference_ms']:+.2f} ms, 95% CI [{lo:+.2f}, {hi:+.2f}]  "
              f"ratio p50 {row['first_chunk_ratio_p50']:.2f}x  ({'resolved' if row['resolved_at_5ms'] else 'NOT resolved'} at 5 ms)")
    return out


def row_p50(xs_s: list[float]) -> float:
    return percentile([x * 1000.0 for x in xs_s], 50)


def median_difference_ci(a_s: list[float], b_s: list[float], n: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(a) - median(b), in ms."""
    import random

    rng = random.Random(1)
    a = [x * 1000.0 for x in a_s]
    b = [x * 1000.0 for x in b_s]
    diffs = sorted(percentile([rng.choice(a) for _ in a], 50) - percentile([rng.choice(b) for _ in b], 50) for _ in range(n))
    return round(diffs[int(0.025 * n)], 2), round(diffs[int(0.975 * n) - 1], 2)


def tokenize(text: str) -> list[str]:
    # Word-ish LLM tokens: a word with its leading space, punctuation on its own.
    return re.findall(r"\s*[\w']+|\s*[^\w\s]", text)


async def token_stream(client: EngineClient, reps: int) -> dict:
    section(f"2. token stream at {TOKENS_PER_S:.0f} tokens/s (times from the first token)")
    loop = asyncio.get_running_loop()
    out = {}
    for text in TOKEN_TEXTS:
        tokens = tokenize(text)
        unit = first_unit(text)
        # The token carrying the first unit's last punctuation: its arrival is the boundary.
        stripped = unit.rstrip()
        boundary_token = 0
        length = 0
        for i, tok in enumerate(tokens):
            length += len(tok)
            if len(text[:length].strip()) >= len(stripped):
                boundary_token = i
                break
        boundary, sent, first, adds, synth = [], [], [], [], []
        for _ in range(reps):
            stream = client.stream(SynthesisOptions())
            pushed: list[float] = []
            t0 = loop.time()

            def push(i: int) -> None:
                pushed.append(time.perf_counter())
                stream.push_text(tokens[i])
                if i == len(tokens) - 1:
                    stream.end_input()

            for i in range(len(tokens)):
                loop.call_at(t0 + i / TOKENS_PER_S, push, i)
            first_at = None
            async for _chunk in stream:
                if first_at is None:
                    first_at = time.perf_counter()
            start = pushed[0]
            b = pushed[boundary_token] - start
            boundary.append(b)
            sent.append((stream.first_unit_sent_at or start) - start)
            first.append(first_at - start)
            adds.append(first_at - start - b)
            synth.append(first_at - (stream.first_unit_sent_at or start))
        row = {
            "text": text,
            "first_unit": unit,
            "boundary_token_index": boundary_token,
            "boundary_arrival_ms": summary_ms(boundary),
            "first_unit_sent_ms": summary_ms(sent),
            "first_chunk_ms": summary_ms(first),
            "added_by_engine_and_aggregation_ms": summary_ms(adds),
            "unit_sent_to_first_chunk_ms": summary_ms(synth),
        }
        out[unit] = row
        print(f"first unit {unit!r} (boundary in token {boundary_token}: {tokens[boundary_token]!r})")
        print(f"   boundary arrived     {fmt_ms(row['boundary_arrival_ms'])}")
        print(f"   first unit sent      {fmt_ms(row['first_unit_sent_ms'])}")
        print(f"   first chunk          {fmt_ms(row['first_chunk_ms'])}")
        print(f"   chunk - boundary     {fmt_ms(row['added_by_engine_and_aggregation_ms'])}")
    return out


def frame_underruns(arrivals: list[tuple[float, float]], frame_s: float = FRAME_S) -> int:
    """Underruns of a listener whose pacer takes a frame of `frame_s` every `frame_s`
    from the first chunk's arrival: one for each time a frame's audio was not there by its
    tick. The pacer then sends silence frames until it is, and the ticks after shift."""
    ticks_late = 0  # silence frames inserted so far
    played = 0.0  # audio seconds before this chunk
    first = arrivals[0][0] if arrivals else 0.0
    underruns = 0
    for at, duration in arrivals:
        # The first frame that holds any of this chunk's audio, and its tick.
        frame = math.floor(played / frame_s + 1e-9)
        tick = first + (frame + ticks_late) * frame_s
        if at > tick + 1e-9:
            underruns += 1
            ticks_late += math.ceil((at - tick) / frame_s - 1e-9)
        played += duration
    return underruns


def _least_ms(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(min(known) * 1000.0, 1) if known else None


async def concurrent(client: EngineClient, n: int, text: str = REPLY) -> dict:
    """n streams of the same reply started at once."""

    async def one() -> dict:
        stream = client.stream(SynthesisOptions())
        t0 = time.perf_counter()
        stream.push_text(text)
        stream.end_input()
        arrivals: list[tuple[float, float]] = []  # (seconds since start, chunk duration)
        async for chunk in stream:
            arrivals.append((time.perf_counter() - t0, chunk.duration))
        first = arrivals[0][0]
        audio = sum(d for _, d in arrivals)
        # Playback from the first chunk: chunk k is due once the chunks before it have played.
        # A chunk that arrives after it is due is a gap (the stream ran dry); one
        # that arrives before leaves that much audio still buffered (the headroom).
        due = first
        worst_gap = 0.0
        headroom = None  # a stream of one chunk has none to report
        for k, (at, d) in enumerate(arrivals):
            if k:
                headroom = due - at if headroom is None else min(headroom, due - at)
            worst_gap = max(worst_gap, at - due)
            due = max(due, at) + d
        return {"first": first, "wall": arrivals[-1][0], "audio": audio, "gap": worst_gap, "headroom": headroom,
                "underruns_20ms": frame_underruns(arrivals)}

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t0
    audio = sum(r["audio"] for r in results)
    rtfs = [r["wall"] / r["audio"] for r in results]
    return {
        "streams": n,
        "first_chunk_ms": summary_ms([r["first"] for r in results]),
        "max_rtf": round(max(rtfs), 3),
        "p50_rtf": round(percentile(rtfs, 50), 3),
        "all_faster_than_real_time": max(rtfs) < 1.0,
        "streams_with_underrun": sum(1 for r in results if r["gap"] > 0.0),
        "worst_underrun_ms": round(max(r["gap"] for r in results) * 1000.0, 1),
        # The least audio any stream still had buffered when a later chunk arrived
        # (negative: it ran dry): how long a stall of the host it would have survived.
        # Counted from the engine's chunks, as they reach this process: the
        # gateway's resampler and whole 20 ms frames hold back up to about 39 ms
        # more of it from a listener. None when every stream was one chunk.
        "least_headroom_ms": _least_ms([r["headroom"] for r in results]),
        "throughput_audio_s_per_s": round(audio / wall, 2),
        "wall_s": round(wall, 2),
        # Per stream, in start order: the pacer's 20 ms frames whose audio was late (frame_underruns).
        "underruns_20ms_per_stream": [r["underruns_20ms"] for r in results],
        "first_chunk_s_per_stream": [round(r["first"], 4) for r in results],
        "audio_s": round(audio, 2),
    }


async def concurrency(client: EngineClient, rounds: int) -> list[dict]:
    section(f"3. concurrent streams on {os.cpu_count()} cores (parallel={client.config.parallel}, threads={client.config.threads}); each speaks a 4-sentence reply")
    rows = []
    for n in CONCURRENCY:
        merged: dict | None = None
        firsts: list[dict] = []
        for _ in range(rounds):
            r = await concurrent(client, n)
            firsts.append(r)
            if merged is None or r["max_rtf"] > merged["max_rtf"]:
                merged = r  # report the worst round
        assert merged is not None
        row = dict(merged)
        row["rounds"] = rounds
        row["first_chunk_ms_rounds_p50"] = [f["first_chunk_ms"]["p50"] for f in firsts]
        rows.append(row)
        ft = row["first_chunk_ms"]
        print(
            f"{n:3d} streams: first chunk p50 {ft['p50']:7.1f} p95 {ft['p95']:7.1f} ms | RTF p50 {row['p50_rtf']:.2f} max {row['max_rtf']:.2f} "
            f"({'all faster than real time' if row['all_faster_than_real_time'] else 'NOT all real time'}) | "
            f"underruns {row['streams_with_underrun']}/{n} worst {row['worst_underrun_ms']:.0f} ms | {row['throughput_audio_s_per_s']:.1f} audio s/s"
        )
    return rows


async def compare_defaults(reps: int, rounds: int) -> dict:
    cfg_a = EngineConfig(parallel=2, threads=1)
    cfg_b = EngineConfig(parallel=1, threads=2)
    section("5. defaults: parallel=2 threads=1 (A) vs parallel=1 threads=2 (B), used in alternation")
    a, b = EngineClient(cfg_a), EngineClient(cfg_b)
    await a.start()
    await b.start()
    text = TEXTS["clause"]
    fa, fb = [], []
    ta, tb = [], []
    try:
        for _ in range(reps):
            fa.append((await worker_run(a, text))[0])
            fb.append((await worker_run(b, text))[0])
        for _ in range(rounds):
            ta.append(await concurrent(a, 8))
            tb.append(await concurrent(b, 8))
        mem = {"A": proc_mem_mb(a.worker_pid), "B": proc_mem_mb(b.worker_pid)}
    finally:
        await a.close()
        await b.close()

    def eight(rs: list[dict]) -> dict:
        return {
            "throughput_audio_s_per_s_p50": round(percentile([r["throughput_audio_s_per_s"] for r in rs], 50), 2),
            "first_chunk_p50_ms": round(percentile([r["first_chunk_ms"]["p50"] for r in rs], 50), 1),
            "first_chunk_p95_ms": round(percentile([r["first_chunk_ms"]["p95"] for r in rs], 50), 1),
            "max_rtf": max(r["max_rtf"] for r in rs),
        }

    out = {
        "A": {"config": "parallel=2 threads=1", "single_first_chunk_ms": summary_ms(fa), "eight_streams": eight(ta), "memory": mem["A"]},
        "B": {"config": "parallel=1 threads=2", "single_first_chunk_ms": summary_ms(fb), "eight_streams": eight(tb), "memory": mem["B"]},
    }
    la = out["A"]["single_first_chunk_ms"]["p50"]
    lb = out["B"]["single_first_chunk_ms"]["p50"]
    xa = out["A"]["eight_streams"]["throughput_audio_s_per_s_p50"]
    xb = out["B"]["eight_streams"]["throughput_audio_s_per_s_p50"]
    out["latency_ratio_B_over_A"] = round(lb / la, 3)
    out["throughput_ratio_A_over_B"] = round(xa / xb, 3)
    out["better_for_latency"] = "A" if la <= lb else "B"
    out["better_for_throughput"] = "A" if xa >= xb else "B"
    for key in ("A", "B"):
        r = out[key]
        e = r["eight_streams"]
        print(
            f"{key} {r['config']:22s} single first chunk ({text!r}) {fmt_ms(r['single_first_chunk_ms'])} | "
            f"8 streams: {e['throughput_audio_s_per_s_p50']:.1f} audio s/s, first chunk p50 {e['first_chunk_p50_ms']:.0f} p95 {e['first_chunk_p95_ms']:.0f} ms, max RTF {e['max_rtf']:.2f}"
        )
    print(
        f"latency B/A {out['latency_ratio_B_over_A']:.2f}x (better: {out['better_for_latency']}); "
        f"8-stream throughput A/B {out['throughput_ratio_A_over_B']:.2f}x (better: {out['better_for_throughput']})"
    )
    return out


async def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--reps", type=int, default=0, help="interleaved rounds per text in 1. (default 20; 6 with --quick)")
    parser.add_argument("--overhead-only", action="store_true", help="run only 1. (worker overhead), at the default engine settings")
    args = parser.parse_args()
    quick = args.quick
    reps = args.reps or (6 if quick else 20)
    token_reps = 3 if quick else 10
    rounds = 1 if quick else 2
    started = time.perf_counter()
    before = machine()
    print_machine(before, "machine at start")
    results: dict = {"quick": quick, "machine_start": before, "args": vars(args)}
    loop = asyncio.get_running_loop()

    if args.overhead_only:
        # The gateway's defaults: one step per core, every core for a step that runs alone;
        # the direct engine gets the same threads for its steps.
        client = EngineClient(EngineConfig(engine="piper", device="cpu"))
        await client.start()
        direct = PiperEngine(device="cpu")
        await loop.run_in_executor(None, direct.load)
        try:
            results["overhead"] = await overhead(client, direct, reps)
        finally:
            await client.close()
        finish("engine", results, started, args.out)
        return

    client = EngineClient(EngineConfig(parallel=2, threads=1))
    await client.start()
    direct = PiperEngine(threads=1, device="cpu")
    await loop.run_in_executor(None, direct.load)
    try:
        results["overhead"] = await overhead(client, direct, reps)
        results["token_stream"] = await token_stream(client, token_reps)
        results["concurrency"] = await concurrency(client, rounds)
        section("4. memory")
        results["memory"] = {"worker": proc_mem_mb(client.worker_pid), "worker_pid": client.worker_pid}
        print(f"worker (parallel=2 threads=1, after all of the above): RSS {results['memory']['worker']['rss_mb']} MiB, peak {results['memory']['worker']['peak_rss_mb']} MiB")
    finally:
        await client.close()
    del direct
    results["defaults"] = await compare_defaults(reps, rounds)
    results["memory"]["A_parallel2_threads1"] = results["defaults"]["A"]["memory"]
    results["memory"]["B_parallel1_threads2"] = results["defaults"]["B"]["memory"]
    print(
        f"peak RSS: A {results['defaults']['A']['memory']['peak_rss_mb']} MiB, B {results['defaults']['B']['memory']['peak_rss_mb']} MiB (8 streams)"
    )
    finish("engine", results, started, args.out)


if __name__ == "__main__":
    asyncio.run(main())
