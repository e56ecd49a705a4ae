"""The conversation loop (issue 54): voice to voice, transcript arrival and WER, over WebRTC.

    python bench/bench_conversation.py --out bench/results/conversation.json
    python bench/bench_conversation.py --conversations 1 --turns 8    # shorter

A gateway process (`voxgate serve --engine piper --stt whisper`, defaults
otherwise: the real voice, the turn rule of gateway/caller/endpoint.py) serves
conversations. Each has a backend on the session WebSocket that answers like an
LLM that takes no time: the moment a final `speech.transcript` arrives it sends
`speak` with a short reply. A real aiortc client's microphone (Opus, in real
time) says the caller's turns: espeak-ng questions in 8 voices, and sentences
with a 600 ms pause inside them ("I'd like to book ... a table for two.",
espeak-ng's SSML break, so the intonation runs on). After each reply has played,
the next turn follows.

Measured at the client, per turn, from the caller's last voiced sample (when
its frame was due at the microphone):
- voice to voice: to the reply's first voiced frame received (RMS over 300);
- transcript: to the final `speech.transcript` at the backend (same process,
  same clock);
- answered early: the final transcript came before the caller's last voiced
  sample (a pause taken for the end);
- WER of the turn's final transcripts (all of them, joined) against the phrase,
  and the same recognizer offline on the whole turn as the microphone had it
  (before Opus): the reference for what the path loses.
Run at 1 and at 4 conversations at once (each its own client and backend, the
turns in the same order, offset), and over the phone path (--phone): a Twilio
media stream (tests/telephony/twilio_standin.py) says the same turns as μ-law
at 8 kHz in real time, then streams silence as a call does; its WER is
against the recognizer offline on each whole turn as the phone sent it (μ-law,
raised to 16 kHz), and voice to voice ends at the reply's first voiced μ-law
frame as it reached the stand-in. Per turn the server's debug log adds the rule
that ended it (gateway/caller/endpoint.py), its decode and the silence waited.
Figures go to stdout and to artifacts/bench-conversation.json (--out).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import soxr  # noqa: E402
from _common import arg_parser, finish, machine, percentile, print_machine, section  # noqa: E402

from tests.backend.test_transcripts import RecordingMic  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402
from tests.listening_corpus import CALLER_VOICES, espeak  # noqa: E402
from tests.transcripts import QUESTIONS, corpus_wer, espeak_paused  # noqa: E402
from voxgate.client import VoxgateSession  # noqa: E402
from voxgate.rtc_client import RtcClient  # noqa: E402

REPLY = "Sure, I can help with that."
PAUSE_MS = 600
# Sentences with a pause inside: the first half does not end the sentence.
PAUSED = (
    ("I'd like to book", "a table for two tonight."),
    ("Can you tell me", "when the store opens tomorrow?"),
    ("I need to change", "the address on my account."),
    ("My order was", "never delivered to my house."),
    ("Is there a pharmacy", "near the train station?"),
    ("I want to cancel", "my appointment on Friday."),
    ("Could you send", "the receipt to my email address?"),
    ("I would like to check", "the status of my order."),
)
LEAD_S = 0.4  # silence before a turn
VOICED = 300.0  # RMS of a voiced 20 ms frame, at either end


def turns(n: int) -> list[tuple[str, str, np.ndarray, bool]]:
    """(phrase, voice, 48 kHz clip, has a pause), alternating plain and paused, over the 8 voices."""
    out = []
    for i in range(n):
        voice = CALLER_VOICES[i % len(CALLER_VOICES)]
        if i % 2:
            first, second = PAUSED[(i // 2) % len(PAUSED)]
            out.append((f"{first} {second}", voice, espeak_paused(first, second, voice, 48000, PAUSE_MS), True))
        else:
            phrase = QUESTIONS[(i // 2) % len(QUESTIONS)]
            out.append((phrase, voice, espeak(phrase, voice, 48000), False))
    return out


def last_voiced_s(clip: np.ndarray, rate: int = 48000) -> float:
    """Where the clip's last voiced 20 ms frame ends, in seconds."""
    hop = rate // 50
    n = len(clip) // hop
    rms = np.sqrt(np.mean(clip[: n * hop].astype(np.float64).reshape(n, hop) ** 2, axis=1))
    return float((np.flatnonzero(rms > VOICED)[-1] + 1) * hop) / rate


@contextlib.asynccontextmanager
async def caller(url: str, session_id: str, token: str | None) -> AsyncIterator[RtcClient]:
    """The caller: an aiortc client on the session whose microphone (a RecordingMic) says the turns, connected
    until the block ends (bench/bench_relay.py's v2v arm calls with it too)."""
    client = RtcClient(url, mic=True, session_id=session_id, token=token)
    client.mic = RecordingMic()
    try:
        await client.connect()
        yield client
    finally:
        await client.close()


