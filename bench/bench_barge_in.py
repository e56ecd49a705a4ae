"""Barge-in against the bot's own echo, real interruptions, backchannels and a quiet room (issue 40).

    python bench/bench_barge_in.py                 # about 6 minutes on 2 cores
    python bench/bench_barge_in.py --quick         # a few trials of each
    python bench/bench_barge_in.py --server-arg=--no-echo-cancel   # the same without the canceller
    python bench/bench_barge_in.py --baseline-arg=--no-echo-cancel --min-interrupt-ms 400
        # quiet-room interruptions against a second gateway with the VAD alone, interleaved in
        # the same run, and the backchannel policy at 400 ms beside the default

What runs: a gateway process with the embedded voice (Piper joe) on loopback,
and real aiortc clients in this process, each one session over UDP. A client's
microphone is a room (tests/listening_corpus.py): its loudspeaker plays what
the client decoded of the bot's speech, and the microphone hears that back
`delay` ms later at the echo level, over faint room noise, plus whatever
caller is played into it (espeak-ng voices, never the bot's).

- echo: the bot speaks two long replies per session, back to back, while the
  microphone hears only its echo (delays cycled over 50-300 ms). A false
  barge-in is an `utterance.interrupted` or `speech.started` while the bot
  speaks. The first reply of each session meets a canceller that has learned
  nothing yet.
- interrupt: the bot speaks; 1.5-3 s in, a caller says an interruption over
  the echo (-10 dB) or in a quiet room (no echo). The figure is from the
  caller's speech onset (its first sample within 30 dB of its loudest, as the
  client's microphone sent it) to the client receiving `utterance.interrupted`,
  on the client's clock: measured at the client, with the real voice.
- backchannel: the same with a one-word backchannel ("Okay.", "Mm-hmm."...).
- background: music and room noise in the room while the bot speaks, no echo.
- twilio: the echo (-20, -10 and -6 dB), real interruptions over -10 dB echo and
  backchannels in a quiet room, over the Twilio media-stream path: a backend
  WebSocket speaks, a Twilio stand-in (tests/telephony/twilio_standin.py) is
  the call, its line the phone's loudspeaker heard back (SpeakerPhone: what
  it received, played at 20 ms a frame, `delay` later at the echo level, over
  faint room noise, μ-law 8 kHz). The figure is from the caller's onset as the
  line sent it to the `clear` reaching the phone, on the stand-in's clock; its
  ratio to the WebRTC arm's p50 over -10 dB echo is from the same run.

- quiet_room_baseline (with --baseline-arg): the quiet-room interruptions
  again, the same clips, against a second gateway started with those flags
  (--no-echo-cancel: the VAD alone, as before the echo work), each pair of
  trials run side by side so both arms see the same machine.

All sessions run at the server's defaults unless --server-arg says otherwise;
--min-interrupt-ms runs the interruption and backchannel trials again with
that per-session setting (session.update), for the policy's trade-off curve.
Figures go to stdout and to artifacts/bench-barge-in.json (--out).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from _common import ARTIFACTS, arg_parser, finish, free_port, machine, print_machine, section, summary_ci_ms, wait_ready  # noqa: E402

from tests import listening_corpus as corpus  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "telephony"))
import soxr  # noqa: E402
from twilio_standin import SpeakerPhone, TwilioStandIn  # noqa: E402

from voxgate.client import VoxgateSession  # noqa: E402
from voxgate.rtc_client import OfferRefused  # noqa: E402

DELAYS_MS = (50, 100, 150, 200, 250, 300)
ECHO_LEVELS_DB = (-20.0, -10.0, -6.0)
TWILIO_ECHO_LEVELS_DB = ECHO_LEVELS_DB  # the same checks as WebRTC (issue 40)
QUIET_ROOM_DBFS = -60.0  # faint room noise under every trial
BARGE_EVENTS = ("utterance.interrupted", "speech.started")
CAPACITY_RETRIES = 30
CAPACITY_RETRY_S = 2.0


class Trials:
    def __init__(self, url: str, concurrency: int, session_update: dict | None = None) -> None:
        self.url = url
        self.gate = asyncio.Semaphore(concurrency)
        self.session_update = session_update
        self.refused = 0  # offers refused at_capacity and tried again

    async def _client(self, echo_db: float | None, delay_ms: int, background: np.ndarray | None = None):
        # A full node refuses new sessions (503 at_capacity: this bench's own clients share its two
        # cores); a client then tries again later, as a real one would. Each wait is counted.
        for attempt in range(CAPACITY_RETRIES + 1):
            client = corpus.echo_client(self.url, echo_db=echo_db, delay_ms=delay_ms, background=background)
            try:
                await client.connect()
                break
            except OfferRefused as exc:
                await client.close()
                if exc.code != "at_capacity" or attempt == CAPACITY_RETRIES:
                    raise
                self.refused += 1
                await asyncio.sleep(CAPACITY_RETRY_S)
        if self.session_update:
            client.send({"type": "session.update", **self.session_update})
            await client.wait_for("session.updated", timeout=10)
        return client

    async def echo(self, echo_db: float, delay_ms: int, seed: int) -> list[dict]:
        """Two replies while the microphone hears only their echo: one row per reply."""
        async with self.gate:
            noise = corpus.room_noise(4.0, QUIET_ROOM_DBFS, seed)
            client = await self._client(echo_db, delay_ms, noise)
            rows = []
            try:
                for k in range(2):
                    reply = corpus.BOT_REPLIES[(seed + k) % len(corpus.BOT_REPLIES)]
                    uid = f"r{k}"
                    mark = len(client.event_log)
                    client.send({"type": "speak", "text": reply, "id": uid})
                    end = await client.wait_for_any(("utterance.done", "utterance.interrupted"), timeout=60)
                    while end.get("id") != uid:
                        end = await client.wait_for_any(("utterance.done", "utterance.interrupted"), timeout=60)
                    seen = [e for _, e in client.event_log[mark:]]
                    rows.append({
                        "echo_db": echo_db, "delay_ms": delay_ms, "reply": k, "cold": k == 0,
                        "false_barge_in": end["type"] == "utterance.interrupted" or any(e["type"] == "speech.started" for e in seen),
                        "interrupted": end["type"] == "utterance.interrupted",
                        "audio_ms": end.get("audio_ms", end.get("played_ms")), "session_id": client.session_id,
                    })
                    # Let the echo of its end die away before the next reply.
                    await client.wait_frames_after(end, 25, timeout=10)
            finally:
                await client.close()
            return rows

    async def caller(self, clip: np.ndarray, echo_db: float | None, delay_ms: int, seed: int, *,
                     background: np.ndarray | None = None, after_ms: int = 0) -> dict:
        """The bot speaks; `after_ms` (1.5-3 s by seed) into its audio, `clip` plays into the microphone."""
        async with self.gate:
            bg = background if background is not None else corpus.room_noise(4.0, QUIET_ROOM_DBFS, seed)
            client = await self._client(echo_db, delay_ms, bg)
            try:
                reply = corpus.BOT_REPLIES[seed % len(corpus.BOT_REPLIES)]
                client.send({"type": "speak", "text": reply, "id": "talk"})
                started = await client.wait_for("audio.started", id="talk", timeout=30)
                after_ms = after_ms or 1500 + (seed * 277) % 1500
                await client.wait_frames_after(started, after_ms // 20, timeout=20)
                early = [e for _, e in client.event_log if e["type"] in BARGE_EVENTS]
                if early:  # the bot already stopped (its own echo): nothing left to interrupt
                    return {"echo_db": echo_db, "delay_ms": delay_ms, "early_barge_in": True, "interrupted": False,
                            "latency_ms": None, "backchannel_events": 0, "session_id": client.session_id}
                index = client.mic.play(clip)
                end = await client.wait_for_any(("utterance.done", "utterance.interrupted"), timeout=60)
                # Everything the caller's turn produced, up to its speech.stopped (or 3 s after the end).
                try:
                    await client.wait_for("speech.stopped", timeout=3)
                except asyncio.TimeoutError:
                    pass
                played_at = client.mic.played_at[index]
                early = played_at is None or client.arrival(end) < played_at
                onset = (played_at or 0.0) + corpus.onset_s(clip)
                row = {
                    "echo_db": echo_db, "delay_ms": delay_ms, "early_barge_in": early,
                    "interrupted": end["type"] == "utterance.interrupted",
                    "latency_ms": round((client.arrival(end) - onset) * 1000, 1)
                    if end["type"] == "utterance.interrupted" and not early else None,
                    "backchannel_events": sum(1 for _, e in client.event_log if e["type"] == "speech.backchannel"),
                    "session_id": client.session_id,
                }
            finally:
                await client.close()
            return row

    async def background(self, kind: str, seed: int) -> dict:
        """Music or room noise in the room while the bot speaks a reply; no echo."""
        async with self.gate:
            if kind == "music":
                bg = corpus.music(8.0, -30.0, seed)
            else:
                bg = corpus.room_noise(8.0, -35.0, seed)
            client = await self._client(None, 0, bg)
            try:
                reply = corpus.BOT_REPLIES[seed % len(corpus.BOT_REPLIES)]
                client.send({"type": "speak", "text": reply, "id": "talk"})
                end = await client.wait_for_any(("utterance.done", "utterance.interrupted"), timeout=60)
                seen = [e["type"] for _, e in client.event_log]
                return {"kind": kind, "false_barge_in": end["type"] == "utterance.interrupted" or "speech.started" in seen}
            finally:
                await client.close()


def to_phone(pcm: np.ndarray) -> np.ndarray:
    """48 kHz corpus audio as the phone's 8 kHz line carries it."""
    return soxr.resample(pcm.astype(np.float32), corpus.RATE, 8000).astype(np.int16)


