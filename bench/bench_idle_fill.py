"""Idle fill: sessions that never speak, against another key's POST /v1/sessions (issue 53, finding 3).

    python bench/bench_idle_fill.py [--offers 30] [--ahead 29] [--out bench/results/idle-fill.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone`, keys `attacker` and `victim`,
`--trusted-proxy 127.0.0.0/8` so that the attacker's offers come from the addresses it names in
X-Forwarded-For, and `--synthesis-budget 12`: the budget the issue's attack met, where about 30 quiet
sessions at the default --talk-share of 0.4 fill it). Two arms, each on a fresh server:

- offers: `--offers` anonymous offers with their candidates stripped (their ICE never completes), from
  3 addresses, each within the per-address cap of 10;
- made ahead: `--ahead` sessions made ahead by the `attacker` key (under its limit of 50), never joined.

Then the `victim` key makes a session, joins it over WebRTC and asks it to speak: measured are the
status of its POST /v1/sessions and whether (and how soon) its audio started. `--before-python`
runs the same against a server with older code.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp  # noqa: E402

from _attack import Gateway, status_of  # noqa: E402
from _common import arg_parser, finish, machine, print_machine, this_code_and_before  # noqa: E402

FLAGS = ["--api-key", "attacker", "--api-key", "victim", "--trusted-proxy", "127.0.0.0/8", "--synthesis-budget", "12"]
ADDRESSES = ("198.51.100.1", "198.51.100.2", "198.51.100.3")


async def stripped_sdp() -> str:
    from aiortc import RTCConfiguration, RTCPeerConnection

    from voxgate.gateway.webrtc.ice import restrict_host_addresses

    restrict_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = "\r\n".join(line for line in pc.localDescription.sdp.splitlines() if not line.startswith("a=candidate")) + "\r\n"
    await pc.close()
    return sdp


async def victim_uses_a_session(http: aiohttp.ClientSession, url: str) -> dict:
    from voxgate.rtc_client import RtcClient

    t0 = time.monotonic()
    status, made = await status_of(http, "POST", url + "/v1/sessions", headers={"X-API-Key": "victim"})
    out: dict = {"create_status": status, "error": (made or {}).get("error", {}).get("reason") if status != 201 else None}
    if status != 201:
        return {**out, "spoke": False}
    client = RtcClient(url, session_id=made["session_id"], token=made["client_token"])
    try:
        await client.connect()
        client.send({"type": "speak", "text": "Hello there.", "id": "v"})
        await client.wait_for("audio.started", id="v")
        return {**out, "spoke": True, "audio_started_after_s": round(time.monotonic() - t0, 2)}
    except Exception as exc:  # a refused join is the finding
        return {**out, "spoke": False, "join_error": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        await client.close()


async def offers_arm(args, python: str) -> dict:
    gateway = Gateway(python, FLAGS)
    try:
        await gateway.ready()
        sdp = await stripped_sdp()
        statuses: dict[str, int] = {}
        async with aiohttp.ClientSession() as http:
            for i in range(args.offers):
                status, _ = await status_of(http, "POST", gateway.url + "/v1/offer", json={"sdp": sdp, "type": "offer"},
                                            headers={"X-Forwarded-For": ADDRESSES[i % len(ADDRESSES)]})
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            victim = await victim_uses_a_session(http, gateway.url)
        return {"attacker_offers": statuses, "victim": victim}
    finally:
        await gateway.stop()


async def ahead_arm(args, python: str) -> dict:
    gateway = Gateway(python, FLAGS)
    try:
        await gateway.ready()
        statuses: dict[str, int] = {}
        async with aiohttp.ClientSession() as http:
            for _ in range(args.ahead):
                status, _ = await status_of(http, "POST", gateway.url + "/v1/sessions", headers={"X-API-Key": "attacker"})
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            victim = await victim_uses_a_session(http, gateway.url)
        return {"attacker_made_ahead": statuses, "victim": victim}
    finally:
        await gateway.stop()


async def measure(args, python: str) -> dict:
    out = {"offers": await offers_arm(args, python), "made_ahead": await ahead_arm(args, python)}
    for arm, row in out.items():
        print(f"{arm}: attacker {row.get('attacker_offers') or row.get('attacker_made_ahead')}; victim {row['victim']}",
              flush=True)
    return out


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--offers", type=int, default=30)
    parser.add_argument("--ahead", type=int, default=29)
    parser.add_argument("--before-python", metavar="PYTHON")
    args = parser.parse_args()
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = {"what": f"another key's POST /v1/sessions and first audio after {args.offers} never-connecting offers "
                       f"(3 addresses) or {args.ahead} sessions made ahead by one key; tone engine, --synthesis-budget 12, "
                       "talk share 0.4, server at priority normal, clients at nice 19, loopback"}
    this_code_and_before(results, measure, args)
    results["machine"] = info
    finish("idle-fill", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
