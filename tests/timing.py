"""Which tests run serially, with the machine to themselves, and which run side by side.

scripts/test.sh runs the suite in two parts: `pytest -n N -m "not timing"` (pytest-xdist
worker processes side by side), then `pytest -m timing` alone. A test belongs to the
serial part when what it asserts depends on how fast the machine serves it: a latency
bound, a ratio of two timings, late frames, gaps, loop lag, first-audio ratios, a
barge-in window, a capacity or budget measured on the spot, or the watchdog's bound.
Such a test would only measure its neighbours under xdist. tests/conftest.py marks
them `timing` from this list (a folder ending in "/", a module, or one test).

`GROUPS` keeps together, on one worker, tests that share one heavy or single-instance
fixture across modules (session or package scope): the rest are grouped by module, so
a module's fixtures are set up once.
"""

from __future__ import annotations

SERIAL: tuple[str, ...] = (
    # Latency bounds and ratios of timings
    "tests/backend/test_client.py::test_first_clause_goes_at_once_then_batches",  # coalescing by arrival time
    "tests/backend/test_openai_bridge.py",  # three calls; the gateway refuses calls on loop lag
    "tests/backend/test_sessions_api.py::test_text_before_the_listener_attaches_is_queued",  # ttfa < wait
    "tests/bench/test_gpu_check.py::test_gpu_check_sh_on_cpu_with_small_counts",  # RTF < 1, section budgets
    "tests/engine/test_overload.py",  # ttfa p95 with and without holding newcomers
    "tests/engine/test_unit_cap.py",  # first audio alone against loaded, a ratio
    "tests/engine/test_worker.py::test_a_hung_worker_is_killed_within_its_bound_and_restarts",  # watchdog bound
    "tests/engine/test_worker.py::test_piper_worker_streams_the_real_voice_and_a_new_stream_is_not_starved",
    "tests/gateway/test_resilience.py::test_a_hung_worker_is_restarted_within_its_bound",
    "tests/gateway/test_admission.py::test_the_budget_is_measured_on_the_real_voice",  # a cost measured here
    "tests/gateway/test_encode_pool.py",  # jobs per loop iteration within a time budget
    "tests/gateway/test_metrics.py::test_engine_first_chunk_counts_engine_time_not_the_wait_for_a_listener",
    "tests/gateway/test_pacer_vad_ice.py::test_pacer_",  # departures on the monotonic clock, late frames
    "tests/gateway/test_track.py",  # late frames of the real pacer
    "tests/gateway/test_stt_pocketsphinx.py",  # loop stall against decode time
    "tests/gateway/test_stt_whisper.py",
    "tests/http/test_openai_speech.py",  # first byte against a session's first audio, a ratio
    "tests/http/test_tts_ws.py::test_a_token_stream_at_30_per_second_is_heard_before_its_text_ends_with_words_on_the_audio_clock",
    "tests/integrations/",  # first-audio figures; durations and word spreads on the wall clock
    "tests/pool/",  # Ray: a cluster start takes both cores; deadlines and capacity measured
    "tests/probe/test_probe.py",  # interrupt to silence, frame gaps
    "tests/security/test_http_guard.py",  # closes within seconds
    "tests/security/test_late_frames_blame.py",  # late frames measured on the spot
    "tests/security/test_loop_responsive.py",  # /healthz stall bound
    "tests/security/test_silent_output.py",  # real-time playout against elapsed time
    "tests/security/test_silent_peer.py",
    "tests/security/test_speech_slots.py",  # slots freed within a deadline
    "tests/security/test_tts_limits.py",  # break time on the wall clock
    "tests/security/test_twilio_hardening.py",  # log lines per elapsed second
    # Failed side by side on a loaded machine (load average 9-15 on 2 cores, four other suites running):
    "tests/engine/test_deadlines.py",  # the order of steps follows wall-clock deadlines
    "tests/gateway/test_peer.py::test_between_utterances_a_listener_that_asks_gets_keepalives_and_then_exact_speech",
    "tests/gateway/test_speech.py::test_speak_plays_the_real_voice_for_its_full_duration",  # heard <= audio + 100 ms
    "tests/backend/test_caller_audio_ws.py",  # frames placed on the session clock
    "tests/backend/test_stt_url.py",  # stt_timeout against a stand-in's delay
    "tests/backend/test_transcripts.py",  # a real-time microphone; spans on the session clock
    "tests/telephony/test_twilio_transcripts.py",
    "tests/relay/test_relay_example.py",  # the caller's turn within the VAD's window
    "tests/web/test_turn_server.py",  # first audio through coturn; refused on loop lag side by side
    "tests/web/test_first_hour.py",  # a browser's offer refused 503 on loop lag (107 ms) side by side, a fresh-clone run
    # Barge-in windows and echo: speech against real-time playout
    "tests/gateway/test_barge_in.py",
    "tests/gateway/test_echo.py",
    "tests/relay/test_relay_webrtc.py",
    "tests/telephony/test_twilio.py",
    "tests/telephony/test_twilio_echo.py",
    "tests/telephony/test_twilio_listening.py",  # a stalled backend catches up within a deadline
    # The browser's playout: audible time against audio time, packet loss concealed
    "tests/web/test_page.py",
    "tests/web/test_network.py",
    # The voice's audio depends on how its steps were windowed, which follows the machine's speed: frame counts
    # to speech moved by one side by side (a fresh-clone run, 13 against a bound of 14).
    "tests/gateway/test_mic.py::test_speech_after_gated_silence_is_heard_as_soon_as_after_decoded_silence",
)

# Tests in these folders share session- or package-scoped servers (one Redis, one gateway set, one
# report file): one worker runs each folder.
GROUPS: tuple[str, ...] = ("tests/fleet/", "tests/integrations/", "tests/pool/")


def is_serial(nodeid: str) -> bool:
    return any(_covers(prefix, nodeid) for prefix in SERIAL)


def group_of(nodeid: str) -> str:
    """The xdist group: a shared folder's, or the module's."""
    for folder in GROUPS:
        if nodeid.startswith(folder):
            return folder
    return nodeid.split("::", 1)[0]


def _covers(prefix: str, nodeid: str) -> bool:
    if prefix.endswith(("/", "_")):
        return nodeid.startswith(prefix)
    return nodeid == prefix or nodeid.startswith(prefix + "::") or nodeid.startswith(prefix + "[")


def serial_paths() -> list[str]:
    """The modules and folders that hold the serial tests: scripts/test.sh collects only these for them."""
    return sorted({prefix.split("::", 1)[0] for prefix in SERIAL})


if __name__ == "__main__":
    print(" ".join(serial_paths()))
