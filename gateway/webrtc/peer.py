"""The WebRTC side of a session: peer connection, data channel, speech track, microphone."""

from __future__ import annotations

import asyncio
import json
import logging
import re

from aiortc import RTCPeerConnection, RTCSessionDescription

from ...config import Settings

from ..media.rtc_internals import SessionDescription, candidate_from_sdp
from .ice import MAX_REMOTE_CANDIDATES, IcePolicy, guard_ice, remote_candidate_count
from .silence import PeerSilence
from ..media import fec, rtc_internals, rtp_send
from ..caller.mic import Microphone
from ..load.mic_charge import MicCharge
from ..media.ssrcs import SsrcLimit, offered_ssrcs
from ..sessions.session import Session
from ..errors import GatewayError
from ..media.track import SilentOutput, SpeechTrack

log = logging.getLogger(__name__)

SUPPORTED_CODECS = ("opus", "pcmu", "pcma")


def validate_offer_sdp(sdp: str) -> None:
    if "m=audio" not in sdp and "m=application" not in sdp:
        raise GatewayError("invalid_sdp", "the offer has no audio or data-channel media section")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:
        raise GatewayError("invalid_sdp", f"the offer SDP could not be parsed: {type(exc).__name__}") from None
    audio = sum(1 for media in parsed.media if media.kind == "audio")
    if audio > 1:
        # Speech out and the microphone in share one audio section (mic.py reads its packets by payload type).
        raise GatewayError("invalid_sdp", f"the offer has {audio} audio sections: offer one, for speech and the microphone")
    # Bundled WebRTC needs a mid per section; aiortc half-builds a peer without one.
    for media in parsed.media:
        if not media.rtp.muxId:
            raise GatewayError("invalid_sdp", f"the offer's {media.kind} section has no a=mid line")


def negotiated_codec(answer_sdp: str) -> tuple[str, int] | None:
    """The codec the answer chose for audio, and its payload type: its first one."""
    desc = SessionDescription.parse(answer_sdp)
    for media in desc.media:
        if media.kind == "audio" and media.rtp.codecs:
            codec = media.rtp.codecs[0]
            if codec.payloadType is not None:  # always, in a parsed answer
                return codec.mimeType.split("/")[-1].lower(), codec.payloadType
    return None


def _audio_section(sdp: str) -> tuple[int, int]:
    """Where the first audio m-section's lines are: payload type numbers are per section."""
    start = re.search(r"(?m)^m=audio ", sdp)
    if start is None:
        return 0, 0
    end = re.compile(r"(?m)^m=").search(sdp, start.end())
    return start.start(), end.start() if end else len(sdp)


def asks_for_dtx(offer_sdp: str, payload_type: int) -> bool:
    """Whether the offer's audio format line for `payload_type` says `usedtx=1`: its decoder
    prefers DTX (RFC 7587), so a gap between utterances is what it expects."""
    start, end = _audio_section(offer_sdp)
    match = re.compile(rf"(?m)^a=fmtp:{payload_type} ([^\r\n]*)").search(offer_sdp, start, end)
    if match is None:
        return False
    params = (p.split("=", 1) for p in match.group(1).split(";"))
    return any(len(p) == 2 and p[0].strip().lower() == "usedtx" and p[1].strip() == "1" for p in params)


def ask_for_dtx(sdp: str, payload_type: int) -> str:
    """Add `usedtx=1` to the audio section's format line for `payload_type` (a line of its own
    after the codec's rtpmap where there is none, as in aiortc's SDP). In the gateway's answer,
    the peer's encoder then sends a packet every 400 ms while its microphone is silent,
    instead of every 20 ms; in a client's offer, the gateway does so between utterances."""
    start, end = _audio_section(sdp)
    section = sdp[start:end]

    def add(match: re.Match) -> str:
        line = match.group(0)
        return line if "usedtx=" in line else line + ";usedtx=1"

    section, found = re.subn(rf"(?m)^a=fmtp:{payload_type} [^\r\n]*", add, section, count=1)
    if not found:
        section = re.sub(rf"(?m)^(a=rtpmap:{payload_type} [^\r\n]*)(\r?\n)", rf"\1\2a=fmtp:{payload_type} usedtx=1\2",
                         section, count=1)
    return sdp[:start] + section + sdp[end:]


