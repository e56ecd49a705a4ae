"""Speech recognition on caller turns (issue 40): WER live against offline, per path, and latency.

    python bench/bench_transcripts.py --out bench/results/transcripts.json
    python bench/bench_transcripts.py --turns 8     # fewer turns per path

An in-process gateway (tone engine, `--stt pocketsphinx`) hears the corpus's
espeak-ng caller turns (tests/transcripts.py: the interruptions and questions
in three voices) in real time, through two paths: a real aiortc client over
WebRTC (Opus 48 kHz) and the Twilio stand-in (μ-law 8 kHz). Per path: the
WER of the backend's `speech.transcript`s (the live path), against the same
recognizer run offline on the exact audio the client sent, as it sent it, in the
turn's span (`start_ms` to `end_ms` on the session clock). WebRTC: every frame the
microphone handed aiortc, Opus-coded again after the call by aiortc's own encoder
(its settings: 96 kb/s, VoIP) from the first frame on, decoded at 16 kHz as the
gateway decodes it, the frames chosen by when each was due. Twilio: the μ-law
media frames matched one for one, raised to 16 kHz with soxr. Both sides hear the
same stretch of the same coded audio, so the difference is what the path lost
(packets, order, the capture clock). WebRTC also offline on the whole turn as the
microphone had it, before Opus (pocketsphinx scores it differently: a reference,
not the bound). And the recognizer's latency per turn: `speech.stopped` to
`speech.transcript` at the backend.
Figures go to stdout and to artifacts/bench-transcripts.json (--out).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "telephony"))

import av  # noqa: E402
import numpy as np  # noqa: E402
import soxr  # noqa: E402
from _common import arg_parser, finish, machine, percentile, print_machine, section  # noqa: E402

from tests.backend.test_transcripts import RecordingMic  # noqa: E402
from tests.conftest import in_process_gateway  # noqa: E402
from tests.transcripts import corpus_wer, every_turn, turn_audio  # noqa: E402
from twilio_standin import TwilioStandIn  # noqa: E402
from voxgate.client import VoxgateSession  # noqa: E402
from aiortc.codecs.opus import OpusEncoder  # noqa: E402
from voxgate.gateway.media import opus  # noqa: E402
from voxgate.gateway.media.encoder import ulaw_decode  # noqa: E402
from voxgate.gateway.caller.stt_pocketsphinx import decode  # noqa: E402
from voxgate.rtc_client import RtcClient  # noqa: E402


async def webrtc(turns: list[tuple[str, str]]) -> dict:
    live, sent, latency, errors, spans = [], [], [], [], []
    # Clips made before, and offline decoding after, the call: either would stall the event loop during it.
    clips = [turn_audio(phrase, voice, 48000) for phrase, voice in turns]
    async with in_process_gateway(stt="pocketsphinx") as (app, url):
        backend = VoxgateSession(url)
        await backend.open()
        # The session's clock: the gateway runs in this process.
        origin = app["gateway"].sessions[backend.session_id].clock.origin
        client = RtcClient(url, mic=True, session_id=backend.session_id, token=backend.client_token)
        client.mic = RecordingMic()
        try:
            await client.connect()
            for clip in clips:
                first = len(client.mic.sent)
                events = backend.events()
                client.mic.play(clip)
                stopped_at, event = await outcome(events)
                latency.append(time.perf_counter() - stopped_at)
                live.append(event.get("text", "") if event["type"] == "speech.transcript" else "")
                if event["type"] == "error":
                    errors.append(event["code"])
                while client.mic.busy:
                    await asyncio.sleep(0.05)
                sent.append(np.concatenate(client.mic.sent[first:])[: len(clip)])
                spans.append((event.get("start_ms", 0), event.get("end_ms", 0)))
        finally:
            await client.close()
            await backend.close()
    coded = as_sent(client.mic.sent)
    due_ms = [(due - origin) * 1000 for due in client.mic.due]
    offline, whole = [], []
    for (_phrase, voice), (start_ms, end_ms), turn in zip(turns, spans, sent):
        # The frames due within the turn's span (their middle, as the Twilio arm's), on the session clock.
        inside = [f for f, t in zip(coded, due_ms) if start_ms <= t + 10 < end_ms]
        offline.append(decode(np.concatenate(inside) if inside else np.zeros(320, np.int16)))
        whole.append(decode(soxr.resample(turn, 48000, 16000)))
        print(f"  webrtc {voice:13s} live {live[len(offline) - 1]!r} | offline {offline[-1]!r} | whole turn {whole[-1]!r}",
              flush=True)
    out = figures(turns, live, offline, latency, errors)
    out["wer_offline_whole_turn"] = round(corpus_wer([p for p, _ in turns], whole), 3)
    out["offline_whole_turn"] = whole
    return out


def as_sent(frames: list[np.ndarray]) -> list[np.ndarray]:
    """The microphone's 48 kHz frames as the client sent them and the gateway heard them: through
    aiortc's Opus encoder, from the first frame on, and back through Opus at 16 kHz."""
    encoder, decoder, out = OpusEncoder(), opus.Decoder(16000), []
    for i, pcm in enumerate(frames):
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, i * len(pcm)
        packets, _ = encoder.encode(frame)
        out.append(np.concatenate([decoder.decode(p) for p in packets]) if packets else np.zeros(320, np.int16))
    return out


