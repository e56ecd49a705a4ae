"""A burst of first sentences, with the worker's hold on new streams and without it (issue 59).

    python bench/bench_burst.py --out bench/results/burst.json   # ~6 minutes on 2 cores
    python bench/bench_burst.py --quick                          # one round, no 2x C arm

Two `voxgate serve` as users run them (default engine and voice, loopback ICE), the same but
for `--[no-]engine-hold-new`, both up for the whole run, so the arms alternate on one machine
in one sitting: round by round, each size goes to one server and then the other, the order
swapped every round. The clients are `voxgate.rtc_client.RtcClient` aiortc peers in this
process over UDP on loopback, decoding real Opus, asking for DTX between utterances as the
page does. N sessions connect; then all N send the same first sentence at the same moment.

Per size (5, 10 and 2x C at once, C the node's capacity from /readyz's budget_rtf; the 2x C
sessions connect as conversations, so admission takes them), per arm:
- client TTFA: from the `speak` message's send to the first decoded frame with sound, at
  the client (p50 is the median, p95, max), pooled over the rounds;
- the client's largest gap: the longest time between two decoded frames where either carries
  sound, between `audio.started` and `utterance.done` (bench_past_capacity.gaps_between);
  and gaps over 60 ms;
- the server's underruns over the arm: the engine's (`voxgate_speech_underruns_total`: a
  chunk sent after its listener had run out) and the playout's (`voxgate_pacer_underruns_total`:
  silence sent inside an utterance). The client's gaps cannot see the second kind: the gateway
  fills a stall with coded silence, which arrives on time. So both are reported.

Figures go to stdout and artifacts/bench-burst.json (or --out).
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import arg_parser, finish, machine, percentile, print_machine, section, wait_ready  # noqa: E402
from bench_past_capacity import GAP_S, LoopWatch, Server, gaps_between, server_figures  # noqa: E402

from voxgate.rtc_client import OfferRefused, RtcClient  # noqa: E402

# Eleven words, as issue 59 measured.
SENTENCE = "Thanks for calling, I can look up your order right away."
ARMS = ("hold", "no-hold")
# Done when (issue 59): against no hold, TTFA p50 and p95 at most this many times, and the largest gap.
TTFA_LIMIT = 1.1
GAP_LIMIT = 1.2


def arm_server(arm: str, extra: list[str]) -> Server:
    """One arm's server: the same but for the hold."""
    flag = "--engine-hold-new" if arm == "hold" else "--no-engine-hold-new"
    return Server([flag, *extra], f"bench-burst-{arm}.log")


async def burst(server: Server, n: int, tag: str) -> dict:
    """N sessions connect, then all say SENTENCE at once; what each heard."""
    clients: list[RtcClient] = []
    refused = 0
    for _ in range(n):
        client = RtcClient(server.url, dtx=True)
        try:
            await client.connect()
        except OfferRefused:
            await client.close()
            refused += 1
            continue
        clients.append(client)
    await asyncio.sleep(1.0)  # the peers' DTLS and first keep-alives settle before the burst
    _, m0 = await server.get("/metrics")
    results = []
    with LoopWatch() as watch:
        sent = [c.send({"type": "speak", "text": SENTENCE, "id": f"{tag}{i}"}) for i, c in enumerate(clients)]
        events = await asyncio.gather(*(_heard(c) for c in clients))
    _, m1 = await server.get("/metrics")
    for c, at, (started, done) in zip(clients, sent, events):
        if started is None or done is None:
            results.append({"ok": False})
            continue
        await c.wait_tail(done)
        sound = c.audio.first_sound_after(at)
        gaps = [g for _, g in gaps_between(c, started, done)]
        results.append({"ok": True, "ttfa_ms": None if sound is None else 1000 * (sound - at),
                        "server_ttfa_ms": started.get("ttfa_ms"), "longest_gap_ms": 1000 * max(gaps, default=0.0),
                        "gaps_over_60ms": sum(1 for g in gaps if g > GAP_S)})
    for c in clients:
        await c.close()
    await server.wait_empty()
    return {"sessions": len(clients), "refused": refused, "utterances": results, "server": server_figures(m0, m1),
            "client_process": watch.report()}


async def _heard(client: RtcClient) -> tuple[dict | None, dict | None]:
    started = await client.wait_for_any(("audio.started", "session.closed", "utterance.interrupted"), timeout=120.0)
    if started["type"] != "audio.started":
        return None, None
    done = await client.wait_for_any(("utterance.done", "session.closed", "utterance.interrupted"), timeout=120.0)
    return started, (done if done["type"] == "utterance.done" else None)


