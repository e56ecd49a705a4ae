"""What a real chromium hears from Voxgate over a bad line: loss, bursts, jitter, per Opus setting.

A gateway per arm (the real voice unless --engine says otherwise) and one
headless Debian chromium; between them bench/netem.py's relay impairs
server-to-browser RTP. Each session speaks the same sentences; per sentence
the page's getStats (packets lost, concealed samples, jitter buffer delay and
target, FEC packets) and the audio chromium played (recorded in the page after
its jitter buffer and concealment) are kept. The recording is scored by:
- WER: pocketsphinx (the embedded recognizer, gateway/caller/stt_pocketsphinx.py) on
  the recording at 16 kHz, against the sentence;
- spectral distance: the mean absolute difference of log-magnitude spectra
  (dB, 20 ms frames, 100 Hz-8 kHz) to the same arm's clean recording of the
  same sentence, aligned by cross-correlation.

Arms, each a server started with its flags, all in one run on the same lines
(same seeds, so every arm loses the same packet positions):
- default: this build's defaults (`--opus-signal auto`: voice with FEC at
  `--opus-fec-bitrate` 48000 from the first packet, music after clean reports);
- nofec: `--no-opus-fec` (CELT throughout: what the defaults before FEC-first gave
  a listener whose loss had not been reported yet);
- voice32k: `--opus-signal voice --opus-fec-bitrate 32000` (what `--opus-signal
  voice` was before: hybrid at 32 kbit/s, where libopus puts no LBRR in the packets);
- voice40k: `--opus-signal voice --opus-fec-bitrate 40000` (hybrid with LBRR);
- wb10: `--opus-signal voice --opus-fec-bitrate 32000 --opus-loss-pct 10`
  (libopus drops to wideband SILK to afford LBRR at 32 kbit/s).
Every line is re-timed first (netem `retime_ms`): packets leave the relay on
their RTP timestamps' schedule plus 100 ms, so the server's own late frames on a
busy machine are not counted as the line's jitter.
The bytes each arm sent per second of speech are counted at the relay.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import soxr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common  # noqa: E402
import browser_call  # noqa: E402
import netem  # noqa: E402

SENTENCES = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden gate.",
    "Please remember to bring your umbrella tomorrow because the forecast says it will rain all afternoon.",
    "Our meeting has been moved to Thursday at three o'clock in the small conference room downstairs.",
)
ARMS = {
    "default": [],
    "nofec": ["--no-opus-fec"],
    "voice32k": ["--opus-signal", "voice", "--opus-fec-bitrate", "32000"],
    "voice40k": ["--opus-signal", "voice", "--opus-fec-bitrate", "40000"],
    "wb10": ["--opus-signal", "voice", "--opus-fec-bitrate", "32000", "--opus-loss-pct", "10"],
}
RETIME_MS = 100.0
LINES = {
    "clean": netem.Impairment(retime_ms=RETIME_MS),
    # Not in the default run (--lines): the server's own pacing as it reaches the browser, against "clean".
    "clean, as sent": netem.Impairment(),
    "5% random, 40 ms": netem.Impairment(loss=0.05, jitter_ms=40, retime_ms=RETIME_MS),
    "5% burst 2, 40 ms": netem.Impairment(loss=0.05, burst=2, jitter_ms=40, retime_ms=RETIME_MS),
    "10% burst 2, 40 ms": netem.Impairment(loss=0.10, burst=2, jitter_ms=40, retime_ms=RETIME_MS),
}


def wer(pcm48: np.ndarray, text: str) -> tuple[float, str]:
    from voxgate.gateway.caller.stt_pocketsphinx import decode
    from tests.speech import word_error_rate

    pcm16 = soxr.resample(pcm48.astype(np.float32), 48000, 16000)
    hyp = decode(pcm16)
    return word_error_rate(text, hyp), hyp


def _log_spec(pcm: np.ndarray) -> np.ndarray:
    n = 960  # 20 ms at 48 kHz
    frames = pcm[: len(pcm) // n * n].astype(np.float64).reshape(-1, n) * np.hanning(n)
    spec = np.abs(np.fft.rfft(frames, axis=1))[:, 2:161]  # 100 Hz to 8 kHz
    return 20 * np.log10(spec + 1.0)


def spectral_distance(pcm: np.ndarray, clean: np.ndarray) -> float:
    """dB: mean |log spectrum difference| over the clean recording's voiced frames, after alignment."""
    a, b = pcm.astype(np.float64), clean.astype(np.float64)
    size = 1 << int(np.ceil(np.log2(len(a) + len(b))))
    xc = np.fft.irfft(np.fft.rfft(a, size) * np.conj(np.fft.rfft(b, size)), size)
    lag = int(np.argmax(xc))
    lag = lag - size if lag > size // 2 else lag
    a = a[lag:] if lag > 0 else np.concatenate([np.zeros(-lag), a])
    m = min(len(a), len(b))
    sa, sb = _log_spec(a[:m]), _log_spec(b[:m])
    voiced = sb.max(axis=1) > sb.max() - 40
    return float(np.mean(np.abs(sa[voiced] - sb[voiced])))


