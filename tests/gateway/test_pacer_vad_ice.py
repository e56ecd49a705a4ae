"""Pacer schedule, VAD decisions and ICE policy, in isolation."""

import asyncio
import gc
import time

import numpy as np
import pytest

from voxgate.gateway.webrtc.ice import IcePolicy, parse_ice_server, parse_networks
from voxgate.gateway.media.pacer import FrameClock, IntervalRing, Pacer
from voxgate.gateway.caller.vad import VadSettings, VoiceActivityDetector


class FakeTime:
    """Time that moves only when the frame clock sleeps or the test advances it.

    With `hold` set, the clock's sleep does not end by itself: the test ends it.
    """

    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []
        self.hold: asyncio.Future | None = None

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    async def sleep(self, delay: float, interrupt: asyncio.Future) -> None:
        self.sleeps.append(delay)
        until = self.t + delay
        await asyncio.sleep(0)  # what is ready to run runs before time moves on
        if self.hold is not None:
            await asyncio.wait([self.hold, interrupt], return_when=asyncio.FIRST_COMPLETED)
        if not interrupt.done():
            self.t = max(self.t, until)


def pacer_on(fake: FakeTime) -> Pacer:
    return Pacer(clock=FrameClock(time_source=fake))


async def departures(pacer: Pacer, n: int, fake: FakeTime, work_s: float = 0.0) -> list[float]:
    out = []
    for _ in range(n):
        out.append(await pacer.wait())
        fake.advance(work_s)  # time spent sending the frame
    return out


async def test_pacer_departs_at_the_anchor_plus_whole_frames():
    fake = FakeTime()
    pacer = pacer_on(fake)
    sent = await departures(pacer, 30, fake, work_s=0.004)
    anchor = sent[0]
    # Work between frames does not push the schedule: nothing accumulates.
    assert sent == pytest.approx([anchor + k * 0.020 for k in range(30)], abs=1e-9)
    assert list(pacer.stats.intervals) == pytest.approx([0.020] * 29, abs=1e-9)
    assert pacer.stats.late_frames == pacer.stats.stalls == 0


async def test_one_clock_serves_every_track_on_its_own_phase():
    fake = FakeTime()
    clock = FrameClock(time_source=fake)
    pacers = [Pacer(clock=clock) for _ in range(3)]

    first = await pacers[0].wait()
    fake.advance(0.003)  # the next track starts 3 ms later: on the next 5 ms tick
    second = await pacers[1].wait()
    fake.advance(0.003)
    third = await pacers[2].wait()
    runs = await asyncio.gather(*(departures(p, 10, fake) for p in pacers))
    for start, sent in zip((first, second, third), runs):
        assert [b - a for a, b in zip([start] + sent, sent)] == pytest.approx([0.020] * 10, abs=1e-9)
    # Phases 5 ms apart on one grid, and one timer for all: 3 tracks x 10 frames took
    # one sleep per tick, never one per track.
    assert {round((sent[0] - runs[0][0]) * 1000) % 20 for sent in runs} == {0, 5, 10}
    assert clock.ticks < 3 * 10 + 10


async def test_pacer_counts_a_late_frame_and_keeps_its_schedule():
    fake = FakeTime()
    pacer = pacer_on(fake)
    sent = await departures(pacer, 3, fake)
    fake.advance(0.030)  # the loop was busy: the next frame is 10 ms late
    sent += await departures(pacer, 4, fake)
    anchor = sent[0]
    assert pacer.stats.late_frames == 1 and pacer.stats.stalls == 0
    assert sent[3] == pytest.approx(anchor + 0.070)  # due at +60 ms
    # The frames after it catch up with the original schedule, not a shifted one.
    assert sent[4:] == pytest.approx([anchor + k * 0.020 for k in range(4, 7)], abs=1e-9)


async def test_pacer_reanchors_after_a_stall_instead_of_bursting():
    fake = FakeTime()
    pacer = pacer_on(fake)
    sent = await departures(pacer, 3, fake)
    fake.advance(0.2)  # the event loop was blocked for ten frames
    sent += await departures(pacer, 5, fake)
    assert pacer.stats.stalls == 1
    # The late frame leaves at once and the schedule restarts from it: no catch-up burst.
    assert sent[3] == pytest.approx(sent[2] + 0.2)
    gaps = [b - a for a, b in zip(sent[3:], sent[4:])]
    assert min(gaps) >= 0.015 - 1e-9 and gaps[1:] == pytest.approx([0.020] * 3, abs=1e-9), gaps