async def say_turn(client: RtcClient, clip: np.ndarray, final_at: Callable[[], float | None]) -> tuple[float, float, float | None]:
    """One caller turn on `client`'s microphone (a RecordingMic): LEAD_S of silence, then the 48 kHz clip, in real
    time; then the reply, heard at the client: its first voiced frame after both the caller's last voiced sample
    and the turn's first final (`final_at()`: when it came, None until it has), then its end. bench/bench_relay.py's
    v2v arm says its turns with this too. Returns (when the turn's first frame was due, when its last voiced sample
    was, the reply's first voiced frame or None)."""
    first = len(client.mic.sent)
    client.mic.play(np.concatenate([np.zeros(int(LEAD_S * 48000), np.int16), clip]))
    while len(client.mic.due) <= first:
        await asyncio.sleep(0.01)
    started = client.mic.due[first]
    spoke_until = started + LEAD_S + last_voiced_s(clip)
    deadline = time.perf_counter() + 15
    reply_at = None
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
        final = final_at()
        if final is not None:
            # The reply to this turn's final: no sound before the final arrived can be it (an earlier
            # reply still playing on a loaded machine is not).
            reply_at = client.audio.first_sound_after(max(spoke_until, final), VOICED)
            if reply_at is not None and time.perf_counter() > reply_at + 2.0:
                break
    await asyncio.sleep(0.8)  # the reply's end, and a breath
    return started, spoke_until, reply_at


async def conversation(url: str, plan: list, offset_s: float, server: ServerProcess | None = None) -> list[dict]:
    await asyncio.sleep(offset_s)
    backend = VoxgateSession(url)
    await backend.open()
    finals: list[tuple[float, dict]] = []
    partials: list[float] = []

    async def answer() -> None:
        async for event in backend.events():
            if event.get("type") == "speech.transcript":
                if event.get("final"):
                    finals.append((time.perf_counter(), event))
                    await backend.send({"type": "speak", "text": REPLY})
                else:
                    partials.append(time.perf_counter())

    answering = asyncio.ensure_future(answer())
    out = []
    try:
        async with caller(url, backend.session_id, backend.client_token) as client:
            for phrase, voice, clip, paused in plan:
                before = len(finals)
                started, spoke_until, reply_at = await say_turn(
                    client, clip, lambda: finals[before][0] if len(finals) > before else None)
                mine = finals[before:]
                ended = _turn_ended(server, mine[-1][1]) if mine and server is not None else {}
                out.append({
                    "phrase": phrase, "voice": voice, "paused": paused,
                    "text": " ".join(e["text"] for _, e in mine),
                    "finals": len(mine),
                    "transcript_ms": round((mine[-1][0] - spoke_until) * 1000, 1) if mine else None,
                    "early": bool(mine) and mine[0][0] < spoke_until,
                    "voice_to_voice_ms": round((reply_at - spoke_until) * 1000, 1) if reply_at else None,
                    # From the final transcript to the reply's first voiced frame: the voice and the path.
                    "reply_ms": round((reply_at - mine[-1][0]) * 1000, 1) if reply_at and mine else None,
                    # The endpointer's own account (its debug log): the rule that ended the turn, its decode, the
                    # silence it waited from the last voiced frame the VAD heard.
                    "rule": ended.get("rule"), "decode_ms": ended.get("decode_ms"), "silence_ms": ended.get("silence_ms"),
                    "partials": sum(1 for t in partials if started <= t <= spoke_until),
                    "clip": clip,
                })
    finally:
        answering.cancel()
        await backend.close()
    return out


def _turn_ended(server: ServerProcess, final: dict) -> dict:
    """The server's `turn ended` debug line for this final transcript (same end_ms)."""
    for entry in reversed(server.log_entries()):
        if entry.get("message") == "turn ended" and entry.get("end_ms") == final.get("end_ms"):
            return entry
    return {}


