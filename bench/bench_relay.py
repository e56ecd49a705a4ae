"""Time to first audio through a ConversationRelay application against the backend WebSocket.

    python bench/bench_relay.py [--engine piper] [--trials 20] [--quick] [--out bench/results/relay.json]

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
    arg_parser, bootstrap_ci, finish, free_port, machine, percentile, print_machine, stop_server, summary_ms, wait_ready,
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


async def first_frame_after(phone: TwilioStandIn, t0: float, timeout: float = 30.0) -> float:
    await phone.wait(lambda: any(t > t0 for t, _ in phone.received.media), timeout)
    first = min(t for t, _ in phone.received.media if t > t0)
    # The utterance plays to its end before the next trial.
    await phone.wait(lambda: any(m.get("event") == "mark" and m["mark"]["name"].endswith(":end") and t > t0
                                 for t, m in phone.received.messages), timeout)
    return first - t0


async def run(args) -> dict:
    app = App()
    web_app = web.Application()
    web_app.router.add_get("/relay", app.handle)
    runner = web.AppRunner(web_app)
    await runner.setup()
    app_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", app_port).start()
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


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--engine", default="piper", help="the gateway's engine (piper, tone)")
    parser.add_argument("--trials", type=int, default=20, help="trials per arm")
    args = parser.parse_args()
    if args.quick:
        args.trials = min(args.trials, 6)
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
