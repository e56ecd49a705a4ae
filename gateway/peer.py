"""The WebRTC side of a session: peer connection, data channel, speech track, microphone."""

from __future__ import annotations

import asyncio
import json
import logging

import av
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from aiortc.sdp import SessionDescription, candidate_from_sdp

from .ice import IcePolicy
from .session import Session
from .track import SilentOutput, SpeechTrack

log = logging.getLogger(__name__)

SUPPORTED_CODECS = ("opus", "pcmu", "pcma")


class OfferError(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


def validate_offer_sdp(sdp: str) -> None:
    if "m=audio" not in sdp and "m=application" not in sdp:
        raise OfferError("invalid_sdp", "the offer has no audio or data-channel media section")
    try:
        parsed = SessionDescription.parse(sdp)
    except Exception as exc:
        raise OfferError("invalid_sdp", f"the offer SDP could not be parsed: {type(exc).__name__}") from None
    # Bundled WebRTC needs a mid per section; aiortc half-builds a peer without one.
    for media in parsed.media:
        if not media.rtp.muxId:
            raise OfferError("invalid_sdp", f"the offer's {media.kind} section has no a=mid line")


def negotiated_codec(answer_sdp: str) -> str | None:
    """The codec the answer chose for audio: its first payload type."""
    desc = SessionDescription.parse(answer_sdp)
    for media in desc.media:
        if media.kind == "audio" and media.rtp.codecs:
            return media.rtp.codecs[0].mimeType.split("/")[-1].lower()
    return None


class PeerConnection:
    """Binds one RTCPeerConnection to one Session."""

    def __init__(self, session: Session, ice: IcePolicy) -> None:
        self.session = session
        self.ice = ice
        self.pc = RTCPeerConnection(configuration=ice.rtc_configuration(session.id))
        self.track: SpeechTrack | None = None
        self.silent: SilentOutput | None = None
        self.channel = None
        self._mic_task: asyncio.Task | None = None
        self.dropped_candidates = 0
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("track", self._on_track)
        self.pc.on("connectionstatechange", self._on_state)
        session.on_close.append(self._on_session_close)

    async def answer(self, offer_sdp: str) -> str:
        validate_offer_sdp(offer_sdp)
        sdp, self.dropped_candidates = self.ice.filter_sdp(offer_sdp)
        offer = RTCSessionDescription(sdp=sdp, type="offer")
        try:
            await self.pc.setRemoteDescription(offer)
        except Exception as exc:
            raise OfferError("invalid_sdp", f"the offer was rejected: {exc}") from None
        has_audio = any(t.kind == "audio" for t in self.pc.getTransceivers())
        if has_audio:
            # addTrack takes the offer's audio transceiver, so one m-line carries
            # our speech out and the peer's microphone in.
            self.track = SpeechTrack(self.session.playout)
            self.track.on_departure = self.session.on_departure
            self.track.pacer.on_frame = self.session.on_frame_paced
            self.pc.addTrack(self.track)
        try:
            answer = await self.pc.createAnswer()
            await self.pc.setLocalDescription(answer)
        except Exception as exc:
            raise OfferError("negotiation_failed", f"could not answer the offer: {exc}") from None
        local = self.pc.localDescription.sdp
        if has_audio:
            codec = negotiated_codec(local)
            if codec not in SUPPORTED_CODECS:
                raise OfferError("no_common_codec", "the offer has no audio codec in common: offer Opus, PCMU or PCMA")
            self.session.attach_output(codec)
            assert self.track is not None
            self.track.set_clock_rate(48000 if codec == "opus" else 8000)
        else:
            # Data channel only: events and text work, and speech plays out in
            # real time with nothing encoded or sent (see SilentOutput).
            self.session.attach_output("none")
            self.silent = SilentOutput(self.session.playout)
            self.silent.start()
        return local

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
        parsed.sdpMid = candidate.get("sdpMid")
        parsed.sdpMLineIndex = candidate.get("sdpMLineIndex")
        await self.pc.addIceCandidate(parsed)
        return True

    def _on_datachannel(self, channel) -> None:
        if self.channel is not None:
            return  # the first channel the peer opens carries the protocol
        self.channel = channel
        session = self.session

        def send(event: dict) -> None:
            if channel.readyState == "open":
                channel.send(json.dumps(event))

        session.add_listener("peer", send)

        @channel.on("message")
        def on_message(message) -> None:
            session.handle_message(message, "peer")

        if channel.readyState == "open":
            send(session.ready_event())
        else:
            channel.on("open", lambda: send(session.ready_event()))

    def _on_track(self, track) -> None:
        if track.kind == "audio" and self._mic_task is None:
            self._mic_task = asyncio.ensure_future(self._consume_mic(track))

    async def _consume_mic(self, track) -> None:
        # Always read: aiortc queues decoded frames without bound otherwise.
        resampler = av.AudioResampler(format="s16", layout="mono", rate=16000)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            except asyncio.CancelledError:
                return
            try:
                for out in resampler.resample(frame):
                    self.session.on_inbound_audio(out.to_ndarray().reshape(-1))
            except Exception:
                log.exception("session %s: inbound audio failed", self.session.id, extra={"session_id": self.session.id})

    async def _on_state(self) -> None:
        state = self.pc.connectionState
        log.info("session %s: connection %s", self.session.id, state, extra={"session_id": self.session.id})
        self.session.emit({"type": "connection.state", "state": state})
        if state in ("failed", "closed"):
            await self.session.close(f"connection {state}")

    async def _on_session_close(self, session: Session) -> None:
        if self._mic_task is not None:
            self._mic_task.cancel()
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