def figures(rows: list[dict], offline: list[str]) -> dict:
    v2v = [r["voice_to_voice_ms"] for r in rows if r["voice_to_voice_ms"] is not None and not r["early"]]
    tr = [r["transcript_ms"] for r in rows if r["transcript_ms"] is not None and not r["early"]]
    reply = [r["reply_ms"] for r in rows if r["reply_ms"] is not None and not r["early"]]
    decode = [r["decode_ms"] for r in rows if r["decode_ms"] is not None]
    paused = [r for r in rows if r["paused"]]
    long_turns = [r for r in rows if len(r["clip"]) / 48000 > 1.5]
    return {
        "turns": len(rows),
        "voice_to_voice_ms": {"p50": round(percentile(v2v, 50), 1), "p95": round(percentile(v2v, 95), 1),
                              "max": max(v2v) if v2v else None, "n": len(v2v)},
        "transcript_ms": {"p50": round(percentile(tr, 50), 1), "p95": round(percentile(tr, 95), 1)},
        "reply_ms": {"p50": round(percentile(reply, 50), 1), "p95": round(percentile(reply, 95), 1)},
        "decode_ms": {"p50": round(percentile(decode, 50), 1), "p95": round(percentile(decode, 95), 1)},
        "rules": {rule: sum(r["rule"] == rule for r in rows) for rule in ("finished", "level", "unfinished", None)},
        "wer_live": round(corpus_wer([r["phrase"] for r in rows], [r["text"] for r in rows]), 3),
        "wer_offline_whole_turn": round(corpus_wer([r["phrase"] for r in rows], offline), 3),
        "paused_turns": len(paused), "answered_early": sum(r["early"] for r in paused),
        "plain_answered_early": sum(r["early"] for r in rows if not r["paused"]),
        "no_reply": sum(r["voice_to_voice_ms"] is None for r in rows),
        "turns_over_1_5_s_with_partials": f"{sum(r['partials'] > 0 for r in long_turns)}/{len(long_turns)}",
        "rows": [{k: v for k, v in r.items() if k != "clip"} for r in rows],
    }


PHONE_TAIL_S = 2.5  # silence the phone streams after a turn (a call's media never stops), in which the turn ends


async def phone_conversation(url: str, plan: list, offset_s: float, server: ServerProcess | None = None) -> list[dict]:
    """The same turns said by a phone call: a Twilio media stream (μ-law, 8 kHz, 20 ms frames, real time)."""
    import soxr as _soxr

    from tests.telephony.twilio_standin import TwilioStandIn
    from voxgate.gateway.media.encoder import ulaw_decode

    await asyncio.sleep(offset_s)
    backend = VoxgateSession(url)
    await backend.open()
    finals: list[tuple[float, dict]] = []

    async def answer() -> None:
        async for event in backend.events():
            if event.get("type") == "speech.transcript" and event.get("final"):
                finals.append((time.perf_counter(), event))
                await backend.send({"type": "speak", "text": REPLY})

    answering = asyncio.ensure_future(answer())
    phone = TwilioStandIn(url)
    out = []
    try:
        await phone.connect()
        await phone.start({"session_id": backend.session_id, "token": backend.client_token})
        for phrase, voice, clip, paused in plan:
            before = len(finals)
            clip8 = _soxr.resample(clip.astype(np.float32), 48000, 8000).astype(np.int16)
            first: list[float] = []
            audio = np.concatenate([np.zeros(int(LEAD_S * 8000), np.int16), clip8,
                                    np.zeros(int(PHONE_TAIL_S * 8000), np.int16)])
            await phone.send_audio(audio, on_first=lambda: first.append(time.perf_counter()))
            spoke_until = first[0] + LEAD_S + last_voiced_s(clip)
            mine = finals[before:]
            reply_at = None
            if mine:
                for t, payload in phone.received.media:
                    if t >= max(spoke_until, mine[0][0]) and np.sqrt(np.mean(ulaw_decode(payload).astype(np.float64) ** 2)) > VOICED:
                        reply_at = t
                        break
            ended = _turn_ended(server, mine[-1][1]) if mine and server is not None else {}
            out.append({
                "phrase": phrase, "voice": voice, "paused": paused,
                "text": " ".join(e["text"] for _, e in mine), "finals": len(mine),
                "transcript_ms": round((mine[-1][0] - spoke_until) * 1000, 1) if mine else None,
                "early": bool(mine) and mine[0][0] < spoke_until,
                "voice_to_voice_ms": round((reply_at - spoke_until) * 1000, 1) if reply_at else None,
                "reply_ms": round((reply_at - mine[-1][0]) * 1000, 1) if reply_at and mine else None,
                "rule": ended.get("rule"), "decode_ms": ended.get("decode_ms"), "silence_ms": ended.get("silence_ms"),
                "partials": 0, "clip": clip,
            })
    finally:
        answering.cancel()
        await phone.close()
        await backend.close()
    return out


def offline_phone(whisper, plan: list) -> list[str]:
    """The recognizer offline on each whole turn as the phone sent it: μ-law at 8 kHz, raised to 16 kHz."""
    from voxgate.gateway.media.encoder import ulaw_decode, ulaw_encode

    texts = []
    for _, _, clip, _ in plan:
        sent = ulaw_decode(ulaw_encode(soxr.resample(clip.astype(np.float32), 48000, 8000).astype(np.int16)))
        texts.append(" ".join(whisper.recognize(soxr.resample(sent, 8000, 16000).astype(np.int16)).split()))
    return texts