def voiced_ms(pcm: np.ndarray) -> float:
    frames = pcm[: len(pcm) // 960 * 960].astype(np.float64).reshape(-1, 960)
    return 20.0 * int((np.sqrt((frames ** 2).mean(axis=1)) > 300).sum())


def retried(fn, *a, **kw):
    """fn(*a, **kw), again after a pause while the gateway refuses for load (503: admission measures the
    machine, which other work shares); other errors at once."""
    for attempt in range(20):
        try:
            return fn(*a, **kw)
        except Exception as exc:
            if "503" not in str(exc) or attempt == 19:
                raise
            print(f"    refused for load (503), again in 3 s: {str(exc)[:120]}", flush=True)
            time.sleep(3)


def run(args) -> dict:
    from playwright.sync_api import sync_playwright

    from tests.conftest import ServerProcess

    arms = {k: v for k, v in ARMS.items() if k in args.arms}
    lines = {k: v for k, v in LINES.items() if k in args.lines or (not args.lines and k != "clean, as sent")}
    sentences = SENTENCES[: args.sentences]
    servers = {name: ServerProcess(args.engine, flags) for name, flags in arms.items()}
    rows: list[dict] = []
    try:
        with sync_playwright() as p:
            browser = browser_call.launch(p)
            clean_pcm: dict[tuple[str, int], np.ndarray] = {}
            for seed in range(1, args.seeds + 1):
                for line, imp in lines.items():
                    # Arms alternate inside a line and seed: each sees the same loss pattern within minutes.
                    for arm, server in servers.items():
                        imp_s = netem.Impairment(**{**imp.__dict__, "seed": seed})
                        with netem.RelayThread(imp_s) as relay:
                            results = retried(browser_call.call, browser, server.url, list(sentences), relay=relay)
                        st = relay.relay.stats
                        for i, (text, r) in enumerate(zip(sentences, results)):
                            w, hyp = wer(r.pcm, text)
                            if line == "clean" and seed == 1:
                                clean_pcm[(arm, i)] = r.pcm
                            audio_ms = next((e["audio_ms"] for e in r.events if e.get("type") == "utterance.done"
                                             and e.get("id") == f"n{i}"), None)
                            ref = clean_pcm.get((arm, i))
                            rows.append({
                                "arm": arm, "line": line, "seed": seed, "sentence": i, "wer": w, "hyp": hyp,
                                "concealed": r.concealed_share, "jb_ms": r.jitter_buffer_ms,
                                "jb_target_ms": r.jitter_buffer_target_ms,
                                "spectral_db": spectral_distance(r.pcm, ref) if ref is not None else None,
                                "voiced_ms": voiced_ms(r.pcm), "audio_ms": audio_ms, "stats": r.stats,
                            })
                        sent_s = sum(row["audio_ms"] or 0 for row in rows[-len(sentences):]) / 1000.0
                        rows[-1]["session"] = {"rtp_in": st.rtp_in, "rtp_lost": st.rtp_lost, "reordered": st.reordered,
                                               "rtp_bytes": st.rtp_bytes, "kbps": st.rtp_bytes * 8 / 1000 / max(sent_s, 1e-9)}
                        print(f"  {arm:9s} {line:20s} seed {seed}: lost {st.rtp_lost}/{st.rtp_in}, reordered {st.reordered}, "
                              f"concealed {np.mean([x['concealed'] for x in rows[-len(sentences):]]):.3f}, "
                              f"WER {np.mean([x['wer'] for x in rows[-len(sentences):]]):.3f}, "
                              f"{rows[-1]['session']['kbps']:.1f} kbit/s", flush=True)
            browser.close()
    finally:
        for server in servers.values():
            server.stop()
    summary: dict = {}
    for arm in arms:
        for line in lines:
            got = [r for r in rows if r["arm"] == arm and r["line"] == line]
            if not got:
                continue
            lost = sum(r["stats"]["packetsLost"] for r in got)
            received = sum(r["stats"]["packetsReceived"] for r in got)
            concealed = sum(r["stats"]["concealedSamples"] - r["stats"]["silentConcealedSamples"] for r in got)
            total = sum(r["stats"]["totalSamplesReceived"] for r in got)
            sessions = [r["session"] for r in got if "session" in r]
            summary[f"{arm} | {line}"] = {
                "wer": float(np.mean([r["wer"] for r in got])),
                "concealed": concealed / total if total else None,
                "lost": lost / max(1, lost + received),
                "fec_packets": sum(r["stats"]["fecPacketsReceived"] for r in got),
                "jb_ms": float(np.mean([r["jb_ms"] for r in got])),
                "jb_target_ms": float(np.mean([r["jb_target_ms"] for r in got])),
                "spectral_db": float(np.mean([r["spectral_db"] for r in got if r["spectral_db"] is not None]))
                if any(r["spectral_db"] is not None for r in got) else None,
                "kbps": float(np.mean([s["kbps"] for s in sessions])) if sessions else None,
            }
    _common.section("summary (per arm and line, over seeds and sentences)")
    print(f"{'arm | line':34s} {'WER':>6s} {'lost':>6s} {'concealed':>9s} {'FEC':>5s} {'JB ms':>6s} {'target':>6s} {'spec dB':>7s} {'kbit/s':>6s}")
    for key, s in summary.items():
        print(f"{key:34s} {s['wer']:6.3f} {s['lost']:6.3f} {s['concealed']:9.3f} {s['fec_packets']:5d} {s['jb_ms']:6.1f} "
              f"{s['jb_target_ms']:6.1f} {s['spectral_db'] if s['spectral_db'] is not None else float('nan'):7.2f} "
              f"{s['kbps'] or float('nan'):6.1f}")
    return {"summary": summary, "rows": rows, "arms": {k: ARMS[k] for k in arms},
            "lines": {k: v.__dict__ for k, v in lines.items()}, "sentences": list(sentences), "engine": args.engine}


def run_turn(args) -> dict:
    """Sessions through coturn (relay-only chromium, UDP, TCP, TLS) against direct ones, alternating, one server."""
    from playwright.sync_api import sync_playwright

    import coturn
    from tests.conftest import ServerProcess

    modes = ("direct", "udp", "tcp", "tls")
    got: dict[str, list[dict]] = {m: [] for m in modes}
    with coturn.Coturn() as turn:
        server = ServerProcess(args.engine, ["--turn-secret", turn.secret, *sum((["--ice-server", u] for u in turn.urls()), [])])
        try:
            with sync_playwright() as p:
                browser = browser_call.launch(p, ["--ignore-certificate-errors"])  # coturn's certificate is self-signed
                for n in range(args.turn):
                    for mode in modes:
                        kwargs: dict = {}
                        if mode != "direct":
                            made, servers = retried(browser_call.turn_servers, server.url, mode)
                            kwargs = {"ice_servers": servers, "policy": "relay", "made_ahead": made}
                        r = retried(browser_call.call, browser, server.url, [SENTENCES[n % len(SENTENCES)]], tail_ms=200, **kwargs)[0]
                        got[mode].append({"connect_to_audio_ms": r.connect_to_audio_ms, "ready_ms": r.ready_ms,
                                          "first_audio_ms": r.first_audio_ms,
                                          "local": {k: r.pair["local"].get(k) for k in ("candidateType", "relayProtocol", "address")}})
                        print(f"  {mode:6s} round {n}: offer to first audio {r.connect_to_audio_ms:.0f} ms, "
                              f"answer to ready {r.ready_ms:.0f} ms, speak to first audio {r.first_audio_ms:.0f} ms", flush=True)
                browser.close()
        finally:
            server.stop()
    summary = {}
    base = {k: float(np.median([x[k] for x in got["direct"]])) for k in ("connect_to_audio_ms", "ready_ms", "first_audio_ms")}
    _common.section("TURN against direct (medians; ratio to direct)")
    for mode in modes:
        med = {k: float(np.median([x[k] for x in got[mode]])) for k in base}
        summary[mode] = {**med, **{k.replace("_ms", "_ratio"): med[k] / base[k] for k in base}}
        print(f"  {mode:6s} offer to first audio {med['connect_to_audio_ms']:.0f} ms ({med['connect_to_audio_ms'] / base['connect_to_audio_ms']:.2f}x), "
              f"answer to ready {med['ready_ms']:.0f} ms, speak to first audio {med['first_audio_ms']:.0f} ms "
              f"({med['first_audio_ms'] / base['first_audio_ms']:.2f}x)")
    return {"turn": summary, "turn_rows": got, "engine": args.engine, "rounds": args.turn}


MOVED_WATCH_MS = 12000  # after a move: past the gateway's default --peer-silence-timeout-s, with room


def quiet_browser(browser, server, seconds: float) -> dict:
    """A live browser (recvonly, as the page: no microphone) idle after an utterance: the longest it
    went without sending the server anything, and whether the server kept its session open."""
    with netem.RelayThread(netem.Impairment()) as relay:
        context = browser.new_context(bypass_csp=True)
        page = retried(browser_call.open_session, context, server.url, relay)
        sid = page.evaluate("window.vg.events.find((e) => e.msg.type === 'session.ready').msg.session_id")
        page.evaluate("(t) => window.vg.dc.send(JSON.stringify({type: 'speak', id: 'q', text: t}))", SENTENCES[0])
        page.wait_for_function("window.vg.events.some((e) => e.msg.type === 'utterance.done')", timeout=30000)
        relay.relay.quiet_reset()
        page.wait_for_timeout(seconds * 1000)
        closed = any(e.get("session_id") == sid and "closed" in e["message"] for e in server.log_entries())
        got = {"idle_s": seconds, "max_up_gap_ms": round(relay.relay.up_gap_max * 1000), "server_closed": closed,
               "browser": page.evaluate("window.vg.pc.connectionState")}
        print(f"  quiet: {got}", flush=True)
        context.close()
    return got


def run_move(args) -> dict:
    """The browser's address changes mid-utterance (the relay's server side moves to a new port, as a
    NAT rebinding or a phone's new network shows to the server), and the path is cut outright
    (every packet both ways dropped): how long until media flows again, or until each side gives up."""
    from playwright.sync_api import sync_playwright

    from tests.conftest import ServerProcess

    long_text = " ".join(SENTENCES)
    out: dict = {"move": [], "cut": [], "quiet": []}
    server = ServerProcess(args.engine, ["--log-json"])
    try:
        with sync_playwright() as p:
            browser = browser_call.launch(p)
            for n in range(args.move):
                with netem.RelayThread(netem.Impairment()) as relay:
                    context = browser.new_context(bypass_csp=True)
                    page = retried(browser_call.open_session, context, server.url, relay)
                    sid = page.evaluate("window.vg.events.find((e) => e.msg.type === 'session.ready').msg.session_id")
                    page.evaluate("(t) => window.vg.dc.send(JSON.stringify({type: 'speak', id: 'm', text: t}))", long_text)
                    page.wait_for_timeout(1000 + 300 * n)  # the move falls at a different point of the consent cycle
                    relay.move()
                    # Past the gateway's --peer-silence-timeout-s (8 s): a moved browser is heard, and stays.
                    page.wait_for_timeout(MOVED_WATCH_MS)
                    r = relay.relay
                    gap = None if r.resumed_at is None or r.moved_at is None else (r.resumed_at - r.moved_at) * 1000
                    state = page.evaluate("window.vg.pc.connectionState")
                    closed = any(e.get("session_id") == sid and "closed" in e["message"] for e in server.log_entries())
                    out["move"].append({"resumed_ms": gap, "browser": state, "server_closed": closed})
                    print(f"  move {n}: the server sent to the new address after {gap if gap is None else round(gap)} ms; "
                          f"browser {state}; server closed the session: {closed}", flush=True)
                    context.close()
            if args.move_quiet_s > 0:
                out["quiet"].append(quiet_browser(browser, server, args.move_quiet_s))
            for n in range(args.move_cuts):
                with netem.RelayThread(netem.Impairment()) as relay:
                    context = browser.new_context(bypass_csp=True)
                    page = retried(browser_call.open_session, context, server.url, relay)
                    sid = page.evaluate("window.vg.events.find((e) => e.msg.type === 'session.ready').msg.session_id")
                    page.evaluate("(t) => window.vg.dc.send(JSON.stringify({type: 'speak', id: 'c', text: t}))", long_text)
                    page.wait_for_timeout(1500)
                    relay.relay.cut = True
                    cut = time.monotonic()
                    seen: dict = {}
                    while time.monotonic() - cut < 60 and "server_closed_s" not in seen:
                        state = page.evaluate("window.vg.pc.connectionState")
                        seen.setdefault(f"browser_{state}_s", round(time.monotonic() - cut, 1))
                        if any(e.get("session_id") == sid and "closed" in e["message"] for e in server.log_entries()):
                            seen["server_closed_s"] = round(time.monotonic() - cut, 1)
                        time.sleep(0.25)
                    out["cut"].append(seen)
                    print(f"  cut {n}: {seen}", flush=True)
                    context.close()
            browser.close()
    finally:
        server.stop()
    return {**out, "engine": args.engine}


def main() -> None:
    parser = _common.arg_parser(__doc__)
    parser.add_argument("--engine", default="piper", help="the gateway's engine (piper: the real voice)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--lines", nargs="*", default=[], help=f"a subset of {list(LINES)}".replace("%", "%%"))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=len(SENTENCES))
    parser.add_argument("--turn", type=int, default=0, metavar="ROUNDS",
                        help="instead: first audio through coturn (UDP, TCP, TLS) against direct, this many rounds")
    parser.add_argument("--move", type=int, default=0, metavar="TRIALS",
                        help="instead: the browser's address moves mid-utterance (TRIALS times), then the path is cut")
    parser.add_argument("--move-cuts", type=int, default=2)
    parser.add_argument("--move-quiet-s", type=float, default=20.0,
                        help="with --move: a live browser left idle this long after an utterance; its longest "
                             "silence toward the server, against --peer-silence-timeout-s (0: skip)")
    args = parser.parse_args()
    started = time.perf_counter()
    info = _common.machine()
    _common.print_machine(info, "bench_network")
    results = run_turn(args) if args.turn else run_move(args) if args.move else run(args)
    results["machine"] = info
    name = "network-turn" if args.turn else "network-move" if args.move else "network"
    _common.finish(name, results, started, getattr(args, "out", None))


if __name__ == "__main__":
    main()
