"""The session clock, and the caller's media clock placed on it by the fastest packet."""

from voxgate.gateway.media.clock import CREEP, CaptureClock, SessionClock


def test_session_clock_counts_ms_from_its_origin():
    clock = SessionClock(origin=100.0)
    assert clock.ms(100.25) == 250.0 and clock.at_ms(100.2509) == 250


def test_the_fastest_packet_places_the_media_clock_and_late_ones_change_nothing():
    clock = CaptureClock(SessionClock(origin=0.0), 48000)
    # Packets of 20 ms (960 ticks) from tick 5000; the first arrives 30 ms after its end, the third 2 ms after.
    delays = [30.0, 12.0, 2.0, 50.0, 7.0, 2.5]
    placed = []
    for i, delay in enumerate(delays):
        end_tick = 5000 + (i + 1) * 960
        true_end = 1000.0 + (i + 1) * 20.0  # when its last sample was captured
        placed.append(clock.end_ms(end_tick, true_end + delay) - true_end)
    # Each packet is placed by the fastest one seen so far: never after its own arrival.
    assert placed[:3] == [30.0, 12.0, 2.0]
    assert all(2.0 <= error <= 2.0 + 1.0 for error in placed[2:])  # the late one (50 ms) did not move it


def test_a_sender_clock_slower_than_ours_is_followed_not_left_behind():
    clock = CaptureClock(SessionClock(origin=0.0), 8000)
    skew = 100e-6  # the sender's second is 100 ppm long: its packets fall ever later on our clock
    errors = []
    for i in range(1, 50 * 600 + 1):  # ten minutes of 20 ms packets, 1 ms of network delay
        end_tick = i * 160
        true_end = i * 20.0 * (1 + skew)
        errors.append(clock.end_ms(end_tick, true_end + 1.0) - true_end)
    assert abs(errors[-1]) < 2.0  # without the creep it would be 60 ms early by now
    assert CREEP > skew


def test_rtp_timestamps_wrap_and_reordered_packets_fall_in_place():
    clock = CaptureClock(SessionClock(origin=0.0), 48000)
    start = (1 << 32) - 960
    first = clock.end_ms(start, 500.0)
    after_wrap = clock.end_ms((start + 960) % (1 << 32), 520.0)
    assert after_wrap - first == 20.0
    older = clock.end_ms(start - 960, 530.0)  # a reordered packet from before the first
    assert abs(older - (first - 20.0)) < 0.1