def pooled(runs: list[dict]) -> dict:
    heard = [u for r in runs for u in r["utterances"] if u.get("ok") and u.get("ttfa_ms") is not None]
    ttfa = [u["ttfa_ms"] for u in heard]

    def q(p: float) -> float | None:
        return round(percentile(ttfa, p), 1) if ttfa else None

    return {
        "utterances": len(heard), "missing": sum(1 for r in runs for u in r["utterances"] if not u.get("ok")),
        "refused": sum(r["refused"] for r in runs),
        "client_ttfa_ms": {"p50": q(50), "p95": q(95), "max": round(max(ttfa), 1) if ttfa else None},
        "server_ttfa_ms_p50": round(percentile([u["server_ttfa_ms"] for u in heard], 50), 1) if heard else None,
        "largest_gap_ms": round(max((u["longest_gap_ms"] for u in heard), default=0.0), 1),
        "gaps_over_60ms": sum(u["gaps_over_60ms"] for u in heard),
        "speech_underruns": sum(r["server"]["speech_underruns"] for r in runs),
        "pacer_underruns": sum(r["server"]["pacer_underruns"] for r in runs),
        "late_frames": sum(r["server"]["late_frames"] for r in runs),
    }


async def run(args) -> dict:
    extra = args.server_args.split() if args.server_args else []
    servers = {arm: arm_server(arm, extra) for arm in ARMS}
    try:
        for s in servers.values():
            await asyncio.get_running_loop().run_in_executor(None, wait_ready, s.url, 180)
        await asyncio.sleep(3.0)  # admission's budget once the workers have calibrated
        capacity = min([float((await s.get("/readyz"))[1]["budget_rtf"]) for s in servers.values()])
        sizes = [5, 10] + ([] if args.quick else [2 * math.ceil(capacity)])
        rounds = 1 if args.quick else args.rounds
        print(f"capacity C {capacity:.2f} (the smaller budget_rtf of the two); sizes {sizes}; {rounds} round(s)")
        runs: dict[str, dict[str, list]] = {str(n): {arm: [] for arm in ARMS} for n in sizes}
        for r in range(rounds):
            for n in sizes:
                if n > 10 and r > 0:
                    continue  # 2x C: one round (each is minutes of peers)
                order = ARMS if (r + n) % 2 == 0 else ARMS[::-1]
                for arm in order:
                    section(f"round {r + 1}: {n} at once, {arm}")
                    result = await burst(servers[arm], n, f"r{r}{arm[0]}")
                    runs[str(n)][arm].append(result)
                    p = pooled([result])
                    print(f"TTFA {p['client_ttfa_ms']} ms; largest gap {p['largest_gap_ms']} ms; underruns speech "
                          f"{p['speech_underruns']:.0f} pacer {p['pacer_underruns']:.0f}; refused {p['refused']}", flush=True)
        table = {}
        for n in sizes:
            hold, free = pooled(runs[str(n)]["hold"]), pooled(runs[str(n)]["no-hold"])
            ratio = {k: round(hold["client_ttfa_ms"][k] / free["client_ttfa_ms"][k], 3)
                     if hold["client_ttfa_ms"][k] and free["client_ttfa_ms"][k] else None for k in ("p50", "p95")}
            gap_ratio = round(hold["largest_gap_ms"] / free["largest_gap_ms"], 3) if free["largest_gap_ms"] else None
            table[str(n)] = {"hold": hold, "no_hold": free, "ttfa_ratio": ratio, "largest_gap_ratio": gap_ratio}
        out = {"servers": {arm: " ".join(s.cmd[1:]) for arm, s in servers.items()}, "capacity_sessions": capacity,
               "sentence": SENTENCE, "sizes": sizes, "rounds": rounds, "table": table, "runs": runs}
        checks = {}
        for n in sizes[:2]:
            t = table[str(n)]
            checks[f"{n} at once: TTFA p50 and p95 <= {TTFA_LIMIT}x no hold"] = all(
                v is not None and v <= TTFA_LIMIT for v in t["ttfa_ratio"].values())
            checks[f"{n} at once: largest gap <= {GAP_LIMIT}x no hold"] = (
                t["hold"]["largest_gap_ms"] <= GAP_LIMIT * max(t["no_hold"]["largest_gap_ms"], 1000 * GAP_S))
        if len(sizes) > 2:
            checks["2x C: 0 client gaps > 60 ms with the hold"] = table[str(sizes[2])]["hold"]["gaps_over_60ms"] == 0
        out["checks"] = checks
        section("summary (client TTFA p50/p95 ms; largest client gap ms; server underruns speech/pacer)")
        for n in sizes:
            t = table[str(n)]
            for arm, key in (("hold", "hold"), ("no hold", "no_hold")):
                a = t[key]
                print(f"{n:>3} at once, {arm:<8}: {a['client_ttfa_ms']['p50']} / {a['client_ttfa_ms']['p95']}; "
                      f"{a['largest_gap_ms']}; {a['speech_underruns']:.0f} / {a['pacer_underruns']:.0f}  ({a['utterances']} heard)")
            print(f"    ratio hold / no hold: TTFA {t['ttfa_ratio']}, largest gap {t['largest_gap_ratio']}")
        for k, v in checks.items():
            print(f"  {'ok ' if v else 'NOT'} {k}")
        return out
    finally:
        for s in servers.values():
            s.stop()


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of 5 and 10 at once per arm (default 3)")
    parser.add_argument("--server-args", default="", help="more arguments for both voxgate serve")
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = asyncio.run(run(args))
    results["machine"] = info
    results["args"] = vars(args)
    results["all_checks_pass"] = all(results["checks"].values())
    finish("burst", results, started, args.out)
    return 0 if results["all_checks_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