async def test_pacer_wake_sends_the_next_frame_at_once_and_keeps_the_schedule():
    fake = FakeTime()
    pacer = pacer_on(fake)
    first = await pacer.wait()
    fake.hold = asyncio.get_running_loop().create_future()  # the next tick never comes by itself
    waiting = asyncio.ensure_future(pacer.wait())
    while not fake.sleeps:
        await asyncio.sleep(0)
    fake.advance(0.007)  # 7 ms into the 20 ms wait, an utterance's first audio is ready
    pacer.wake()
    woken = await asyncio.wait_for(waiting, 2.0)
    assert woken == pytest.approx(first + 0.007)
    assert pacer.stats.wakes == 1
    assert len(pacer.stats.intervals) == 0  # the early frame is not counted as jitter
    fake.hold.set_result(None)
    fake.hold = None
    after = await departures(pacer, 3, fake)
    # The schedule continues on the tick nearest a frame after the woken frame (the
    # 5 ms grid), then every 20 ms.
    assert 0.015 - 1e-9 <= after[0] - woken <= 0.020 + 1e-9, after[0] - woken
    assert [b - a for a, b in zip(after, after[1:])] == pytest.approx([0.020] * 2, abs=1e-9)
    pacer.wake()  # a wake while not sleeping applies to the next wait
    assert await asyncio.wait_for(pacer.wait(), 2.0) == pytest.approx(after[-1])
    assert pacer.stats.wakes == 2


async def test_pacer_really_waits_on_the_monotonic_clock():
    # One check on the real clock: 30 frames cannot leave in less than 29 frame
    # times. (A pacer that never slept sent them in about 0.12 s.)
    pacer = Pacer()
    t0 = time.monotonic()
    for _ in range(30):
        await pacer.wait()
    elapsed = time.monotonic() - t0
    assert elapsed >= 29 * 0.020 * 0.8, elapsed


def speech_16k() -> np.ndarray:
    from tests.speech import synthesize_48k

    return synthesize_48k("Hello, can you hear me talking right now?")[::3]


def run_vad(pcm: np.ndarray, **settings) -> list[str]:
    vad = VoiceActivityDetector(VadSettings(**settings))
    events = []
    for i in range(0, len(pcm), 320):
        events += vad.process(pcm[i : i + 320])
    return events


def test_interval_ring_keeps_the_newest_in_order():
    ring = IntervalRing(4)
    assert len(ring) == 0 and list(ring) == []
    for x in range(1, 7):
        ring.append(float(x))
    assert len(ring) == 4 and list(ring) == [3.0, 4.0, 5.0, 6.0]
    ring.clear()
    ring.append(9.0)
    assert list(ring) == [9.0]


def test_pacer_stats_give_the_garbage_collector_nothing_to_walk():
    # A full collection walks every referent of every tracked container while the
    # event loop waits; each session's minute of intervals must not be among them.
    pacer = Pacer()
    for _ in range(5000):
        pacer.stats.intervals.append(0.020)
    walked, seen, todo = 0, set(), [pacer.stats]
    while todo:  # every referent a collection visits from the stats down, types aside
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type) or not gc.is_tracked(obj):
            continue
        seen.add(id(obj))
        referents = gc.get_referents(obj)
        walked += len(referents)
        todo.extend(referents)
    assert len(pacer.stats.intervals) == 3000 and walked < 50, walked


def test_vad_fires_on_speech_and_settles_after():
    silence = np.zeros(16000, dtype=np.int16)
    events = run_vad(np.concatenate([silence, speech_16k(), silence]))
    assert events == ["speech.started", "speech.stopped"]