# Events a peer's data channel is sent on opening, at most: an utterance's start, its first audio, a
# connection state or two, with room to spare.
EARLY_EVENTS = 64


def _transport_up(channel) -> bool:
    """Whether the DTLS transport under a data channel can still send."""
    dtls = getattr(channel.transport, "transport", None)
    return dtls is None or dtls.state == "connected"


class PeerConnection:
    """Binds one RTCPeerConnection to one Session."""

    def __init__(self, session: Session, ice: IcePolicy, *, rtp_sender: str = "voxgate",
                 max_ssrcs: int = Settings.max_ssrcs,
                 mic_max_packets_per_s: float = Settings.mic_max_packets_per_s,
                 charge: MicCharge | None = None,
                 peer_silence_timeout_s: float = Settings.peer_silence_timeout_s) -> None:
        self.session = session
        # Charges the CPU time of the peer's inbound datagrams to the session's tenant, and closes
        # the session when late-frame admission sheds it (mic_charge.py).
        self.charge = charge
        self.max_ssrcs = max_ssrcs
        self.mic_max_packets_per_s = mic_max_packets_per_s
        self.ssrcs = SsrcLimit(max_ssrcs)  # the offer's SSRCs added when it is answered
        self.offered_ssrc: int | None = None
        self.ice = ice
        self.rtp_sender = rtp_sender  # who builds the speech packets: see rtp_send.py
        self.pc = RTCPeerConnection(configuration=ice.rtc_configuration(session.id))
        self.track: SpeechTrack | None = None
        self.mic: Microphone | None = None
        self.silent: SilentOutput | None = None
        self.channel = None
        # Events from before the peer's data channel opens (speech starts with the media, a little
        # ahead of the channel): kept, up to EARLY_EVENTS, and sent once it opens.
        self._early: list[dict] = []
        session.add_listener("peer", self._keep_early)
        self.dropped_candidates = 0
        self.ice_guards: list = []
        # Closes the session once a connected peer has sent nothing for the timeout (0: off).
        self.silence = PeerSilence(peer_silence_timeout_s, self._on_silent) if peer_silence_timeout_s > 0 else None
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)
        session.on_close.append(self._on_session_close)

    def _keep_early(self, event: dict) -> None:
        if len(self._early) < EARLY_EVENTS:
            self._early.append(event)

    async def answer(self, offer_sdp: str) -> str:
        validate_offer_sdp(offer_sdp)
        sdp, self.dropped_candidates = self.ice.filter_sdp(offer_sdp)
        offer = RTCSessionDescription(sdp=sdp, type="offer")
        try:
            await self.pc.setRemoteDescription(offer)
        except Exception as exc:
            raise GatewayError("invalid_sdp", f"the offer was rejected: {exc}") from None
        has_audio = any(t.kind == "audio" for t in self.pc.getTransceivers())
        if has_audio:
            # addTrack takes the offer's audio transceiver, so one m-line carries
            # our speech out and the peer's microphone in.
            self.track = SpeechTrack(self.session.playout)
            output = self.session.output
            self.track.on_departure = output.on_departure
            self.track.pacer.on_frame = output.on_frame_paced
            self.track.pacer.on_keepalive = output.on_keepalive
            sender = self.pc.addTrack(self.track)
            if self.rtp_sender == "voxgate":
                rtp_send.install(sender, self.track)
            if not fec.watch_reports(sender, output.on_loss_report):
                output.keep_fec()
        try:
            answer = await self.pc.createAnswer()
            await self.pc.setLocalDescription(answer)
        except Exception as exc:
            raise GatewayError("negotiation_failed", f"could not answer the offer: {exc}") from None
        self.ice_guards = guard_ice(self.pc, self.session.metrics.ice_dropped)
        metrics = self.session.metrics
        offered = offered_ssrcs(sdp)
        self.offered_ssrc = offered[0] if offered else None
        self.ssrcs = SsrcLimit(self.max_ssrcs, offered, on_drop=lambda: metrics.mic_dropped("ssrc"))
        local = self.pc.localDescription.sdp
        if has_audio:
            codec, payload_type = negotiated_codec(local) or ("", -1)
            if codec not in SUPPORTED_CODECS:
                raise GatewayError("no_common_codec", "the offer has no audio codec in common: offer Opus, PCMU or PCMA")
            self.session.attach_output(codec)
            encoder = self.session.output.encoder
            assert self.track is not None and encoder is not None
            self.track.set_clock_rate(encoder.clock_rate)
            opus_settings = self.session.options.opus
            self.track.dtx = codec == "opus" and (
                opus_settings.dtx or (opus_settings.dtx_when_asked and asks_for_dtx(sdp, payload_type))
            )
            self._attach_mic(codec, payload_type)
            if codec == "opus":
                local = ask_for_dtx(local, payload_type)
        else:
            # Data channel only: events and text work, and speech plays out in
            # real time with nothing encoded or sent (see SilentOutput).
            self.session.attach_output("none")
            self.silent = SilentOutput(self.session.playout)
            self.silent.start()
        self._guard_srtp()
        # Last: it wraps every handler above, so that it hears each datagram first.
        if self.silence is not None and not rtc_internals.watch_datagrams(self.pc, self.silence.heard):
            log.warning("session %s: this aioice keeps its protocols elsewhere: --peer-silence-timeout-s is off",
                        self.session.id, extra={"session_id": self.session.id})
            self.silence = None
        return local

    @property
    def _timed(self):
        return self.charge.timed if self.charge is not None else None

    def _guard_srtp(self) -> None:
        """Every DTLS transport of the peer the microphone does not read: only the session's SSRCs
        reach its SRTP (RTCP), and its RTP, which nothing here receives, is dropped unread."""
        taken = {id(rtc_internals.receiver_dtls(self.mic.receiver))} if self.mic is not None and self.mic.direct else set()
        for dtls in rtc_internals.peer_dtls_transports(self.pc):
            if id(dtls) not in taken:
                taken.add(id(dtls))
                if not rtc_internals.take_srtp_datagrams(dtls, None, self.ssrcs, self._timed):
                    log.warning("session %s: this aiortc's transports lack what the SSRC limit reads",
                                self.session.id, extra={"session_id": self.session.id})

    async def add_candidate(self, candidate: dict | None) -> bool:
        """Trickle ICE; returns False when the candidate was refused by policy."""
        if candidate is None or not candidate.get("candidate"):
            await self.pc.addIceCandidate(None)
            return True
        line = candidate["candidate"]
        if line.startswith("candidate:"):
            line = line[len("candidate:") :]
        parsed = candidate_from_sdp(line)
        if not self.ice.allows(parsed.ip):
            self.dropped_candidates += 1
            return False
        if remote_candidate_count(self.pc) >= MAX_REMOTE_CANDIDATES:
            self.dropped_candidates += 1
            raise GatewayError("too_many_candidates", f"this session already has {MAX_REMOTE_CANDIDATES} remote "
                               "candidates, the most it takes", 409)
        parsed.sdpMid = candidate.get("sdpMid")
        parsed.sdpMLineIndex = candidate.get("sdpMLineIndex")
        await self.pc.addIceCandidate(parsed)
        return True

    def _on_datachannel(self, channel) -> None:
        if self.channel is not None:
            return  # the first channel the peer opens carries the protocol
        self.channel = channel
        session = self.session
        limit = session.options.limits.max_buffered_bytes

        def send(event: dict) -> None:
            # Not once the DTLS transport under the channel has gone (a closed tab): aiortc
            # would queue the message and fail in a task nobody awaits, with a traceback.
            if channel.readyState != "open" or not _transport_up(channel):
                return
            # aiortc queues what the peer's SCTP has not acknowledged without end: a peer that never
            # acknowledges would grow this process's memory for as long as it keeps sending.
            if channel.bufferedAmount > limit:
                log.warning("session %s: the peer left %d bytes of events unread (over --max-channel-buffer-kb); "
                            "closing", session.id, channel.bufferedAmount, extra={"session_id": session.id})
                asyncio.ensure_future(session.close("the peer does not read its data channel"))
                return
            channel.send(json.dumps(event))

        def opened() -> None:
            early, self._early = self._early, []
            session.add_listener("peer", send)
            send(session.ready_event())
            for event in early:
                send(event)

        @channel.on("message")
        def on_message(message) -> None:
            session.handle_message(message, "peer")

        @channel.on("close")
        def on_close() -> None:
            if not session.closed:
                session.writer_gone("peer")  # what the page left open must not hold the session

        if channel.readyState == "open":
            opened()
        else:
            channel.on("open", opened)

    def _attach_mic(self, codec: str, payload_type: int) -> None:
        session, caller = self.session, self.session.caller
        for transceiver in self.pc.getTransceivers():
            if transceiver.kind == "audio" and transceiver.currentDirection in ("sendrecv", "recvonly"):
                self.mic = Microphone(
                    codec, payload_type,
                    on_audio=caller.on_inbound_audio, on_gap=caller.on_inbound_gap,
                    wanted=lambda: caller.listening, whole=lambda: caller.wants_every_frame,
                    clock=session.clock, max_packets_per_s=self.mic_max_packets_per_s, ssrcs=self.ssrcs,
                    on_drop=session.metrics.mic_dropped, ssrc=self.offered_ssrc, timed=self._timed,
                )
                self.mic.attach(transceiver.receiver)
                return

    async def _on_state(self) -> None:
        state = self.pc.connectionState
        # One line at info for each session that connects and for its end; the steps between at debug.
        (log.debug if state in ("new", "connecting") else log.info)(
            "session %s: connection %s", self.session.id, state, extra={"session_id": self.session.id})
        self.session.emit({"type": "connection.state", "state": state})
        if self.silence is not None:
            if state == "connected":
                self.silence.start()
            else:
                self.silence.stop()
        if state in ("failed", "closed"):
            await self.session.close(f"connection {state}")

    def _on_silent(self, seconds: float) -> None:
        """The peer's path is gone (a cut network, a closed laptop): end the session now rather than
        after aioice's consent timeout, ~30 s of speech sent into nothing."""
        session = self.session
        if session.closed:
            return
        log.info("session %s: nothing from the peer for %.1f s (over --peer-silence-timeout-s); closing",
                 session.id, seconds, extra={"session_id": session.id})
        asyncio.ensure_future(session.close("peer silent"))

    async def detach(self) -> None:
        """Let go of the session without closing it (a failed offer to a session made ahead,
        which stays for another try), and close the peer connection."""
        self.session.remove_listener("peer")
        if self.silence is not None:
            self.silence.stop()
        if self._on_session_close in self.session.on_close:
            self.session.on_close.remove(self._on_session_close)
        await self.close_pc()

    async def _on_session_close(self, session: Session) -> None:
        if self.silence is not None:
            self.silence.stop()
        if self.track is not None:
            self.track.stop()
        if self.silent is not None:
            self.silent.stop()
        await self.close_pc()

    async def close_pc(self) -> None:
        try:
            await self.pc.close()
        except Exception:
            # A peer refused half-way through negotiation can trip aiortc's close;
            # what it opened is released with it either way.
            log.warning("session %s: peer connection close failed", self.session.id, exc_info=True, extra={"session_id": self.session.id})