async def next_event(events, kinds: tuple[str, ...], uid: str | None = None) -> dict:
    async for event in events:
        if event["type"] in kinds and (uid is None or event.get("id") == uid):
            return event
    raise RuntimeError("the session closed")


class TwilioTrials:
    """The same trials over the Twilio path: a backend WebSocket speaks, a Twilio stand-in (tests/telephony)
    is the call, its line the phone's loudspeaker heard back by its microphone (SpeakerPhone)."""

    def __init__(self, url: str, concurrency: int, gate: asyncio.Semaphore | None = None) -> None:
        self.url = url
        self.gate = gate or asyncio.Semaphore(concurrency)

    async def _call(self, echo_db: float | None, delay_ms: int, seed: int):
        backend = VoxgateSession(self.url)
        await backend.open()
        phone = TwilioStandIn(self.url)
        await phone.connect()
        await phone.start({"session_id": backend.session_id, "token": backend.client_token})
        await backend.wait_for("call.started")
        line = SpeakerPhone(phone, echo_db=echo_db, delay_frames=delay_ms // 20,
                            background=to_phone(corpus.room_noise(4.0, QUIET_ROOM_DBFS, seed)).astype(np.float64))
        return backend, phone, line

    @staticmethod
    async def _hang_up(backend, phone, line) -> None:
        line.task.cancel()
        await phone.close()
        await backend.close()

    async def echo(self, echo_db: float, delay_ms: int, seed: int) -> list[dict]:
        async with self.gate:
            backend, phone, line = await self._call(echo_db, delay_ms, seed)
            rows = []
            try:
                for k in range(2):
                    mark = len(backend.history)
                    outcome = await backend.say(corpus.BOT_REPLIES[(seed + k) % len(corpus.BOT_REPLIES)])
                    seen = [e["type"] for e in backend.history[mark:]]
                    rows.append({"echo_db": echo_db, "delay_ms": delay_ms, "reply": k, "cold": k == 0,
                                 "false_barge_in": outcome.interrupted or "speech.started" in seen,
                                 "interrupted": outcome.interrupted, "session_id": backend.session_id})
                    # Let the phone play what it has and the echo of its end die away.
                    await phone.wait(lambda: line.played >= len(phone.received.media), timeout=30)
                    await asyncio.sleep((delay_ms + 500) / 1000)
            finally:
                await self._hang_up(backend, phone, line)
            return rows

    async def caller(self, clip: np.ndarray, echo_db: float | None, delay_ms: int, seed: int) -> dict:
        """The bot speaks; 1.5-3 s of its audio into the call, `clip` goes down the line. The figure is
        from the clip's onset as the line sent it to the `clear` reaching the phone."""
        async with self.gate:
            backend, phone, line = await self._call(echo_db, delay_ms, seed)
            try:
                uid = await backend.say(corpus.BOT_REPLIES[seed % len(corpus.BOT_REPLIES)], wait=False)
                after = (1500 + (seed * 277) % 1500) // 20
                # Or a barge-in on the echo before the caller speaks: the bot stops short of `after`,
                # and the trial counts as spoiled (it stopped the whole bench before).
                early_barge = lambda: any(e["type"] in BARGE_EVENTS for e in backend.history)
                await phone.wait(lambda: len(phone.received.media) >= after or early_barge(), timeout=30)
                early = early_barge()
                if early:
                    return {"echo_db": echo_db, "delay_ms": delay_ms, "early_barge_in": True, "interrupted": False,
                            "latency_ms": None, "backchannel_events": 0, "session_id": backend.session_id}
                events = backend.events()
                line.say(clip)
                end = await asyncio.wait_for(next_event(events, ("utterance.done", "utterance.interrupted"), uid), 60)
                try:  # everything the caller's turn produced, up to its speech.stopped (or 3 s after the end)
                    await asyncio.wait_for(next_event(events, ("speech.stopped",)), 3)
                except asyncio.TimeoutError:
                    pass
                await events.aclose()
                interrupted = end["type"] == "utterance.interrupted"
                latency = None
                if interrupted and phone.received.clears and line.caller_at is not None:
                    latency = round((phone.received.clears[0] - line.caller_at - corpus.onset_s(clip, 8000)) * 1000, 1)
                return {"echo_db": echo_db, "delay_ms": delay_ms, "early_barge_in": latency is not None and latency < 0,
                        "interrupted": interrupted, "latency_ms": latency if latency is None or latency >= 0 else None,
                        "backchannel_events": sum(1 for e in backend.history if e["type"] == "speech.backchannel"),
                        "session_id": backend.session_id}
            finally:
                await self._hang_up(backend, phone, line)


