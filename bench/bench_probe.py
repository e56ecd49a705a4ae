"""The gateway under `voxgate probe`: 8 sessions against 1, on a local tone-engine server.

    python bench/bench_probe.py           # about a minute on 2 cores
    python bench/bench_probe.py --quick   # 4 sessions, shorter texts

Starts `voxgate serve --engine tone` on loopback, then runs the probe twice,
interleaved as A B A B: a 1-session baseline and an N-session run (ramped
over 1 s, half of the sessions cancelling 700 ms into their audio). The tone
engine costs almost nothing, so the figures are the gateway's own: signaling,
WebRTC, pacing and the probe client on the same machine. Each N-session
figure is printed beside the baseline's and as a ratio to it.

Figures go to stdout and artifacts/bench-probe.json; the last N-session HTML
report goes to artifacts/bench-probe.html.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ARTIFACTS, arg_parser, finish, free_port, machine, print_machine, ratio, section, wait_ready  # noqa: E402

from voxgate.probe import ProbeConfig, ProbeReport, run_probe, write_html  # noqa: E402

TEXTS = [
    "Good morning. This is the benchmark speaking through the gateway, one symbol at a time.",
    "Every session hears its own text, and the probe decodes it to check played text exactly.",
]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(ARTIFACTS, "bench-probe-server.log"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "voxgate.cli", "serve", "--engine", "tone", "--port", str(port), "--ice-host", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(url, 60)
    except RuntimeError:
        proc.kill()
        raise SystemExit("the tone server did not become ready") from None
    return proc, url


def figures(report: ProbeReport) -> dict:
    f = report.figures()
    return {
        "ttfa_client_p50": f["ttfa_client_ms"]["p50"],
        "ttfa_client_p95": f["ttfa_client_ms"]["p95"],
        "ttfa_server_p50": f["ttfa_server_ms"]["p50"],
        "ttfa_server_p95": f["ttfa_server_ms"]["p95"],
        "cancel_to_silence_p50": (f["interrupt_to_silence_ms"].get("cancel") or {}).get("p50"),
        "cancel_to_silence_max": (f["interrupt_to_silence_ms"].get("cancel") or {}).get("max"),
        "frame_gap_max": f["frames"]["max_gap_ms"],
        "frame_gap_p99": f["frames"]["p99_gap_ms"],
        "underruns": f["frames"]["underruns"],
        "failed_sessions": f["sessions"]["failed"],
        "played_text_exact": (f["played_text"].get("tone") or {}).get("exact"),
        "played_text_checked": (f["played_text"].get("tone") or {}).get("checked"),
        "server_cancel_to_silence_mean": ((f.get("server") or {}).get("cancel_to_silence") or {}).get("mean_ms"),
    }


def mean_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return sum(values) / len(values) if values else None


async def main() -> None:
    args = arg_parser(__doc__).parse_args()
    n = 4 if args.quick else 8
    rounds = 1 if args.quick else 2
    started = time.perf_counter()
    os.makedirs(ARTIFACTS, exist_ok=True)
    before = machine()
    print_machine(before, "machine at start")
    proc, url = start_server()
    results: dict = {"quick": args.quick, "sessions": n, "machine_start": before, "runs": {"1": [], str(n): []}}
    last: ProbeReport | None = None
    try:
        for r in range(rounds):
            for sessions in (1, n):
                config = ProbeConfig(
                    url=url, sessions=sessions, ramp_s=1.0 if sessions > 1 else 0.0, texts=TEXTS, utterances=2,
                    interrupt_at_ms=700, interrupt_share=0.5 if sessions > 1 else 0.0, seed=r + 1,
                )
                section(f"round {r + 1}: {sessions} session{'s' if sessions > 1 else ''}")
                report = await run_probe(config)
                print(report.summary_text())
                results["runs"][str(sessions)].append(figures(report))
                if sessions == n:
                    last = report
    finally:
        proc.terminate()
        proc.wait(10)
    section(f"{n} sessions against 1 (means over {rounds} round{'s' if rounds > 1 else ''}, ms)")
    base, load = results["runs"]["1"], results["runs"][str(n)]
    comparison = {}
    print(f"{'figure':<24}{'1 session':>12}{f'{n} sessions':>14}{'ratio':>8}")
    for key in ("ttfa_client_p50", "ttfa_client_p95", "ttfa_server_p50", "ttfa_server_p95", "frame_gap_max", "frame_gap_p99"):
        a, b = mean_of(base, key), mean_of(load, key)
        comparison[key] = {"baseline": a, "load": b, "ratio": ratio(b, a) if a and b is not None else None}
        ra = comparison[key]["ratio"]
        print(f"{key:<24}{a if a is not None else float('nan'):>12.1f}{b if b is not None else float('nan'):>14.1f}{ra if ra is not None else float('nan'):>8.2f}")
    for key in ("cancel_to_silence_p50", "cancel_to_silence_max", "server_cancel_to_silence_mean"):
        b = mean_of(load, key)
        comparison[key] = {"load": b}
        print(f"{key:<24}{'-':>12}{b if b is not None else float('nan'):>14.1f}")
    exact = sum(r["played_text_exact"] or 0 for r in load)
    checked = sum(r["played_text_checked"] or 0 for r in load)
    print(f"played_text exact in the {n}-session runs: {exact}/{checked}; failed sessions: {sum(r['failed_sessions'] for r in load)}; underruns: {sum(r['underruns'] for r in load)}")
    results["comparison"] = comparison
    if last is not None:
        html_path = os.path.join(ARTIFACTS, "bench-probe.html")
        write_html(last, html_path)
        print(f"HTML report of the last {n}-session run: {html_path}")
    finish("probe", results, started)


if __name__ == "__main__":
    asyncio.run(main())
