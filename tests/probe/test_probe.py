"""voxgate probe against live servers: every session accounted for, figures that make sense, reports written."""

import json
import subprocess
import sys

import pytest

from voxgate.probe import (
    ProbeConfig,
    histogram_delta,
    levenshtein,
    nice_ticks,
    parse_histogram,
    run_probe,
)

TEXT = "Hello there, this is the probe speaking with the tone engine. It says every byte."


def test_cli_probe_with_one_cancelling_session_reports_exact_played_text(tone_server, tmp_path):
    out_json, out_html = tmp_path / "probe.json", tmp_path / "probe.html"
    proc = subprocess.run(
        [
            sys.executable, "-m", "voxgate.cli", "probe", tone_server.url,
            "--sessions", "3", "--ramp-s", "0.5", "--text", TEXT,
            "--interrupt-at-ms", "600", "--interrupt-share", "0.34",
            "--json", str(out_json), "--html", str(out_html),
        ],
        capture_output=True, text=True, timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ttfa server" in proc.stdout and "played_text" in proc.stdout

    report = json.loads(out_json.read_text())
    figures = report["figures"]
    assert figures["sessions"] == {"total": 3, "connected": 3, "failed": 0, "failures": []}
    sessions = report["sessions"]
    assert sorted(s["index"] for s in sessions) == [0, 1, 2]
    assert all(len(s["utterances"]) == 1 for s in sessions)
    outcomes = {s["index"]: s["utterances"][0]["outcome"] for s in sessions}
    assert outcomes == {0: "interrupted", 1: "done", 2: "done"}

    cancelled = sessions[0]["utterances"][0]
    assert cancelled["interrupt_kind"] == "cancel" and cancelled["reason"] == "cancel"
    assert cancelled["played_text"] and TEXT.startswith(cancelled["played_text"]) and cancelled["played_text"] != TEXT
    # Without the cancel, sound would go on until the utterance's end, over 2.5 s
    # later (81 tone symbols of 40 ms, cancelled at 600 ms).
    assert cancelled["interrupt_to_silence_ms"] < 1000, cancelled
    for s in sessions:
        u = s["utterances"][0]
        assert u["server_ttfa_ms"] is not None
        # The client's clock starts before the server's and stops after it.
        assert u["client_ttfa_ms"] > u["server_ttfa_ms"], u
        # The tone engine's audio decodes back to text: played_text must match what arrived.
        assert u["accuracy"] in ("exact", "off_by_one"), (u["played_text"], u["decoded_text"])
    for s in sessions[1:]:
        assert s["utterances"][0]["decoded_text"] == TEXT

    assert figures["ttfa_client_ms"]["count"] == 3 and figures["ttfa_server_ms"]["count"] == 3
    client_ttfas = sorted(s["utterances"][0]["client_ttfa_ms"] for s in sessions)
    assert figures["ttfa_client_ms"]["max"] == pytest.approx(client_ttfas[-1], abs=0.1)
    assert figures["ttfa_client_ms"]["p50"] == pytest.approx(client_ttfas[1], abs=0.1)
    assert figures["interrupt_to_silence_ms"]["cancel"]["count"] == 1
    tone = figures["played_text"]["tone"]
    assert tone["checked"] == 3 and tone["mismatch"] == 0
    # One arrival gap per frame of speech: two whole utterances and the cancelled one's start.
    speech_frames = 2 * len(TEXT.encode()) * 40 // 20
    assert figures["frames"]["gaps"] >= speech_frames, figures["frames"]
    assert figures["frames"]["max_gap_ms"] < 500, figures["frames"]  # no stall in the tone engine's audio
    assert figures["server"]["cancel_to_silence"]["count"] >= 1

    page = out_html.read_text()
    assert page.count("<svg") == 3
    for label in ("TTFA histogram", "latency over time", "session timeline"):
        assert f'aria-label="{label}"' in page
    assert "session 2" in page


async def test_voice_barge_in_interrupts_with_reason_barge_in(piper_server):
    text = "I am going to keep talking for quite a while now, so that there is plenty of time to interrupt me. " * 2
    config = ProbeConfig(url=piper_server.url, sessions=1, texts=[text], interrupt_at_ms=800, barge_in="voice", timeout_s=60)
    report = await run_probe(config)
    (session,) = report.sessions
    assert session.failure is None and session.engine == "piper"
    (u,) = session.utterances
    assert u.outcome == "interrupted" and u.interrupt_kind == "voice" and u.reason == "barge_in"
    assert u.played_text and text.startswith(u.played_text)
    # Silence came long before the ~10 s the rest of the text would have taken.
    assert u.interrupt_to_silence_ms < 1000, u.interrupt_to_silence_ms
    # played_text is what fits in the audio that went out: no speaker says more
    # than 6 words a second (the whole text would be 42 words).
    print(f"\nvoice barge-in: silence {u.interrupt_to_silence_ms:.0f} ms after the voice; played {u.words_played} words in {u.played_ms} ms; audible duration says {u.words_expected}")
    assert 1 <= u.words_played <= u.played_ms / 1000 * 6 + 1, (u.played_text, u.played_ms)
    assert report.figures()["interrupt_to_silence_ms"]["voice"]["count"] == 1


async def test_a_server_that_is_not_there_counts_as_connection_failures():
    from tests.conftest import free_port

    report = await run_probe(ProbeConfig(url=f"http://127.0.0.1:{free_port()}", sessions=2, texts=["Hi."], timeout_s=5))
    figures = report.figures()
    assert figures["sessions"]["total"] == 2 and figures["sessions"]["failed"] == 2
    assert "probe" in report.summary_text()


def test_levenshtein_and_ticks():
    assert levenshtein("Hello wor", "Hello wo") == 1
    assert levenshtein("abc", "abc") == 0
    ticks = nice_ticks(0, 11.1, 10)
    assert ticks[0] == 0 and ticks[-1] >= 11.1


def test_server_histogram_delta_counts_only_the_run():
    before = 'x_bucket{le="0.05"} 1.0\nx_bucket{le="0.1"} 2.0\nx_bucket{le="+Inf"} 2.0\nx_sum 0.1\nx_count 2.0\n'
    after = 'x_bucket{le="0.05"} 2.0\nx_bucket{le="0.1"} 5.0\nx_bucket{le="+Inf"} 5.0\nx_sum 0.4\nx_count 5.0\n'
    delta = histogram_delta(parse_histogram(before, "x"), parse_histogram(after, "x"))
    assert delta["count"] == 3
    assert delta["mean_ms"] == pytest.approx(100.0)
    assert delta["p50_ms_at_most"] == pytest.approx(100.0)
