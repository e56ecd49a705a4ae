"""gateway/media/opus.py: what is read from an Opus packet's header without libopus."""

import pytest

from voxgate.gateway.media import opus


@pytest.mark.parametrize("rate", opus.RATES)
def test_packet_samples_reads_every_header_as_libopus_does(rate):
    """Every TOC byte, with frame-count bytes that make valid, empty and overlong packets:
    the same count as libopus's opus_packet_get_nb_samples, and an error where it refuses."""
    lib = opus._lib()
    checked = refused = 0
    for toc in range(256):
        for tail in (b"", b"\x00", b"\x01", b"\x03", b"\x3f", b"\x85", b"\xff\x01"):
            packet = bytes([toc]) + tail
            theirs = lib.opus_packet_get_nb_samples(packet, len(packet), rate)
            if theirs < 0:
                refused += 1
                with pytest.raises(opus.OpusError):
                    opus.packet_samples(packet, rate)
            else:
                checked += 1
                assert opus.packet_samples(packet, rate) == theirs, (toc, tail)
    assert checked > 500 and refused > 100  # both kinds were compared
    with pytest.raises(opus.OpusError):
        opus.packet_samples(b"", rate)