def test_vad_ignores_silence_and_steady_noise():
    rng = np.random.default_rng(0)
    assert run_vad(np.zeros(16000 * 3, dtype=np.int16)) == []
    hiss = (rng.standard_normal(16000 * 5) * 2000).astype(np.int16)
    hum = (np.sin(np.arange(16000 * 5) * 2 * np.pi * 120 / 16000) * 3000).astype(np.int16)
    assert run_vad(hiss, aggressiveness=3) == []
    assert run_vad(hum + hiss // 4, aggressiveness=3) == []


def test_vad_speech_still_detected_over_steady_noise():
    rng = np.random.default_rng(0)
    hiss = (rng.standard_normal(16000 * 4) * 300).astype(np.int16)
    speech = speech_16k()
    mixed = hiss.copy()
    mixed[16000 : 16000 + len(speech)] += speech
    assert run_vad(mixed)[:1] == ["speech.started"]


def test_vad_counts_voiced_frames_only_within_its_window():
    """Speech starts on min_speech_ms of voiced frames within twice that: a clicking
    microphone (one voiced frame in twenty, for a long time) never adds up to speech."""
    vad = VoiceActivityDetector(VadSettings(min_speech_ms=200))
    clicks = [vad._decide(i % 20 == 0) for i in range(20 * 30)]
    assert not any(clicks) and not vad.speaking
    events = [vad._decide(True) for _ in range(10)]
    assert events == [()] * 9 + [("speech.started",)]


def test_vad_levels_are_the_rms_of_the_frame_in_db():
    """On the scale the microphone's level gate uses (20 log10 of the int16 RMS)."""
    vad = VoiceActivityDetector()
    vad.process(np.full(320, 1000, dtype=np.int16))
    assert vad._floor_db == pytest.approx(60.0, abs=1e-6)
    square = VoiceActivityDetector()
    square.process(np.tile(np.array([3000, -3000], dtype=np.int16), 160))
    assert square._floor_db == pytest.approx(20 * np.log10(3000), abs=1e-6)


def test_vad_settings_are_validated():
    settings = VadSettings()
    with pytest.raises(ValueError):
        settings.update({"aggressiveness": 7})
    settings.update({"enabled": False, "min_speech_ms": 300})
    assert settings.enabled is False and settings.min_speech_ms == 300


def test_ice_policy_refuses_private_networks_by_default():
    policy = IcePolicy()
    assert policy.allows("8.8.8.8")
    for private in ("10.0.0.5", "192.168.1.10", "172.16.0.1", "127.0.0.1", "169.254.1.1", "host.local"):
        assert not policy.allows(private)
    loopback = IcePolicy(allowed_networks=parse_networks(["127.0.0.0/8"]), allow_public=False)
    assert loopback.allows("127.0.0.1") and not loopback.allows("8.8.8.8")


def test_ice_policy_filters_offer_candidates():
    sdp = "\r\n".join([
        "v=0", "m=audio 9 UDP/TLS/RTP/SAVPF 111",
        "a=candidate:1 1 udp 2122260223 127.0.0.1 50000 typ host",
        "a=candidate:2 1 udp 2122260223 192.168.1.7 50001 typ host",
        "a=candidate:3 1 udp 2122260223 abcd.local 50002 typ host",
    ]) + "\r\n"
    policy = IcePolicy(allowed_networks=parse_networks(["127.0.0.0/8"]), allow_public=False)
    filtered, dropped = policy.filter_sdp(sdp)
    assert dropped == 2 and "127.0.0.1" in filtered and "192.168" not in filtered and ".local" not in filtered


def test_ice_server_urls():
    server = parse_ice_server("turn:alice:s3cret@turn.example.com:3478?transport=udp")
    assert server.urls == "turn:turn.example.com:3478?transport=udp"
    assert server.username == "alice" and server.credential == "s3cret"
    with pytest.raises(ValueError, match="stun:"):
        parse_ice_server("http://nope")
    with pytest.raises(ValueError, match="CIDR"):
        parse_networks(["not a net"])


def test_gateway_uses_only_turn_servers_it_has_credentials_for():
    bare = IcePolicy(servers=[parse_ice_server("stun:stun.example.com:3478"), parse_ice_server("turn:turn.example.com:3478")])
    assert [s.urls for s in bare.rtc_configuration().iceServers] == ["stun:stun.example.com:3478"]
    minted = IcePolicy(servers=[parse_ice_server("turn:turn.example.com:3478")], turn_secret="s3cret", turn_ttl_s=60)
    [server] = minted.rtc_configuration("sess1").iceServers
    assert server.username.endswith(":sess1") and server.credential
    assert IcePolicy().rtc_configuration().iceServers == []  # never aiortc's public default
