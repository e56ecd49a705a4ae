"""A ConversationRelay application against the backend WebSocket: time to first audio, and voice to voice.

    python bench/bench_relay.py [--engine piper] [--trials 20] [--quick] [--out bench/results/relay.json]
    python bench/bench_relay.py --arm v2v [--turns 16] [--quick] [--out bench/results/relay-v2v.json]

`--arm v2v`: the conversation loop of bench/bench_conversation.py (its caller turns, espeak-ng voices, half
with a pause inside; its measure: from the caller's last voiced sample to the reply's first voiced frame at
an aiortc client over WebRTC) against one gateway process (`--engine piper --stt whisper
--relay-allow-private`), through two arms in the same run: a session relayed to a ConversationRelay
application on loopback that answers each final `prompt` with its reply as one `text` (`last: true`), and a
session whose backend WebSocket answers each final `speech.transcript` with the same reply as `speak`.
The turns go in blocks of --block, each block a new conversation per arm, the arms alternating which goes
first; the figures are the ratio of the p50s (and p95s), relay over backend, from the same run, and the median
of the per-turn ratios (the same turn through both arms, so its own length and recognition time cancel). Turns whose
final came before the caller finished (a pause taken for the end) are left out, as bench_conversation does.

The default arm (`ttfa`), time to first audio after a `text`:

The gateway runs as its own process (`voxgate serve --engine ENGINE --relay-allow-private`). Two phone
calls (the Twilio Media Streams stand-in of tests/telephony) stay up for the whole run, with the same
settings: one relayed to a ConversationRelay application on loopback (tests/relay/relay_app.py's kind),
one joined to a session whose backend WebSocket writes. Trials alternate between them, each arm first in half of them: the same sentence,
sent as one `text` message with `last: true` (relay) or one `speak` (backend: the same text and end in one
message, as the relay hands the session its `text.delta` and `text.end` in one turn of the loop), and the
time from that send to the first μ-law frame at the phone. Both clocks are this process's perf_counter.
The figure is the ratio of the medians, relay over backend, from the same run.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402
from aiohttp import WSMsgType, web  # noqa: E402

from _common import (  # noqa: E402
    arg_parser, bootstrap_ci, finish, free_port, machine, percentile, print_machine, section, stop_server, summary_ms,
    wait_ready,
)
from tests.telephony.twilio_standin import TwilioStandIn  # noqa: E402

SENTENCES = ("Your order shipped this morning and should arrive on Thursday.",
             "The store opens at nine tomorrow and closes at six.",
             "I can move your appointment to Friday afternoon if you like.")


class App:
    """A relay application that speaks when told: the bench holds its socket."""

    def __init__(self) -> None:
        self.ws: web.WebSocketResponse | None = None
        self.ready = asyncio.Event()

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.ws = ws
        async for msg in ws:
            if msg.type == WSMsgType.TEXT and json.loads(msg.data).get("type") == "setup":
                self.ready.set()
        return ws


async def serve_app(handle) -> tuple[web.AppRunner, int]:
    """A relay application's WebSocket at /relay on loopback: its runner (the caller cleans it up) and port."""
    web_app = web.Application()
    web_app.router.add_get("/relay", handle)
    runner = web.AppRunner(web_app)
    await runner.setup()
    app_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", app_port).start()
    return runner, app_port


async def first_frame_after(phone: TwilioStandIn, t0: float, timeout: float = 30.0) -> float:
    await phone.wait(lambda: any(t > t0 for t, _ in phone.received.media), timeout)
    first = min(t for t, _ in phone.received.media if t > t0)
    # The utterance plays to its end before the next trial.
    await phone.wait(lambda: any(m.get("event") == "mark" and m["mark"]["name"].endswith(":end") and t > t0
                                 for t, m in phone.received.messages), timeout)
    return first - t0


