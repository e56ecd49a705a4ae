"""Loud noise faster than real time against the recognizer (issue 53, finding 2): are other callers still answered?

    python bench/bench_noise_turns.py [--quick] [--out bench/results/noise-turns.json] [--before-python PYTHON]

The gateway runs as its own process (`voxgate serve --engine tone --stt
pocketsphinx`, default --stt-max-concurrent 2, --stt-timeout-s 10, ICE on
127.0.0.1). `--callers` innocent callers (aiortc peers in this process) each
ask a question every `--every` seconds (tests/transcripts.py's questions,
spoken by espeak-ng into their microphones in real time). An attacker process
connects a caller session of its own (tests/security/rtp_flood.py: its
microphone track never sends, its RTP is the attacker's) and, in the noise
window, sends loud noise `--speed` times faster than real time as 20 ms Opus
packets, in bursts of `--burst` seconds each followed by 1 s of silence (at
real time), as the issue did. Two windows of `--window` seconds: baseline
(the callers alone), then noise. Per window: questions asked, questions
answered (a `speech.transcript` with words reached the caller before its next
question), and the recognizer errors the innocent callers got, by code; and
for the whole server, `voxgate_stt_turns_total` by outcome and
`voxgate_mic_dropped_total` by reason. The callers and the attacker run at
nice 19: they stand for other machines.
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

from _common import arg_parser, finish, free_port, machine, print_machine, proc_cpu_s, section, stop_server, wait_ready  # noqa: E402
from bench_stun_flood import _normal_priority, metric  # noqa: E402

WINDOWS = ("baseline", "noise")
OUTCOMES = ("transcript", "stt_busy", "stt_timeout", "stt_failed")
DROP_REASONS = ("ssrc", "packet_rate", "media_rate")


# The attacker, in its own process -------------------------------------------------------------


async def attacker(url: str, speed: float, burst_s: float, seconds: float) -> None:
    import numpy as np

    from voxgate.gateway.media import opus
    from tests.security.rtp_flood import RtpFlood, silent_caller

    client = await silent_caller(url, tries=30)
    flood = RtpFlood(client)
    encoder = opus.Encoder(48000, 32000, 5, False, 0, False)
    rng = np.random.default_rng(53)
    noise = encoder.encode(rng.normal(0, 10000, 48000 * 4).clip(-32767, 32767).astype(np.int16))  # 4 s, 200 packets
    silence = encoder.encode(np.zeros(960, dtype=np.int16))[0]
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    sent = 0
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "noise":
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            burst_at, n = time.monotonic(), 0
            while time.monotonic() - burst_at < burst_s:  # noise, `speed` times real time
                due = int((time.monotonic() - burst_at) * 50 * speed)
                while n < due:
                    flood.packets(1, noise[n % len(noise)])
                    n += 1
                await asyncio.sleep(0.002)
            sent += n
            for _ in range(50):  # a second of silence, in real time
                flood.packets(1, silence)
                await asyncio.sleep(0.02)
        print("DONE " + json.dumps({"noise_packets": sent}), flush=True)
    await client.close()


# The callers and the measurement, in this process ---------------------------------------------


class Caller:
    """An innocent caller asking a question every `every` seconds; what came back, by question."""

    def __init__(self, client, questions: list, every: float) -> None:
        self.client, self.questions, self.every = client, questions, every
        self.asked: list[float] = []  # when each question started playing

    async def run(self) -> None:
        n = 0
        while True:
            t0 = time.perf_counter()
            self.asked.append(t0)
            self.client.mic.play(self.questions[n % len(self.questions)])
            n += 1
            await asyncio.sleep(max(0.0, self.every - (time.perf_counter() - t0)))

    def tally(self, a: float, b: float, grace_s: float) -> dict:
        """Questions asked in [a, b), those answered (each matched, in order, to the first transcript with
        words that came after it and within `grace_s`, not matched to an earlier one), and the recognizer
        errors that reached this caller in the same span."""
        log = [(t, e) for t, e in self.client.event_log]
        asked = [t for t in self.asked if a <= t < b]
        transcripts = sorted(s for s, e in log if e.get("type") == "speech.transcript" and e.get("text"))
        answered, used = 0, 0.0
        for t in asked:
            match = next((s for s in transcripts if s > max(t, used) and s <= t + grace_s), None)
            if match is not None:
                answered += 1
                used = match
        errors: dict = {}
        end = (asked and max(asked) + grace_s) or b
        for s, e in log:
            if a <= s <= max(b, end) and e.get("type") == "error":
                errors[e.get("code")] = errors.get(e.get("code"), 0) + 1
        return {"asked": len(asked), "answered": answered, "errors": errors}


async def measure(args, python: str = sys.executable) -> dict:
    import aiohttp

    from voxgate.rtc_client import RtcClient
    from tests.security.rtp_flood import connected
    from tests.transcripts import QUESTIONS, STT_VOICES, turn_audio

    questions = [turn_audio(q, STT_VOICES[i % len(STT_VOICES)], 48000) for i, q in enumerate(QUESTIONS[:6])]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [python, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1", "--engine", "tone",
         "--stt", "pocketsphinx", "--log-level", "WARNING", "--no-web", "--connect-timeout-s", "3600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/", preexec_fn=_normal_priority)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    results: dict = {"what": "innocent callers' questions answered (speech.transcript) while one caller sends loud "
                             "noise faster than real time; --stt pocketsphinx (2 slots), tone engine, loopback",
                     "callers": args.callers, "every_s": args.every, "window_s": args.window, "speed": args.speed,
                     "burst_s": args.burst}
    attack = None
    clients: list = []
    tasks: list = []
    try:
        await asyncio.get_running_loop().run_in_executor(None, wait_ready, url)
        for _ in range(args.callers):  # a busy shared machine's admission may refuse for a while: tried again
            clients.append(await connected(lambda: RtcClient(url, mic=True), 30))
        attack = await asyncio.create_subprocess_exec(
            sys.executable, os.path.abspath(__file__), "--attacker", url, "--speed", str(args.speed),
            "--burst", str(args.burst), "--window", str(args.window),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        line = await asyncio.wait_for(attack.stdout.readline(), 60)
        assert line.strip() == b"READY", line
        callers = [Caller(c, questions[i::args.callers] or questions, args.every) for i, c in enumerate(clients)]
        tasks = [asyncio.ensure_future(c.run()) for c in callers]
        await asyncio.sleep(2.0)
        async with aiohttp.ClientSession() as http:

            async def snapshot() -> dict:
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                return {"t": time.perf_counter(), "cpu_s": proc_cpu_s(server.pid),
                        "turns": {o: metric(text, "voxgate_stt_turns_total", f'outcome="{o}"') for o in OUTCOMES},
                        "dropped": {r: metric(text, "voxgate_mic_dropped_total", f'reason="{r}"') for r in DROP_REASONS},
                        "late": metric(text, "voxgate_pacer_late_frames_total"),
                        "frames": metric(text, "voxgate_pacer_departure_jitter_seconds_count")}

            spans = {}
            for name in WINDOWS:
                a = await snapshot()
                if name == "baseline":
                    await asyncio.sleep(args.window)
                else:
                    attack.stdin.write(b"noise\n")
                    await attack.stdin.drain()
                    done = await asyncio.wait_for(attack.stdout.readline(), args.window + 120)
                    assert done.startswith(b"DONE"), done
                    results["attacker_sent"] = json.loads(done.split(b" ", 1)[1])
                b = await snapshot()
                spans[name] = (a, b)
            for task in tasks:
                task.cancel()
            await asyncio.sleep(args.grace)  # the last questions' answers, and any late errors
            section("windows")
            for name in WINDOWS:
                a, b = spans[name]
                per_caller = [c.tally(a["t"], b["t"], args.grace) for c in callers]
                asked = sum(p["asked"] for p in per_caller)
                answered = sum(p["answered"] for p in per_caller)
                errors: dict = {}
                for p in per_caller:
                    for code, count in p["errors"].items():
                        errors[code] = errors.get(code, 0) + count
                row = results[name] = {
                    "window_s": round(b["t"] - a["t"], 1), "asked": asked, "answered": answered,
                    "innocent_errors": errors, "per_caller": per_caller,
                    "server_turns": {o: int(b["turns"][o] - a["turns"][o]) for o in OUTCOMES},
                    "mic_dropped": {r: int(b["dropped"][r] - a["dropped"][r]) for r in DROP_REASONS},
                    "server_cpu_pct": round(100 * (b["cpu_s"] - a["cpu_s"]) / (b["t"] - a["t"]), 1),
                    "late_fraction": round((b["late"] - a["late"]) / max(1.0, b["frames"] - a["frames"]), 5)}
                print(f"{name:9s} answered {answered}/{asked}  innocent errors {errors}  server turns "
                      f"{row['server_turns']}  dropped {row['mic_dropped']}  cpu {row['server_cpu_pct']} %", flush=True)
        attack.stdin.write(b"quit\n")
        await attack.stdin.drain()
    finally:
        for task in tasks:
            task.cancel()
        for client in clients:
            await client.close()
        if attack is not None and attack.returncode is None:
            attack.kill()
            await attack.wait()
        stop_server(server)
    return results


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--callers", type=int, default=2)
    parser.add_argument("--every", type=float, default=6.0, help="seconds between one caller's questions")
    parser.add_argument("--window", type=float, default=60.0, help="seconds per window")
    parser.add_argument("--speed", type=float, default=15.0, help="the noise, times real time")
    parser.add_argument("--burst", type=float, default=4.0, help="seconds of each burst of noise")
    parser.add_argument("--grace", type=float, default=12.0,
                        help="seconds a question's answer may take (past --stt-timeout-s 10 and the question itself)")
    parser.add_argument("--before-python", metavar="PYTHON",
                        help="then run the same against a server started with this interpreter (the code before "
                        "the fix), as before_fix in the JSON")
    parser.add_argument("--attacker", metavar="URL", help=__import__("argparse").SUPPRESS)
    args = parser.parse_args()
    if args.attacker:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        asyncio.run(attacker(args.attacker, args.speed, args.burst, args.window))
        return 0
    if args.quick:
        args.window = 20.0
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results = asyncio.run(measure(args))
    if args.before_python:
        section(f"the same, against the code before the fix ({args.before_python})")
        before = asyncio.run(measure(args, args.before_python))
        results["before_fix"] = {k: before[k] for k in WINDOWS}
    results["machine"] = info
    finish("noise-turns", results, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
