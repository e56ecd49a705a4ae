"""Helpers the benchmarks share: percentiles, machine facts, process figures, JSON output.

The benchmark machines are shared and noisy, so every figure a script prints
sits beside a baseline measured in the same run, and the machine's state (load,
the busiest other processes) is recorded with the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "artifacts")
# Committed raw output behind the figures quoted in README.md and docs/ (small files).
RESULTS = os.path.join(ROOT, "bench", "results")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile, q in 0..100; NaN for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(math.ceil(q / 100.0 * len(s))) - 1))
    return s[k]


def summary_ms(xs_s: list[float]) -> dict:
    """p50/p95/max/mean in milliseconds of samples given in seconds."""
    ms = [x * 1000.0 for x in xs_s]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50": round(percentile(ms, 50), 2),
        "p95": round(percentile(ms, 95), 2),
        "max": round(max(ms), 2),
        "mean": round(sum(ms) / len(ms), 2),
    }


def bootstrap_ci(xs: list[float], stat=None, q: float = 50.0, n: int = 2000, seed: int = 1) -> tuple[float, float]:
    """95 % bootstrap interval of a percentile (the median by default) of the samples."""
    import random

    if len(xs) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    stat = stat or (lambda ys: percentile(ys, q))
    values = sorted(stat([rng.choice(xs) for _ in xs]) for _ in range(n))
    return values[int(0.025 * n)], values[int(0.975 * n) - 1]


def summary_ci_ms(xs_s: list[float]) -> dict:
    """summary_ms plus the 95 % bootstrap interval of the median, in ms."""
    out = summary_ms(xs_s)
    if out.get("n", 0) >= 2:
        lo, hi = bootstrap_ci([x * 1000.0 for x in xs_s])
        out["p50_ci95"] = [round(lo, 2), round(hi, 2)]
        import statistics

        out["stdev"] = round(statistics.stdev(x * 1000.0 for x in xs_s), 2)
    return out


def fmt_ms(s: dict, keys: tuple[str, ...] = ("p50", "p95", "max")) -> str:
    if not s.get("n"):
        return "no samples"
    return "  ".join(f"{k} {s[k]:7.1f}" for k in keys) + f"  (n={s['n']})"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a server this benchmark starts."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 90.0) -> None:
    """Until `url`/readyz answers 200 (a server started as a subprocess); RuntimeError after `timeout_s`."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as resp:
                if resp.status == 200:
                    return
        except Exception:
            time.sleep(0.2)  # not listening yet: a subprocess starting up
    raise RuntimeError(f"{url} did not become ready within {timeout_s:g} s")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime 14, stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def proc_mem_mb(pid: int) -> dict:
    """VmRSS and VmHWM (peak RSS) of a process, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = round(int(value.split()[0]) / 1024.0, 1)
    return {"rss_mb": out.get("VmRSS"), "peak_rss_mb": out.get("VmHWM")}


def busy_processes(window_s: float = 1.0, top: int = 5, exclude: set[int] | None = None) -> list[dict]:
    """The processes that used the most CPU over a short window (other engineers' work, say)."""
    exclude = exclude or set()

    def sample() -> dict[int, tuple[float, str]]:
        out = {}
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in exclude:
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
                out[int(name)] = (proc_cpu_s(int(name)), cmd)
            except (OSError, IndexError, ValueError):
                continue
        return out

    before = sample()
    time.sleep(window_s)
    after = sample()
    rows = []
    for pid, (cpu, cmd) in after.items():
        if pid in before and cmd:
            used = (cpu - before[pid][0]) / window_s
            if used > 0.02:
                rows.append({"pid": pid, "cpu_pct": round(used * 100.0, 1), "cmd": cmd})
    rows.sort(key=lambda r: -r["cpu_pct"])
    return rows[:top]


def machine(exclude: set[int] | None = None) -> dict:
    """Facts to publish with the figures: when, where, and how busy the machine was."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cores": cores,
        "python": sys.version.split()[0],
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "busy_processes": busy_processes(exclude=(exclude or set()) | {os.getpid()}),
    }


def print_machine(info: dict, label: str) -> None:
    print(f"{label}: {info['date']}, {info['cpu']}, {info['cores']} cores, load {info['loadavg']}")
    for p in info["busy_processes"]:
        print(f"    busy: {p['cpu_pct']:5.1f}% pid {p['pid']} {p['cmd']}")


def write_json(name: str, data: dict, out: str | None = None) -> str:
    """artifacts/bench-<name>.json, or `out` (e.g. bench/results/<name>.json, committed)."""
    path = out or os.path.join(ARTIFACTS, f"bench-{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(data), f, indent=2)
    return path


def finish(name: str, results: dict, started: float, out: str | None = None) -> None:
    """Record the machine's state at the end and the run's length, print them, write the JSON."""
    results["machine_end"] = machine()
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    print_machine(results["machine_end"], "\nmachine at end")
    print(f"elapsed {results['elapsed_s']:.0f} s; figures in {write_json(name, results, out)}")


def run_recorded(name: str, coroutine, args) -> dict:
    """Run a bench coroutine between machine snapshots and write its figures with its arguments."""
    import asyncio

    info = machine()
    print_machine(info, "machine")
    data = asyncio.run(coroutine)
    data["machine"] = info
    data["args"] = vars(args)
    data["machine_end"] = machine()
    print("wrote", write_json(name, data, getattr(args, "out", None)))
    return data


def _clean(x):
    # Strict JSON: NaN (a figure with no samples) becomes null; numpy scalars become floats.
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    try:
        f = float(x)
    except (TypeError, ValueError):
        return str(x)
    return None if math.isnan(f) or math.isinf(f) else f


def arg_parser(doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and shorter windows (under ~2 minutes)")
    parser.add_argument("--out", default=None, help="JSON path (default artifacts/bench-<name>.json; bench/results/ for figures quoted in docs)")
    return parser


def section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


async def stop_server_async(proc, signum: int | None = None, wait_s: float = 10.0) -> None:
    """The same from inside an event loop: `signum` (SIGTERM when None), then SIGKILL after `wait_s`,
    polling so the loop's other tasks (the clients closing) keep running meanwhile."""
    import asyncio
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM if signum is None else signum)
        for _ in range(int(wait_s * 10)):
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_server(proc, wait_s: float = 20.0) -> None:
    """SIGTERM a server process started with subprocess.Popen; SIGKILL if it outlives `wait_s`."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def this_code_and_before(results: dict, measure, args) -> None:
    """results["after"]: `measure(args, python)` with this tree's Python; results["before_fix"]:
    with --before-python's (an install of the code before a fix), where one is given."""
    import asyncio

    section("this code")
    results["after"] = asyncio.run(measure(args, sys.executable))
    if args.before_python:
        section(f"the code before ({args.before_python})")
        results["before_fix"] = asyncio.run(measure(args, args.before_python))
