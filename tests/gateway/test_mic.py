"""The microphone reader: RTP packets to 16 kHz PCM for the VAD, gaps as silence, nothing decoded when unwanted."""

import asyncio
import inspect
import itertools
import struct

import numpy as np
import pytest
from aiortc.rtp import RtpPacket

from voxgate.gateway.media import opus
from voxgate.gateway.media.encoder import ulaw_encode
from voxgate.gateway.caller.mic import FULL_SCALE_DB, QUIET_DBOV, Microphone
from voxgate.gateway.caller.vad import VadSettings, VoiceActivityDetector
from tests.speech import synthesize_48k

PT = 111


class Receiver:
    """Stands in for aiortc's RTCRtpReceiver: only the packet handler the DTLS transport calls."""

    async def _handle_rtp_packet(self, packet, arrival_time_ms: int) -> None:  # pragma: no cover - replaced
        raise AssertionError("aiortc's own handler must not see the packets")


def opus_packets(pcm48k: np.ndarray) -> list[bytes]:
    encoder = opus.Encoder(48000, 32000, 5, False, 0, False)
    n = len(pcm48k) // 960 * 960
    return encoder.encode(pcm48k[:n])


def rtp(payload: bytes, seq: int, ts: int, pt: int = PT) -> RtpPacket:
    packet = RtpPacket(payload_type=pt, sequence_number=seq, timestamp=ts)
    packet.payload = payload
    return packet


class Recorder:
    def __init__(self, wanted: bool = True) -> None:
        self.pcm: list[np.ndarray] = []
        self.capture_ms: list[float] = []
        self.gaps: list[int] = []
        self.gap_levels: list[float | None] = []
        self.wanted = wanted

    def audio(self, pcm: np.ndarray, capture_ms: float) -> None:
        self.pcm.append(pcm)
        self.capture_ms.append(capture_ms)

    def gap(self, frames: int, level_db: float | None = None) -> None:
        self.gaps.append(frames)
        self.gap_levels.append(level_db)

    def mic(self, codec: str = "opus") -> Microphone:
        # A clock ten seconds on at every reading: these tests are not about the packet and RTP-time bounds.
        mic = Microphone(codec, PT, self.audio, self.gap, lambda: self.wanted, now=itertools.count(0.0, 10.0).__next__)
        receiver = Receiver()
        mic.attach(receiver)
        self.handle = receiver._handle_rtp_packet
        return mic


async def test_opus_is_decoded_straight_to_16k_and_keeps_the_speech():
    speech = synthesize_48k("Hello, can you hear me talking right now?")
    rec = Recorder()
    mic = rec.mic()
    for i, payload in enumerate(opus_packets(speech)):
        await rec.handle(rtp(payload, i, 1000 + i * 960), 0)
    pcm = np.concatenate(rec.pcm)
    assert all(len(p) == 320 for p in rec.pcm) and rec.gaps == []
    assert mic.decoded == mic.packets == len(rec.pcm)
    # The VAD hears it as speech, as it would the 48 kHz stereo decode resampled.
    vad = VoiceActivityDetector(VadSettings())
    events = vad.process(np.concatenate([np.zeros(16000, np.int16), pcm, np.zeros(16000, np.int16)]))
    assert events == ["speech.started", "speech.stopped"]


async def test_dtx_gaps_reach_the_vad_as_frames_of_silence_and_old_packets_are_dropped():
    payloads = opus_packets(np.zeros(960 * 10, dtype=np.int16))
    rec = Recorder()
    rec.mic()
    await rec.handle(rtp(payloads[0], 1, 0), 0)
    await rec.handle(rtp(payloads[1], 2, 960 * 21), 0)  # DTX: 20 frames were not sent
    await rec.handle(rtp(payloads[2], 3, 960 * 5), 0)  # reordered, older than what was heard
    await rec.handle(rtp(payloads[3], 4, 960 * 22), 0)
    assert rec.gaps == [20] and len(rec.pcm) == 3


