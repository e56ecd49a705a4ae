"""The caller side (gateway/caller/caller_side.py) alone, without a Session: the barge-in and backchannel
decision, the caller's settings, and the echo canceller's reference following them.

Made with plain callbacks in place of the session's queue and output (what plays now, interrupt,
where the reference goes), which is all the caller side may reach; the VAD, the canceller, the
caller's audio framing and, in the last test, an espeak-ng caller's voice are real.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from tests import listening_corpus as corpus
from voxgate.gateway.caller import speex
from voxgate.gateway.caller.caller_side import BargeInSettings, CallerSide
from voxgate.gateway.media.clock import SessionClock
from voxgate.gateway.caller.echo import ReferenceTap
from voxgate.gateway.caller.endpoint import TurnSettings
from voxgate.gateway.errors import GatewayError
from voxgate.gateway.caller.vad import VadSettings


@dataclass
class Options:
    vad: VadSettings = field(default_factory=VadSettings)
    barge_in: BargeInSettings = field(default_factory=BargeInSettings)
    turn: TurnSettings = field(default_factory=TurnSettings)


class Host:
    """What the rest of a session shows the caller side: events, interrupts, what plays, the reference."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.interrupts: list[str] = []
        self.playing: str | None = None
        self.reference: ReferenceTap | None = None
        self.activity = 0

    def caller(self, **options) -> CallerSide:
        def use_reference(tap: ReferenceTap | None) -> None:
            self.reference = tap

        def on_activity() -> None:
            self.activity += 1

        return CallerSide("test", options=Options(**options), clock=SessionClock(), emit=self.events.append,
                          interrupt=self.interrupts.append, playing=lambda: self.playing,
                          use_reference=use_reference, on_activity=on_activity)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


def test_a_long_turn_over_the_bot_interrupts_it_a_short_one_is_a_backchannel():
    host = Host()
    caller = host.caller()
    caller.vad_events(["speech.started", "speech.long"], 100)  # the bot silent: a turn, no interrupt
    caller.vad_events(["speech.stopped"], 400)
    assert host.interrupts == [] and not host.of("speech.backchannel")
    host.playing = "u1"
    caller.vad_events(["speech.started"], 1000)
    caller.vad.turn_voiced_ms = 320
    caller.vad_events(["speech.stopped"], 1400)  # never long enough: "mm-hmm"
    assert host.interrupts == []
    assert host.of("speech.backchannel") == [{"type": "speech.backchannel", "id": "u1", "speech_ms": 320, "at_ms": 1400}]
    caller.vad_events(["speech.started"], 2000)
    caller.vad_events(["speech.long"], 2300)
    assert host.interrupts == ["barge_in"]
    assert not host.of("speech.long")  # the caller side's own event, never sent
    caller.vad_events(["speech.stopped"], 2600)  # the interrupting turn is no backchannel
    assert len(host.of("speech.backchannel")) == 1
    caller.speech_interrupts = False  # a relay's utterance that speech may not interrupt
    caller.vad_events(["speech.started", "speech.long"], 3000)
    assert host.interrupts == ["barge_in"]
    assert host.activity == 10  # every event keeps the session from idling


def test_barge_in_settings_reach_the_vad_and_bad_ones_are_refused():
    host = Host()
    caller = host.caller()
    caller.update({"barge_in": {"min_interrupt_ms": 450}})
    assert caller.vad.interrupt_ms == 450 and caller.describe()["barge_in"]["min_interrupt_ms"] == 450
    for bad in ({"min_interrupt_ms": "soon"}, {"min_interrupt_ms": float("nan")}, {"loud": True}):
        with pytest.raises(GatewayError) as refused:
            caller.update({"barge_in": bad})
        assert refused.value.code == "invalid_field"
    assert caller.vad.interrupt_ms == 450
    with pytest.raises(GatewayError) as refused:
        caller.update({"stt": {"enabled": True}})  # no recognizer on this server
    assert refused.value.code == "stt_unavailable"


@pytest.mark.skipif(not speex.available(), reason="libspeexdsp is not installed")
def test_the_echo_reference_follows_the_output_and_the_settings():
    host = Host()
    caller = host.caller()
    caller.attach_output("none")  # data channel only: nothing is played to cancel
    assert caller.echo is None and host.reference is None
    caller.attach_output("opus")
    assert caller.echo is not None and isinstance(host.reference, ReferenceTap)
    caller.update({"vad": {"enabled": False}})  # nobody listens: no canceller, no reference
    assert caller.echo is None and host.reference is None and not caller.listening
    caller.update({"vad": {"enabled": True}, "barge_in": {"echo_cancel": True}})
    assert caller.echo is not None and host.reference is not None
    caller.close()
    assert caller.echo is None and host.reference is None and not caller.listening


def test_a_callers_voice_on_the_microphone_starts_a_turn_and_interrupts_what_plays():
    """Without the canceller the VAD runs as the frames arrive: a real voice, cut into frames on the
    session's clock, starts a turn stamped with its frame's capture time and interrupts the bot."""
    host = Host()
    caller = host.caller(barge_in=BargeInSettings(echo_cancel=False, min_interrupt_ms=200))
    caller.attach_output("opus")
    host.playing = "u1"
    voice = corpus.espeak("Wait, hold on, I have a question.", "en-gb+f3", 16000)
    caller.on_inbound_gap(25)  # half a second the peer did not send (its DTX): silence for the VAD
    caller.on_inbound_audio(np.concatenate([np.zeros(8000, np.int16), voice]), 500.0)
    started = host.of("speech.started")
    assert len(started) == 1 and 500 < started[0]["at_ms"] < 500 + 500 + len(voice) / 16
    assert host.interrupts == ["barge_in"]


def test_a_key_pressed_interrupts_only_where_the_policy_lets_it():
    host = Host()
    caller = host.caller()
    host.playing = "greeting"
    caller.on_dtmf("5", "CA1")  # no policy (no relay): keys never interrupt
    assert host.interrupts == [] and host.of("call.dtmf") == [{"type": "call.dtmf", "digit": "5", "call_sid": "CA1"}]
    caller.dtmf_interrupts = lambda uid: uid != "greeting"
    caller.on_dtmf("6", "CA1")
    assert host.interrupts == []
    host.playing = "reply"
    caller.on_dtmf("7", "CA1")
    assert host.interrupts == ["barge_in"] and len(host.of("call.dtmf")) == 3
    host.playing = None
    caller.on_dtmf("8", "CA1")  # nothing playing: nothing to interrupt
    assert host.interrupts == ["barge_in"]
