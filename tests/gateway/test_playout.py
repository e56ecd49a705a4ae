"""Playout: what the track sends each tick; pre-roll, underruns, cancel, played text."""

from voxgate.gateway.media.playout import Playout, UtterancePlay

SILENCE = b"\x00silence"


def frames(n: int, tag: str = "f") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_idle_playout_sends_silence():
    playout = Playout(SILENCE)
    assert playout.next_frame() == SILENCE


def test_frames_play_in_order_then_done_fires_once():
    done = []
    started = []
    playout = Playout(SILENCE, on_audio_started=lambda u, t: started.append(u.id), on_done=lambda u: done.append(u.id))
    utt = UtterancePlay("a", ready_at=0.0)
    playout.add(utt)
    playout.push(utt, frames(3))
    playout.finish(utt)
    assert [playout.next_frame(1.0) for _ in range(4)] == [b"f0", b"f1", b"f2", SILENCE]
    assert started == ["a"] and done == ["a"] and utt.played_ms == 60


def test_underrun_inside_an_utterance_is_silence_and_raises_preroll():
    playout = Playout(SILENCE)
    utt = UtterancePlay("a")
    playout.add(utt)
    playout.push(utt, frames(2))
    assert playout.next_frame() == b"f0" and playout.next_frame() == b"f1"
    assert playout.next_frame() == SILENCE  # engine fell behind
    assert playout.stats.underruns == 1 and playout.preroll_ms > 0
    playout.push(utt, frames(1, "g"))
    # Held back until the new pre-roll is buffered, rather than trickling out.
    assert playout.next_frame() == SILENCE
    playout.push(utt, frames(5, "h"))
    assert playout.next_frame() == b"g0"
    assert playout.stats.underruns == 1  # one underrun, however long


def test_cancel_makes_the_very_next_frame_silence():
    playout = Playout(SILENCE)
    utt = UtterancePlay("a")
    playout.add(utt)
    playout.push(utt, frames(10))
    playout.next_frame()
    dropped = playout.clear()
    assert [u.id for u in dropped] == ["a"]
    assert playout.next_frame() == SILENCE


def test_played_text_counts_words_whose_middle_went_out():
    playout = Playout(SILENCE)
    utt = UtterancePlay("a")
    utt.words = [("one", 0, 100), ("two", 100, 200), ("three", 200, 300)]
    playout.add(utt)
    playout.push(utt, frames(15))
    for _ in range(8):  # 160 ms
        playout.next_frame()
    assert utt.played_text() == "one two"


def test_next_utterance_ttfa_counts_from_the_end_of_the_previous():
    playout = Playout(SILENCE)
    a, b = UtterancePlay("a", ready_at=1.0), UtterancePlay("b", ready_at=1.0)
    for utt in (a, b):
        playout.add(utt)
        playout.push(utt, frames(1))
        playout.finish(utt)
    playout.next_frame(2.0)
    playout.next_frame(5.0)  # a ends here, b becomes current
    assert b.ready_at == 5.0


def test_ready_fires_only_for_an_idle_start():
    calls = []
    playout = Playout(SILENCE, on_ready=lambda: calls.append(1))
    a, b = UtterancePlay("a"), UtterancePlay("b")
    playout.add(a)
    playout.add(b)
    playout.push(b, frames(3))  # not at the head: nothing to start yet
    assert calls == []
    playout.push(a, frames(3))
    assert calls == [1]
    playout.next_frame()  # a is playing now
    playout.push(a, frames(3))
    assert calls == [1]


def test_an_utterance_dropped_before_it_started_leaves_the_others_playing():
    done = []
    playout = Playout(SILENCE, on_done=lambda u: done.append(u.id))
    first, dropped, last = UtterancePlay("a"), UtterancePlay("b"), UtterancePlay("c")
    for utt, tag in ((first, "a"), (dropped, "b"), (last, "c")):
        playout.add(utt)
        playout.push(utt, frames(2, tag))
        playout.finish(utt)
    assert playout.next_frame() == b"a0"
    playout.drop(dropped)
    assert [playout.next_frame() for _ in range(4)] == [b"a1", b"c0", b"c1", SILENCE]
    assert done == ["a", "c"] and dropped.sent_frames == 0