async def test_nothing_is_decoded_while_unwanted_and_other_payload_types_are_ignored():
    payloads = opus_packets(np.zeros(960 * 3, dtype=np.int16))
    rec = Recorder(wanted=False)
    mic = rec.mic()
    await rec.handle(rtp(payloads[0], 1, 0), 0)
    assert mic.packets == 1 and mic.decoded == 0 and rec.pcm == []
    rec.wanted = True
    await rec.handle(rtp(b"\x01\x02", 2, 960, pt=13), 0)  # comfort noise
    await rec.handle(rtp(payloads[1], 3, 960), 0)
    assert mic.decoded == 1 and len(rec.pcm) == 1


async def test_g711_is_decoded_and_brought_to_16k():
    tone = (np.sin(np.arange(8000) * 2 * np.pi * 440 / 8000) * 8000).astype(np.int16)
    rec = Recorder()
    rec.mic("pcmu")
    for i in range(0, 8000, 160):
        await rec.handle(rtp(ulaw_encode(tone[i : i + 160]), i // 160, i), 0)
    pcm = np.concatenate(rec.pcm)
    assert 14500 <= len(pcm) <= 16000  # less the resampler's delay
    spectrum = np.abs(np.fft.rfft(pcm[2000:14000].astype(np.float64)))
    assert abs(np.argmax(spectrum) * 16000 / 12000 - 440) < 5


async def test_packets_quieter_than_the_gate_by_their_own_level_are_silence_not_decoded():
    """RFC 6464: browsers send each packet's level; quiet ones skip the decoder and reach the
    VAD as silence, loud ones, ones flagged as voice and ones without a level are decoded."""
    speech = opus_packets(synthesize_48k("Hello there, how are you?"))
    rec = Recorder()
    mic = rec.mic()
    quiet, loud, flagged, unmarked = (rtp(speech[i], i, i * 960) for i in range(4))
    quiet.extensions.audio_level = (False, QUIET_DBOV)
    loud.extensions.audio_level = (False, QUIET_DBOV - 30)
    flagged.extensions.audio_level = (True, 127)  # the sender's own VAD says voice
    for packet in (quiet, loud, flagged, unmarked):
        await rec.handle(packet, 0)
    assert mic.gated == 1 and mic.decoded == 3 and len(rec.pcm) == 3
    assert rec.gaps == [1]  # the quiet packet, as one frame of silence
    assert rec.gap_levels[0] == pytest.approx(FULL_SCALE_DB - QUIET_DBOV)  # its level, for the VAD's floor
    # The timeline stays whole: a quiet 20 ms packet followed by the next is not a gap.
    again = rtp(speech[4], 4, 4 * 960)
    again.extensions.audio_level = (False, 127)
    await rec.handle(again, 0)
    await rec.handle(rtp(speech[5], 5, 5 * 960), 0)
    assert rec.gaps == [1, 1] and mic.gated == 2 and mic.decoded == 4


async def test_a_backend_taking_the_audio_gets_quiet_packets_decoded_and_placed_on_the_session_clock():
    from voxgate.gateway.media.clock import SessionClock

    payloads = opus_packets(np.zeros(960 * 3, dtype=np.int16))
    rec = Recorder()
    clock = SessionClock()
    mic = Microphone("opus", PT, rec.audio, rec.gap, lambda: True, whole=lambda: True, clock=clock)
    mic.attach(Receiver())
    for i, payload in enumerate(payloads):
        packet = rtp(payload, i, 90000 + i * 960)
        packet.extensions.audio_level = (False, 127)  # silent by its own word
        before = clock.ms()
        await mic._on_rtp(packet)
        # Its first sample was captured 20 ms (and Opus's look-ahead) before it arrived.
        assert before - 20 - 6.5 - 1 <= rec.capture_ms[-1] <= clock.ms() - 20 - 6.5
    assert mic.gated == 0 and mic.decoded == 3 and rec.gaps == []


async def test_a_gated_packet_counts_for_its_own_length():
    """A 60 ms Opus packet is three frames of silence, and the packet after a 10 ms one is not
    taken for an old one."""
    rec = Recorder()
    mic = rec.mic()
    long_packet = opus.Encoder(48000, 32000, 0, False, 0, False)
    long_packet.frame_samples = 2880  # one 60 ms packet
    (sixty,) = long_packet.encode(np.zeros(2880, dtype=np.int16))
    short = opus.Encoder(48000, 32000, 0, False, 0, False)
    short.frame_samples = 480  # 10 ms packets
    ten = short.encode(np.zeros(960, dtype=np.int16))
    first = rtp(sixty, 1, 0)
    first.extensions.audio_level = (False, 127)
    await rec.handle(first, 0)
    second = rtp(ten[0], 2, 2880)
    second.extensions.audio_level = (False, 127)
    await rec.handle(second, 0)
    await rec.handle(rtp(ten[1], 3, 2880 + 480), 0)  # right after the 10 ms packet
    assert rec.gaps == [3, 1] and mic.gated == 2 and mic.decoded == 1


async def test_g711_packets_are_gated_for_their_own_length():
    rec = Recorder()
    mic = rec.mic("pcmu")
    quiet = rtp(ulaw_encode(np.zeros(240, dtype=np.int16)), 1, 0, pt=PT)  # 30 ms
    quiet.extensions.audio_level = (False, 100)
    await rec.handle(quiet, 0)
    await rec.handle(rtp(ulaw_encode(np.zeros(160, dtype=np.int16)), 2, 240, pt=PT), 0)
    assert mic.gated == 1 and rec.gaps == [2] and mic.decoded == 1


def _frames_to_speech(vad: VoiceActivityDetector, pcm16k: np.ndarray) -> int | None:
    for i in range(0, len(pcm16k) - 319, 320):
        if "speech.started" in vad.process(pcm16k[i : i + 320]):
            return i // 320
    return None


def test_speech_after_gated_silence_is_heard_as_soon_as_after_decoded_silence():
    """The gate passes quiet packets over, but their level still sets the VAD's noise floor:
    without it the floor started at the first speech frame, and barge-in took a second
    longer (the probe's voice barge-in went from under 1 s to 1.6 s)."""
    rng = np.random.default_rng(5)
    room = np.clip(rng.normal(0, 20, 16000), -32768, 32767).astype(np.int16)  # about -64 dBov
    speech = synthesize_48k("Stop, wait a moment please.")[::3].astype(np.int16)  # 16 kHz
    room_dbov = 20 * np.log10(np.sqrt(np.mean(room.astype(np.float64) ** 2)) / 32767)

    decoded = VoiceActivityDetector(VadSettings())
    decoded.process(room)
    gated = VoiceActivityDetector(VadSettings())
    gated.skip(50, FULL_SCALE_DB + room_dbov)
    unleveled = VoiceActivityDetector(VadSettings())
    unleveled.skip(50)

    after_decoded = _frames_to_speech(decoded, speech)
    after_gated = _frames_to_speech(gated, speech)
    assert after_decoded is not None and after_gated is not None
    assert abs(after_gated - after_decoded) <= 1
    late = _frames_to_speech(unleveled, speech)
    assert late is None or late >= after_decoded + 3  # what the floor's level saves


async def test_a_real_peers_microphone_is_read_from_its_datagrams_not_aiortcs_queue():
    """In-process gateway and aiortc peer on loopback: the microphone's packets reach the VAD
    through the direct path (aiortc's packet handler sees none), the data channel and RTCP still
    go through aiortc, and speech on the microphone is heard (speech.started)."""
    from tests.conftest import in_process_gateway
    from voxgate.rtc_client import RtcClient

    async with in_process_gateway() as (app, url):
        async with RtcClient(url, mic=True) as client:
            mic = app["gateway"].peers[client.session_id].mic
            via_aiortc = []
            aiortc_handler = mic._on_rtp
            mic_receiver = next(t.receiver for t in app["gateway"].peers[client.session_id].pc.getTransceivers())

            async def counted(packet, arrival_time_ms: int = 0) -> None:
                via_aiortc.append(packet)
                await aiortc_handler(packet, arrival_time_ms)

            mic_receiver._handle_rtp_packet = counted
            # RTCP (the listener's receiver reports) must still reach aiortc's sender.
            sender = next(t.sender for t in app["gateway"].peers[client.session_id].pc.getTransceivers())
            reported = asyncio.Event()
            rtcp_handler = sender._handle_rtcp_packet

            async def report_seen(packet) -> None:
                reported.set()
                await rtcp_handler(packet)

            sender._handle_rtcp_packet = report_seen
            client.mic.play(synthesize_48k("Hello there, can you hear me now?"))
            await client.wait_for("speech.started", timeout=15)
            client.send({"type": "ping", "t": 1})
            await client.wait_for("pong", timeout=5)  # the data channel still goes through aiortc
            await asyncio.wait_for(reported.wait(), 15)
            assert mic.direct and mic.decoded > 0 and via_aiortc == []
            # aioice would parse each of them as STUN first (RFC 7983: they never are).
            connection = mic_receiver.transport.transport._connection
            assert connection._protocols and all(
                inspect.unwrap(p.datagram_received).__qualname__.startswith("_demultiplex.") for p in connection._protocols)


def header_extensions(*uris: str):
    from aiortc.rtcrtpparameters import RTCRtpHeaderExtensionParameters, RTCRtpParameters
    from aiortc.rtp import HeaderExtensionsMap

    m = HeaderExtensionsMap()
    m.configure(RTCRtpParameters(headerExtensions=[RTCRtpHeaderExtensionParameters(id=i + 1, uri=u) for i, u in enumerate(uris)]))
    return m


@pytest.mark.parametrize("csrcs", [[], [1, 2, 3]])
@pytest.mark.parametrize("level", [None, (False, 127), (True, 30)])
@pytest.mark.parametrize("padding", [0, 1, 7])
def test_parse_rtp_reads_what_aiortcs_parser_reads(csrcs, level, padding):
    from voxgate.gateway.caller.mic import parse_rtp

    ext_map = header_extensions("urn:ietf:params:rtp-hdrext:sdes:mid", "urn:ietf:params:rtp-hdrext:ssrc-audio-level")
    packet = RtpPacket(payload_type=PT, sequence_number=7, timestamp=0xFEDCBA98, ssrc=5, marker=1, payload=b"\xf8opus")
    packet.csrc = csrcs
    packet.padding_size = padding
    packet.extensions.mid = "0"
    packet.extensions.audio_level = level
    data = packet.serialize(ext_map)
    theirs = RtpPacket.parse(data, ext_map)
    ours = parse_rtp(data)
    assert (ours.payload_type, ours.timestamp, ours.payload) == (theirs.payload_type, theirs.timestamp, theirs.payload)
    assert (ext_map.get(*ours.extension).audio_level if ours.extension else None) == theirs.extensions.audio_level


@pytest.mark.parametrize("data", [b"", b"\x80" * 11, b"\x40" + b"\x00" * 20, b"\x90" + b"\x00" * 13,
                                  b"\x90\x6f" + b"\x00" * 10 + b"\xbe\xde\x00\x09", b"\xa0\x6f" + b"\x00" * 10 + b"\x00\x00\x05",
                                  b"\xa0\x6f" + b"\x00" * 10 + b"\x00"])
def test_parse_rtp_refuses_what_aiortc_refuses(data):
    from voxgate.gateway.caller.mic import parse_rtp

    with pytest.raises(ValueError):
        RtpPacket.parse(data)
    assert parse_rtp(data) is None


class FakeConnection:
    """aioice's Connection as the microphone sees it: what is not taken goes to aiortc's queue."""

    def __init__(self) -> None:
        self.to_aiortc: list[bytes] = []

    def data_received(self, data: bytes, component: int) -> None:
        self.to_aiortc.append(data)


def srtp_pair():
    import os

    from pylibsrtp import Policy, Session

    key = os.urandom(30)
    tx = Session(Policy(key=key, ssrc_type=Policy.SSRC_ANY_OUTBOUND, srtp_profile=Policy.SRTP_PROFILE_AES128_CM_SHA1_80))
    rx = Session(Policy(key=key, ssrc_type=Policy.SSRC_ANY_INBOUND, srtp_profile=Policy.SRTP_PROFILE_AES128_CM_SHA1_80))
    return tx, rx


def test_hostile_datagrams_never_raise_out_of_the_direct_path(caplog):
    """Empty, oversized, undecryptable or unparsable datagrams are dropped, a failing handler is
    logged once, and DTLS and RTCP still go to aiortc: nothing reaches asyncio's datagram callback."""
    from types import SimpleNamespace

    tx, rx = srtp_pair()
    connection = FakeConnection()
    dtls = SimpleNamespace(transport=SimpleNamespace(_connection=connection), _rx_srtp=rx,
                           _rtp_header_extensions_map=header_extensions("urn:ietf:params:rtp-hdrext:ssrc-audio-level"),
                           _RTCDtlsTransport__rx_bytes=0, _RTCDtlsTransport__rx_packets=0,
                           _handle_rtcp_data=lambda data: None)
    rec = Recorder()
    mic = Microphone("opus", PT, rec.audio, rec.gap, lambda: True)
    mic.attach(SimpleNamespace(_handle_rtp_packet=None, transport=dtls))
    assert mic.direct
    receive = connection.data_received  # the microphone's wrapper now
    payload = opus_packets(np.zeros(960, dtype=np.int16))[0]
    good = tx.protect(rtp(payload, 1, 960).serialize())
    dtls_record = b"\x17\xfe\xfd" + b"\x00" * 30
    rtcp = b"\x81\xc9\x00\x07" + b"\x00" * 28  # from SSRC 0, learnt from the bad-level packet
    # An audio-level element two bytes long (it is one): aiortc's own parse raises struct.error.
    bad_level = b"\x90\x6f\x00\x09" + (960).to_bytes(4, "big") + b"\x00\x00\x00\x00" + b"\xbe\xde\x00\x01\x11\x00\x00\x00" + payload
    for data in (b"", b"\x80" * 3000, b"\x80" * 40, good[:-1] + bytes([good[-1] ^ 1]), tx.protect(bad_level)):
        receive(data, 1)  # dropped without raising
    assert mic.packets == 0 and connection.to_aiortc == []
    receive(dtls_record, 1)
    receive(rtcp, 1)
    assert connection.to_aiortc == [dtls_record, rtcp]
    receive(good, 1)
    assert mic.decoded == 1 and len(rec.pcm) == 1
    assert dtls._RTCDtlsTransport__rx_packets == 2  # the bad-level packet decrypted, then was dropped

    def broken(pcm) -> None:
        raise RuntimeError("a bug downstream")

    mic.on_audio = broken
    for seq in (2, 3):
        receive(tx.protect(rtp(payload, seq, 960 * seq).serialize()), 1)
    assert mic.failures == 2 and caplog.text.count("microphone packet handling failed") == 1


def _level_blocks():
    """Header-extension blocks, well and badly formed, in both layouts (RFC 8285)."""
    import random

    rng = random.Random(6464)
    blocks = [(0xBEDE, b""), (0xBEDE, b"\x10\x85\x00\x00"), (0xBEDE, b"\x00\x10\x05\x10\x7f"),
              (0xBEDE, b"\x11\x05\x00\x00"), (0xBEDE, b"\x12"), (0xBEDE, b"\x30\x01\x10\x85"),
              (0x1000, b"\x01\x01\x85\x00"), (0x1000, b"\x01\x02\x85\x00"), (0x1000, b"\x01"),
              (0x1000, b"\x03\x05\x00"), (0x1234, b"\x10\x85\x00\x00")]
    for _ in range(400):
        profile = rng.choice((0xBEDE, 0x1000))
        blocks.append((profile, bytes(rng.choice((0, 1, 0x10, 0x20, 0x85, rng.randrange(256))) for _ in range(rng.randrange(9)))))
    return blocks


@pytest.mark.parametrize("level_id", [1, 2])
def test_the_level_is_read_as_aiortcs_map_reads_it(level_id):
    """The microphone's own reading of the audio level: the same level as aiortc's
    HeaderExtensionsMap.get, and a refusal wherever it refuses, over 411 blocks."""
    from voxgate.gateway.caller.mic import level_reader

    uris = ["urn:example:not-read", "urn:ietf:params:rtp-hdrext:ssrc-audio-level"]
    ext_map = header_extensions(*(uris if level_id == 2 else uris[::-1]))
    read = level_reader(ext_map)
    levels = refusals = 0
    for profile, block in _level_blocks():
        try:
            theirs = ext_map.get(profile, block).audio_level
        except (ValueError, IndexError, struct.error):
            refusals += 1
            with pytest.raises(ValueError):
                read(profile, block)
            continue
        assert read(profile, block) == theirs, (profile, block)
        levels += theirs is not None
    assert levels > 10 and refusals > 20


def test_the_level_is_read_without_aiortcs_unpack():
    """Red when an aiortc upgrade renames the map's ids: the reader would fall back to get()."""
    from voxgate.gateway.caller.mic import level_reader

    ext_map = header_extensions("urn:ietf:params:rtp-hdrext:ssrc-audio-level")

    def unpacked(*args):
        raise AssertionError("aiortc's HeaderExtensionsMap.get was used")

    ext_map.get = unpacked
    assert level_reader(ext_map)(0xBEDE, b"\x10\x85\x00\x00") == (True, 5)


def test_the_level_follows_the_map_configured_after_the_reader_is_made():
    """aiortc configures the map once the connection is up, after the microphone attached."""
    from aiortc.rtcrtpparameters import RTCRtpHeaderExtensionParameters, RTCRtpParameters
    from aiortc.rtp import HeaderExtensionsMap

    from voxgate.gateway.caller.mic import level_reader

    ext_map = HeaderExtensionsMap()
    read = level_reader(ext_map)
    assert read(0xBEDE, b"\x30\x85\x00\x00") is None
    ext_map.configure(RTCRtpParameters(headerExtensions=[
        RTCRtpHeaderExtensionParameters(id=3, uri="urn:ietf:params:rtp-hdrext:ssrc-audio-level")]))
    assert read(0xBEDE, b"\x30\x85\x00\x00") == (True, 5)


def test_rtp_and_rtcp_skip_aioices_stun_parse_and_the_rest_does_not():
    from types import SimpleNamespace

    from voxgate.gateway.media.rtc_internals import _demultiplex

    to_aioice, direct = [], []
    protocol = SimpleNamespace(local_candidate=SimpleNamespace(component=1))
    protocol.datagram_received = lambda data, addr: to_aioice.append(data)
    _demultiplex(protocol, lambda data, component: direct.append((data, component)))
    stun, dtls, rtp_data, rtcp = b"\x00\x01" + b"\x00" * 18, b"\x16\xfe\xfd", b"\x80\x6f" + b"\x00" * 10, b"\x81\xc9\x00\x01"
    for data in (stun, dtls, rtp_data, rtcp, b"", b"\xc0", b"\x7f\x00", b"\xbf\x00"):
        protocol.datagram_received(data, ("127.0.0.1", 9))
    assert direct == [(rtp_data, 1), (rtcp, 1), (b"\xbf\x00", 1)]
    assert to_aioice == [stun, dtls, b"", b"\xc0", b"\x7f\x00"]
    rtcp_component = SimpleNamespace(local_candidate=SimpleNamespace(component=2), datagram_received=to_aioice.append)
    _demultiplex(rtcp_component, lambda data, component: direct.append((data, component)))
    rtcp_component.datagram_received(rtcp, ("127.0.0.1", 9))
    assert direct[-1] == (rtcp, 2)