def clips(kind: str, n: int) -> list[tuple[str, str, np.ndarray]]:
    texts = corpus.INTERRUPTIONS if kind == "interrupt" else corpus.BACKCHANNELS
    out = []
    for i in range(n):
        text, voice = texts[i % len(texts)], corpus.CALLER_VOICES[i % len(corpus.CALLER_VOICES)]
        out.append((text, voice, corpus.espeak(text, voice)))
    return out


def interrupt_summary(rows: list[dict]) -> dict:
    valid = [r for r in rows if not r["early_barge_in"]]
    lat = [r["latency_ms"] / 1000 for r in valid if r["latency_ms"] is not None]
    return {
        "trials": len(rows), "spoiled_by_early_barge_in": len(rows) - len(valid),
        "detected": sum(r["interrupted"] for r in valid), "missed": sum(not r["interrupted"] for r in valid),
        "latency_ms": summary_ci_ms(lat),
        "backchannel_events": sum(r["backchannel_events"] for r in valid),
    }


async def run(args, url: str, baseline_url: str | None = None) -> dict:
    out: dict = {"server_args": args.server_arg, "baseline_args": args.baseline_arg}
    trials = Trials(url, args.concurrency)
    sessions = max(1, args.utterances // 2)

    section(f"echo only: {sessions} sessions x 2 replies per level")
    out["echo"] = {}
    for level in ECHO_LEVELS_DB if "echo" in args.only else ():
        jobs = [trials.echo(level, DELAYS_MS[i % len(DELAYS_MS)], i) for i in range(sessions)]
        rows = [r for rs in await asyncio.gather(*jobs) for r in rs]
        false = sum(r["false_barge_in"] for r in rows)
        out["echo"][str(int(level))] = {
            "utterances": len(rows), "false_barge_ins": false,
            "false_on_cold": sum(r["false_barge_in"] for r in rows if r["cold"]),
            "rows": rows,
        }
        print(f"echo {level:+.0f} dB: {false} false barge-ins over {len(rows)} bot utterances "
              f"({sum(r['false_barge_in'] for r in rows if r['cold'])} on a cold first reply)", flush=True)

    async def callers(kind: str, echo_db: float | None, n: int, t: Trials) -> list[dict]:
        picked = clips(kind, n)
        jobs = [t.caller(pcm, echo_db, DELAYS_MS[i % len(DELAYS_MS)], i) for i, (_, _, pcm) in enumerate(picked)]
        return [{**row, "clip": f"{text} ({voice})"} for row, (text, voice, _) in zip(await asyncio.gather(*jobs), picked)]

    section("caller interruptions")
    out["interrupt"] = {}
    for name, echo_db in (("echo_-10", -10.0), ("quiet_room", None)) if "interrupt" in args.only else ():
        if name == "quiet_room" and baseline_url:
            # The same clips against both gateways, each pair side by side (one gate for both).
            base = Trials(baseline_url, args.concurrency)
            base.gate = trials.gate
            pairs = clips("interrupt", args.interruptions)
            jobs = [t.caller(pcm, None, DELAYS_MS[i % len(DELAYS_MS)], i)
                    for i, (_, _, pcm) in enumerate(pairs) for t in (trials, base)]
            both = list(await asyncio.gather(*jobs))
            rows, base_rows = both[0::2], both[1::2]
            out["interrupt"]["quiet_room_baseline"] = {**interrupt_summary(base_rows), "rows": base_rows}
            b = out["interrupt"]["quiet_room_baseline"]
            print(f"quiet_room_baseline ({' '.join(args.baseline_arg)}): detected {b['detected']}/"
                  f"{b['trials'] - b['spoiled_by_early_barge_in']}, p50 {b['latency_ms'].get('p50')} ms "
                  f"(p95 {b['latency_ms'].get('p95')})", flush=True)
        else:
            rows = await callers("interrupt", echo_db, args.interruptions, trials)
        out["interrupt"][name] = {**interrupt_summary(rows), "rows": rows}
        s = out["interrupt"][name]
        print(f"{name}: detected {s['detected']}/{s['trials'] - s['spoiled_by_early_barge_in']}, "
              f"onset to utterance.interrupted p50 {s['latency_ms'].get('p50')} ms "
              f"(p95 {s['latency_ms'].get('p95')}; spoiled by an earlier barge-in: {s['spoiled_by_early_barge_in']})", flush=True)
        for row in rows:
            if not row["interrupted"] and not row["early_barge_in"]:
                print(f"  missed: {row.get('clip', '?')} at {row['delay_ms']} ms", flush=True)

    if "quiet_room_baseline" in out["interrupt"]:
        a = out["interrupt"]["quiet_room"]["latency_ms"].get("p50")
        b = out["interrupt"]["quiet_room_baseline"]["latency_ms"].get("p50")
        if a is not None and b is not None:
            out["interrupt"]["quiet_room_p50_minus_baseline_ms"] = round(a - b, 1)
            print(f"quiet room: p50 {a} ms against {b} ms for the baseline in the same run ({a - b:+.1f} ms)", flush=True)

    section("backchannels (quiet room)")
    rows = await callers("backchannel", None, args.backchannels if "backchannel" in args.only else 0, trials)
    out["backchannel"] = {**interrupt_summary(rows), "rows": rows}
    s = out["backchannel"]
    print(f"backchannels: {s['detected']} of {s['trials'] - s['spoiled_by_early_barge_in']} interrupted the bot; "
          f"speech.backchannel events {s['backchannel_events']}", flush=True)

    section("music and room noise, no echo")
    jobs = [trials.background(kind, i) for i in range(args.backgrounds if "background" in args.only else 0)
            for kind in ("music", "noise")]
    rows = list(await asyncio.gather(*jobs))
    out["background"] = {kind: sum(r["false_barge_in"] for r in rows if r["kind"] == kind) for kind in ("music", "noise")}
    out["background"]["trials_each"] = args.backgrounds
    if rows:
        print(f"false barge-ins: music {out['background']['music']}/{args.backgrounds}, "
              f"room noise {out['background']['noise']}/{args.backgrounds}", flush=True)

    if "twilio" in args.only:
        section("the Twilio path: echo, interruptions over -10 dB echo, backchannels (a Twilio stand-in's line)")
        phone = TwilioTrials(url, args.concurrency)
        tw: dict = {"echo": {}}
        calls = max(1, args.twilio_trials // 2)
        for level in TWILIO_ECHO_LEVELS_DB:
            jobs = [phone.echo(level, DELAYS_MS[i % len(DELAYS_MS)], i) for i in range(calls)]
            rows = [r for rs in await asyncio.gather(*jobs) for r in rs]
            tw["echo"][str(int(level))] = {"utterances": len(rows), "false_barge_ins": sum(r["false_barge_in"] for r in rows),
                                           "false_on_cold": sum(r["false_barge_in"] for r in rows if r["cold"]), "rows": rows}
            print(f"twilio echo {level:+.0f} dB: {tw['echo'][str(int(level))]['false_barge_ins']} false barge-ins over "
                  f"{len(rows)} bot utterances", flush=True)
        for name, kind, echo_db in (("interrupt_echo_-10", "interrupt", -10.0), ("backchannel", "backchannel", None)):
            n = args.twilio_trials if kind == "interrupt" else args.twilio_backchannels
            jobs = [phone.caller(to_phone(pcm), echo_db, DELAYS_MS[i % len(DELAYS_MS)], i)
                    for i, (_, _, pcm) in enumerate(clips(kind, n))]
            rows = list(await asyncio.gather(*jobs))
            tw[name] = {**interrupt_summary(rows), "rows": rows}
            t = tw[name]
            print(f"twilio {name}: {t['detected']} of {t['trials'] - t['spoiled_by_early_barge_in']} interrupted the bot, "
                  f"onset to the phone's clear p50 {t['latency_ms'].get('p50')} ms (p95 {t['latency_ms'].get('p95')}); "
                  f"speech.backchannel events {t['backchannel_events']}", flush=True)
        webrtc = out.get("interrupt", {}).get("echo_-10", {}).get("latency_ms", {}).get("p50")
        twilio = tw["interrupt_echo_-10"]["latency_ms"].get("p50")
        if webrtc and twilio:
            tw["interrupt_p50_over_webrtc"] = round(twilio / webrtc, 2)
            print(f"twilio over -10 dB echo: p50 {twilio} ms, {twilio / webrtc:.2f}x the WebRTC arm's {webrtc} ms "
                  "in the same run", flush=True)
        out["twilio"] = tw

    if args.min_interrupt_ms and "policy" in args.only:
        section("the backchannel policy's trade-off (per-session min_interrupt_ms)")
        out["policy"] = {}
        for value in args.min_interrupt_ms:
            t = Trials(url, args.concurrency, {"barge_in": {"min_interrupt_ms": value}})
            real = interrupt_summary(await callers("interrupt", -10.0, args.policy_trials, t))
            back = interrupt_summary(await callers("backchannel", -10.0, args.policy_trials, t))
            out["policy"][str(value)] = {"interrupt_echo_-10": real, "backchannel_echo_-10": back}
            out["policy"][str(value)]["backchannels_interrupting"] = f"{back['detected']}/{back['trials'] - back['spoiled_by_early_barge_in']}"
            print(f"min_interrupt_ms {value}: real interruptions p50 {real['latency_ms'].get('p50')} ms "
                  f"({real['detected']}/{real['trials']} detected); backchannels that interrupted "
                  f"{back['detected']}/{back['trials']}", flush=True)
    out["offers_refused_at_capacity_and_retried"] = trials.refused
    return out


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--utterances", type=int, default=20, help="bot utterances per echo level (two per session)")
    parser.add_argument("--interruptions", type=int, default=20, help="real interruptions per condition")
    parser.add_argument("--backchannels", type=int, default=12, help="backchannel trials")
    parser.add_argument("--backgrounds", type=int, default=4, help="music and noise trials each")
    parser.add_argument("--concurrency", type=int, default=3, help="sessions at once")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra flag for the gateway (repeatable)")
    parser.add_argument("--baseline-arg", action="append", default=[],
                        help="start a second gateway with this flag (repeatable) and run the quiet-room "
                             "interruptions against it too, in the same run")
    parser.add_argument("--min-interrupt-ms", type=int, action="append", default=[],
                        help="also measure the backchannel trade-off at this per-session setting (repeatable)")
    parser.add_argument("--policy-trials", type=int, default=12, help="trials of each kind per --min-interrupt-ms value")
    parser.add_argument("--twilio-trials", type=int, default=20,
                        help="Twilio arm: bot utterances per echo level, and real interruptions over -10 dB echo")
    parser.add_argument("--twilio-backchannels", type=int, default=6, help="Twilio arm: backchannel trials")
    parser.add_argument("--only", default="echo,interrupt,backchannel,background,twilio,policy",
                        help="comma-separated sections to run")
    args = parser.parse_args()
    args.only = set(args.only.split(","))
    if args.quick:
        args.utterances, args.interruptions, args.backchannels, args.backgrounds, args.policy_trials = 4, 4, 4, 1, 4
        args.twilio_trials, args.twilio_backchannels = 4, 2
    started = time.perf_counter()
    port = free_port()
    os.makedirs(ARTIFACTS, exist_ok=True)
    log_path = os.path.join(ARTIFACTS, f"bench-barge-in-server-{port}.log")
    cmd = [sys.executable, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1",
           "--engine", "piper", "--no-web", *args.server_arg]
    baseline = None
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            baseline_url = None
            if args.baseline_arg:
                bport = free_port()
                bcmd = [*cmd[:cmd.index("--port") + 1], str(bport), *cmd[cmd.index("--port") + 2:len(cmd) - len(args.server_arg)],
                        *args.baseline_arg]
                baseline = subprocess.Popen(bcmd, stdout=log, stderr=subprocess.STDOUT)
                baseline_url = f"http://127.0.0.1:{bport}"
            wait_ready(url)
            if baseline_url:
                wait_ready(baseline_url)
            info = machine(exclude={server.pid, os.getpid(), *([baseline.pid] if baseline else [])})
            print_machine(info, "machine")
            results = {"machine": info, "args": vars(args), "label": "barge-in: client clock (onset as the client's "
                       "microphone sent it, to the event's arrival), gateway with the real voice (Piper joe), "
                       "normal priority, loopback"}
            results.update(asyncio.run(run(args, url, baseline_url)))
        finally:
            for proc in (server, baseline):
                if proc is not None:
                    proc.terminate()
                    proc.wait(20)
    finish("barge-in", results, started, args.out)


if __name__ == "__main__":
    main()