async def run_phone(url: str, plan: list, conversations: int, server: ServerProcess | None = None) -> list:
    return await asyncio.gather(*(phone_conversation(url, plan, i * 1.3, server) for i in range(conversations)),
                                return_exceptions=True)


async def run(url: str, plan: list, conversations: int, server: ServerProcess | None = None) -> list:
    # Each conversation starts a little after the last, so their turns do not end in step. A conversation the
    # gateway refused (at_capacity on a loaded machine) is reported, not fatal.
    return await asyncio.gather(*(conversation(url, plan, i * 1.3, server) for i in range(conversations)),
                                return_exceptions=True)


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--turns", type=int, default=20, help="turns per conversation (half with a pause)")
    parser.add_argument("--conversations", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--phone", type=int, nargs="*", default=[1],
                        help="conversations at once over the Twilio media-stream path (none: skip it)")
    parser.add_argument("--before-tree", default=None,
                        help="a git worktree of the code before a change: its server runs the WebRTC arms too, same run")
    args = parser.parse_args()
    plan = turns(6 if args.quick else args.turns)
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results: dict = {"machine": info, "args": vars(args), "label": (
        "voice to voice over WebRTC: gateway process (--engine piper --stt whisper, defaults: turn 250/1200 ms, "
        "partials 700 ms), aiortc client in real time, backend answers each final transcript at once")}
    from voxgate.gateway.caller.stt_whisper import Whisper

    whisper = Whisper()
    offline = [" ".join(whisper.recognize(soxr.resample(clip, 48000, 16000).astype(np.int16)).split())
               for _, _, clip, _ in plan]
    serve = ["--stt", "whisper", "--log-json", "--log-level", "DEBUG"]
    phone_reference = offline_phone(whisper, plan) if args.phone else []
    # (label, server's env, arms): this code; then, with --before-tree, the code before, over WebRTC, same run.
    servers: list = [("", None, [("webrtc", n, run, offline) for n in args.conversations]
                      + [("phone", n, run_phone, phone_reference) for n in args.phone])]
    if args.before_tree:
        servers.append(("before_", {"PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "before"),
                                    "VOXGATE_BEFORE_TREE": os.path.abspath(args.before_tree)},
                        [("webrtc", n, run, offline) for n in args.conversations]))
    for label, env, arms in servers:
        try:
            server = ServerProcess("piper", serve, env=env)
        except RuntimeError as exc:  # recorded, not fatal: the other server's figures stand
            print(f"  the {label or 'current'} server did not start: {str(exc)[-300:]}", flush=True)
            results[f"{label}server_failed"] = str(exc)[-300:]
            continue
        try:
            for path, n, runner, reference in arms:
                section(f"{label}{path}: {n} conversation(s), {len(plan)} turns each")
                outcomes = asyncio.run(runner(server.url, plan, n, server))
                failed = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
                done = [o for o in outcomes if not isinstance(o, BaseException)]
                for why in failed:
                    print(f"  a conversation failed: {why}", flush=True)
                if not done:
                    results[f"{label}{path}_{n}"] = {"failed": failed}
                    continue
                flat = [r for conv in done for r in conv]
                r = figures(flat, reference * len(done))
                r["conversations_failed"] = failed
                for row in r["rows"]:
                    print(f"  {row['voice']:18s} v2v {row['voice_to_voice_ms']} ms, transcript {row['transcript_ms']} ms "
                          f"({row['rule']}, decode {row['decode_ms']}, silence {row['silence_ms']}), reply {row['reply_ms']}"
                          f"{' EARLY' if row['early'] else ''} {row['text']!r}", flush=True)
                results[f"{label}{path}_{n}"] = r
                print(f"{label}{path} {n} conversation(s): voice to voice p50 {r['voice_to_voice_ms']['p50']} ms "
                      f"p95 {r['voice_to_voice_ms']['p95']} ms; transcript p50 {r['transcript_ms']['p50']} ms; "
                      f"reply p50 {r['reply_ms']['p50']} ms; decode p50 {r['decode_ms']['p50']} ms; rules {r['rules']}; "
                      f"WER {r['wer_live']} (offline {r['wer_offline_whole_turn']}); paused turns answered early "
                      f"{r['answered_early']}/{r['paused_turns']}; no reply {r['no_reply']}", flush=True)
        finally:
            server.stop()
    finish("conversation", results, started, args.out)


if __name__ == "__main__":
    main()
