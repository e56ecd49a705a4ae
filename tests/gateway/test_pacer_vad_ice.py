"""Pacer schedule, VAD decisions and ICE policy, in isolation."""

import asyncio
import time

import numpy as np
import pytest

from voxgate.gateway.ice import IcePolicy, parse_ice_server, parse_networks
from voxgate.gateway.pacer import Pacer
from voxgate.gateway.vad import VadSettings, VoiceActivityDetector


async def test_pacer_keeps_an_absolute_schedule_without_drift():
    pacer = Pacer()
    await pacer.wait()
    anchor = pacer._deadline - pacer.frame_s
    for n in range(1, 30):
        await pacer.wait()
        await asyncio.sleep(0.004)  # work between frames must not push the schedule
        # Deadlines are the anchor plus whole frames: nothing accumulates.
        assert pacer._deadline == pytest.approx(anchor + (n + 1) * pacer.frame_s, abs=1e-9)
    assert pacer.stats.frames == 30 and pacer.stats.stalls == 0


async def test_pacer_reanchors_after_a_stall_instead_of_bursting():
    pacer = Pacer()
    for _ in range(3):
        await pacer.wait()
    time.sleep(0.2)  # the event loop is blocked for ten frames
    departure = await pacer.wait()
    assert pacer.stats.stalls == 1
    # The schedule restarts from the late frame: the next one is a whole frame later,
    # not ten frames already overdue (which would be a catch-up burst).
    assert pacer._deadline == pytest.approx(departure + pacer.frame_s, abs=1e-9)


def speech_16k() -> np.ndarray:
    from tests.speech import synthesize_48k

    return synthesize_48k("Hello, can you hear me talking right now?")[::3]


def run_vad(pcm: np.ndarray, **settings) -> list[str]:
    vad = VoiceActivityDetector(VadSettings(**settings))
    events = []
    for i in range(0, len(pcm), 320):
        events += vad.process(pcm[i : i + 320])
    return events


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


async def test_pacer_wake_sends_the_next_frame_at_once_and_keeps_the_schedule():
    pacer = Pacer(frame_s=5.0)  # a tick far longer than the test: only a wake can end the wait
    await pacer.wait()
    asyncio.get_running_loop().call_later(0.02, pacer.wake)
    woken = await asyncio.wait_for(pacer.wait(), 2.0)
    assert pacer.stats.wakes == 1
    assert pacer._deadline == pytest.approx(woken + pacer.frame_s, abs=1e-9)  # re-anchored at the woken frame
    assert len(pacer.stats.intervals) == 0  # the early frame is not counted as jitter
    pacer.wake()  # a wake while not sleeping applies to the next wait
    await asyncio.wait_for(pacer.wait(), 2.0)
    assert pacer.stats.wakes == 2