async def run(args) -> dict:
    app = App()
    runner, app_port = await serve_app(app.handle)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "voxgate.cli", "serve", "--engine", args.engine, "--host", "127.0.0.1",
                               "--port", str(port), "--relay-allow-private", "--ice-host", "127.0.0.1"])
    url = f"http://127.0.0.1:{port}"
    relay_s: list[float] = []
    backend_s: list[float] = []
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, url)
        relayed = TwilioStandIn(url, stream_sid="MZrelayed", call_sid="CArelayed")
        await relayed.connect()
        await relayed.start({"relay_url": f"ws://127.0.0.1:{app_port}/relay"})
        await asyncio.wait_for(app.ready.wait(), 30)
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/sessions", json={}) as resp:
                made = await resp.json()
            ws = await http.ws_connect(f"{url.replace('http', 'ws')}/v1/sessions/{made['session_id']}/ws")
            direct = TwilioStandIn(url, stream_sid="MZdirect", call_sid="CAdirect")
            await direct.connect()
            await direct.start({"session_id": made["session_id"], "token": made["client_token"]})
            await asyncio.sleep(1.0)
            for i in range(args.trials):
                sentence = SENTENCES[i % len(SENTENCES)]
                assert app.ws is not None
                for arm in (("relay", "backend") if i % 2 == 0 else ("backend", "relay")):  # each goes first half the time
                    t0 = time.perf_counter()
                    if arm == "relay":
                        await app.ws.send_str(json.dumps({"type": "text", "token": sentence, "last": True}))
                        relay_s.append(await first_frame_after(relayed, t0))
                    else:
                        await ws.send_str(json.dumps({"type": "speak", "id": f"b{i}", "text": sentence}))
                        backend_s.append(await first_frame_after(direct, t0))
                print(f"trial {i + 1}: relay {relay_s[-1] * 1000:.1f} ms, backend {backend_s[-1] * 1000:.1f} ms", flush=True)
            await ws.close()
            await relayed.close()
            await direct.close()
    finally:
        stop_server(server)
        await runner.cleanup()
    p50_relay, p50_backend = percentile(relay_s, 50), percentile(backend_s, 50)
    return {
        "label": f"first audio after text, phone (Twilio stand-in), engine {args.engine}, normal priority, "
                 f"{args.trials} alternating trials; relay app vs backend WebSocket, same gateway process",
        "relay_ms": summary_ms(relay_s), "backend_ms": summary_ms(backend_s),
        "relay_p50_ci_ms": [x * 1000 for x in bootstrap_ci(relay_s)],
        "backend_p50_ci_ms": [x * 1000 for x in bootstrap_ci(backend_s)],
        "ratio_p50": round(p50_relay / p50_backend, 3),
    }


class PromptApp:
    """A relay application that answers each final `prompt` at once with the reply, as one `text`; it
    notes when each final came (this process's clock: the backend arm's transcripts are timed the same)."""

    def __init__(self, reply: str) -> None:
        self.reply = reply
        self.finals: list[float] = []

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            message = json.loads(msg.data)
            if message.get("type") == "prompt" and message.get("last"):
                self.finals.append(time.perf_counter())
                await ws.send_str(json.dumps({"type": "text", "token": self.reply, "last": True}))
        return ws


async def talk(url: str, plan: list, session_id: str, token: str | None, finals: list[float]) -> list[dict]:
    """bench_conversation's caller, turn by turn, on a session someone else answers; `finals` fills as they come."""
    from bench_conversation import caller, say_turn

    out = []
    async with caller(url, session_id, token) as client:
        for phrase, voice, clip, paused in plan:
            before = len(finals)
            _, spoke_until, reply_at = await say_turn(client, clip, lambda: finals[before] if len(finals) > before else None)
            mine = finals[before:]
            out.append({"phrase": phrase, "voice": voice, "paused": paused, "finals": len(mine),
                        "early": bool(mine) and mine[0] < spoke_until,
                        "voice_to_voice_ms": round((reply_at - spoke_until) * 1000, 1) if reply_at else None})
    return out


async def backend_arm(url: str, plan: list, reply: str) -> list[dict]:
    from voxgate.client import VoxgateSession

    backend = VoxgateSession(url)
    await backend.open()
    finals: list[float] = []

    async def answer() -> None:
        async for event in backend.events():
            if event.get("type") == "speech.transcript" and event.get("final"):
                finals.append(time.perf_counter())
                await backend.send({"type": "speak", "text": reply})

    answering = asyncio.ensure_future(answer())
    try:
        return await talk(url, plan, backend.session_id, backend.client_token, finals)
    finally:
        answering.cancel()
        await backend.close()