async def twilio(turns: list[tuple[str, str]]) -> dict:
    live, latency, errors, events_ = [], [], [], []
    frames: list = []
    async with in_process_gateway(stt="pocketsphinx") as (_, url):
        backend = VoxgateSession(url, caller_audio=True, caller_audio_buffer=100000)
        await backend.open()

        async def collect() -> None:
            async for frame in backend.caller_frames():
                frames.append(frame)

        reader = asyncio.ensure_future(collect())
        phone = TwilioStandIn(url)
        try:
            await phone.connect()
            await phone.start({"session_id": backend.session_id, "token": backend.client_token})
            await backend.wait_for("call.started")
            for phrase, voice in turns:
                events = backend.events()
                sending = asyncio.ensure_future(phone.send_audio(turn_audio(phrase, voice, 8000)))
                stopped_at, event = await outcome(events)
                await sending
                latency.append(time.perf_counter() - stopped_at)
                events_.append(event)
                live.append(event.get("text", "") if event["type"] == "speech.transcript" else "")
                if event["type"] == "error":
                    errors.append(event["code"])
        finally:
            reader.cancel()
            await phone.close()
            await backend.close()
    offline = []
    for (_phrase, voice), event in zip(turns, events_):
        span = [m for (_, m), f in zip(phone.sent_media, frames) if event["start_ms"] <= f.capture_ms + 10 < event["end_ms"]]
        sent = np.concatenate([ulaw_decode(m) for m in span]) if span else np.zeros(160, np.int16)
        offline.append(decode(soxr.resample(sent, 8000, 16000)))
        print(f"  twilio {voice:13s} live {live[len(offline) - 1]!r} | offline {offline[-1]!r}", flush=True)
    return figures(turns, live, offline, latency, errors)


async def outcome(events) -> tuple[float, dict]:
    """When speech.stopped reached the backend, and the turn's speech.transcript or error."""
    stopped_at = None
    async for event in events:
        if event["type"] == "speech.stopped" and stopped_at is None:
            stopped_at = time.perf_counter()
        elif event["type"] in ("speech.transcript", "error") and stopped_at is not None:
            await events.aclose()
            return stopped_at, event
    raise RuntimeError("the session closed")


def figures(turns, live, offline, latency, errors) -> dict:
    phrases = [p for p, _ in turns]
    wer_live, wer_offline = corpus_wer(phrases, live), corpus_wer(phrases, offline)
    return {"turns": len(turns), "wer_live": round(wer_live, 3), "wer_offline": round(wer_offline, 3),
            "difference": round(wer_live - wer_offline, 3), "within_0_05": abs(wer_live - wer_offline) <= 0.05,
            "errors": errors, "latency_ms": {"p50": round(percentile(latency, 50) * 1000, 1),
                                             "p95": round(percentile(latency, 95) * 1000, 1)},
            "live": live, "offline": offline}


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--turns", type=int, default=0, help="turns per path, spread over the corpus (0: all 60)")
    args = parser.parse_args()
    turns = every_turn()
    n = 6 if args.quick else (args.turns or len(turns))
    turns = [turns[int(i * len(turns) / n)] for i in range(n)]
    started = time.perf_counter()
    info = machine()
    print_machine(info, "machine")
    results: dict = {"machine": info, "args": vars(args), "label": "pocketsphinx caller turns, in-process gateway "
                     "(tone engine, --stt pocketsphinx, defaults), real time, espeak-ng corpus turns"}
    for name, path in (("webrtc", webrtc), ("twilio", twilio)):
        section(f"{name}: {len(turns)} turns")
        results[name] = asyncio.run(path(turns))
        r = results[name]
        whole = f", whole turn {r['wer_offline_whole_turn']:.3f}" if "wer_offline_whole_turn" in r else ""
        print(f"{name}: WER live {r['wer_live']:.3f} against offline on the turn's span {r['wer_offline']:.3f} "
              f"(difference {r['difference']:+.3f}{whole}); "
              f"speech.stopped to transcript p50 {r['latency_ms']['p50']} ms (p95 {r['latency_ms']['p95']}); errors {r['errors']}",
              flush=True)
    finish("transcripts", results, started, args.out)


if __name__ == "__main__":
    main()