async def relay_arm(url: str, plan: list, app: PromptApp, app_url: str) -> list[dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/sessions", json={"relay": {"url": app_url}}) as resp:
            made = await resp.json()
    app.finals = []
    return await talk(url, plan, made["session_id"], made["client_token"], app.finals)


def v2v_figures(rows: list[dict]) -> dict:
    v2v = [r["voice_to_voice_ms"] for r in rows if r["voice_to_voice_ms"] is not None and not r["early"]]
    return {"p50": round(percentile(v2v, 50), 1) if v2v else None, "p95": round(percentile(v2v, 95), 1) if v2v else None,
            "n": len(v2v), "turns": len(rows), "early": sum(r["early"] for r in rows),
            "no_reply": sum(r["voice_to_voice_ms"] is None for r in rows),
            "p50_ci_ms": [round(x, 1) for x in bootstrap_ci(v2v)] if len(v2v) > 2 else None, "rows": rows}


async def v2v_run(args, server_url: str) -> dict:
    from bench_conversation import REPLY, turns

    app = PromptApp(REPLY)
    runner, app_port = await serve_app(app.handle)
    plan = turns(args.turns)
    rows: dict[str, list[dict]] = {"relay": [], "backend": []}
    try:
        for b, start in enumerate(range(0, len(plan), args.block)):
            block = plan[start:start + args.block]
            for arm in (("relay", "backend") if b % 2 == 0 else ("backend", "relay")):
                got = (await relay_arm(server_url, block, app, f"ws://127.0.0.1:{app_port}/relay") if arm == "relay"
                       else await backend_arm(server_url, block, REPLY))
                rows[arm] += got
                print(f"  block {b + 1} {arm}: " + ", ".join(f"{r['voice_to_voice_ms']}{'E' if r['early'] else ''}"
                                                            for r in got), flush=True)
    finally:
        await runner.cleanup()
    relay, backend = v2v_figures(rows["relay"]), v2v_figures(rows["backend"])
    ratio = {q: round(relay[q] / backend[q], 3) if relay[q] and backend[q] else None for q in ("p50", "p95")}
    # The same turn (phrase and voice) through both arms, side by side: the turns' own spread (their length, the
    # recognizer's time on them) cancels, which the two arms' separate percentiles leave in.
    paired = [r["voice_to_voice_ms"] / b["voice_to_voice_ms"] for r, b in zip(rows["relay"], rows["backend"])
              if r["voice_to_voice_ms"] and b["voice_to_voice_ms"] and not r["early"] and not b["early"]]
    return {"relay": relay, "backend": backend, "ratio_p50": ratio["p50"], "ratio_p95": ratio["p95"],
            "paired_ratio_median": round(percentile(paired, 50), 3) if paired else None,
            "paired_ratio_ci": [round(x, 3) for x in bootstrap_ci(paired)] if len(paired) > 2 else None,
            "paired_turns": len(paired)}


def v2v_main(args) -> None:
    from tests.conftest import ServerProcess

    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results: dict = {"machine": info, "args": vars(args), "label": (
        "voice to voice over WebRTC, relay app vs backend WebSocket, same gateway process (--engine piper --stt "
        f"whisper), same caller turns ({args.turns} per arm, blocks of {args.block}, arms alternating first), "
        "normal priority; the uptime load at start and end is in machine/machine_end")}
    server = ServerProcess("piper", ["--stt", "whisper", "--relay-allow-private"])
    try:
        section(f"voice to voice: {args.turns} turns per arm")
        results.update(asyncio.run(v2v_run(args, server.url)))
    finally:
        server.stop()
    print(f"relay p50 {results['relay']['p50']} ms p95 {results['relay']['p95']} ms (n {results['relay']['n']}); "
          f"backend p50 {results['backend']['p50']} ms p95 {results['backend']['p95']} ms (n {results['backend']['n']}); "
          f"ratio p50 {results['ratio_p50']}, p95 {results['ratio_p95']}; per turn, paired: median "
          f"{results['paired_ratio_median']} (95 % interval {results['paired_ratio_ci']}, {results['paired_turns']} turns)",
          flush=True)
    finish("relay-v2v", results, started, args.out)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--arm", choices=("ttfa", "v2v"), default="ttfa",
                        help="ttfa: first audio after text (phone); v2v: voice to voice (WebRTC, --stt whisper)")
    parser.add_argument("--engine", default="piper", help="the gateway's engine (piper, tone); ttfa")
    parser.add_argument("--trials", type=int, default=20, help="trials per arm; ttfa")
    parser.add_argument("--turns", type=int, default=16, help="caller turns per arm; v2v")
    parser.add_argument("--block", type=int, default=4, help="turns per conversation before the arms swap; v2v")
    args = parser.parse_args()
    if args.quick:
        args.trials = min(args.trials, 6)
        args.turns = min(args.turns, 4)
        args.block = min(args.block, 2)
    if args.arm == "v2v":
        v2v_main(args)
        return
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = asyncio.run(run(args))
    results["machine"] = info
    results["args"] = vars(args)
    print(f"relay p50 {results['relay_ms']['p50']} ms, backend p50 {results['backend_ms']['p50']} ms, "
          f"ratio {results['ratio_p50']}")
    finish("relay", results, started, args.out)


if __name__ == "__main__":
    main()
