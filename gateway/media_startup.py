"""The server process's media, set up at start and said once in the start-up lines: the media
threads' priority (--media-priority, gateway/media/priority.py), where speech is encoded
(--encode-threads, gateway/media/encode_pool.py), the addresses peers are offered (gateway/webrtc/ice.py),
and the fast paths taken (aiortc's internals, gateway/media/rtc_internals.py; echo cancellation,
gateway/caller/speex.py). signaling/server.py calls these at start and logs what they say, and imports
no media module itself.
"""

from __future__ import annotations

import asyncio
import logging

from ..config import Settings
from .webrtc import ice
from .media import loop_internals, priority, rtc_internals
from .caller import speex
from .media.encode_pool import encode_pool, parse_threads

log = logging.getLogger(__name__)


def configure(settings: Settings) -> None:
    """The media threads' priority and the encoding threads, for this process. Called before the
    engine worker starts and before any encoding thread: priority follows the loop's thread, and
    the worker does not (raises PriorityError saying what to do)."""
    priority.apply(settings.media_priority)
    encode_pool.configure(parse_threads(settings.encode_threads))
    where = f"on {encode_pool.threads} thread(s)" if encode_pool.threads else "on the event loop"
    log.debug("speech is encoded %s (--encode-threads %s)", where, settings.encode_threads)
    if not encode_pool.threads and not loop_internals.check():
        log.warning("this event loop (%s) does not show its waiting callbacks, so encoding on it cannot give way "
                    "to them and frames may go late; give --encode-threads auto", type(asyncio.get_running_loop()).__name__)


def media_line(settings: Settings) -> tuple[int, str]:
    """(level, what) about the addresses peers are offered for media (ICE host candidates)."""
    offered = ice.offered_host_addresses()
    if not offered:
        return logging.WARNING, (
            "media: no address to offer peers as an ICE candidate, so no WebRTC peer can connect; "
            "give --ice-host with one of this machine's addresses")
    if settings.ice_host:
        how = "--ice-host"
    elif settings.loopback:
        how = "loopback, since HTTP listens on loopback; --ice-host ADDR offers another"
    else:
        how = "every interface; --ice-host ADDR offers fewer"
    return logging.INFO, f"media (ICE) offered on {', '.join(offered)} ({how})"


def fast_paths_line(settings: Settings, info: dict, rtc_paths: dict[str, bool], compat: list[str]) -> str:
    """The fast paths this process takes: the engine's (its `info`), aiortc's (`rtc_paths`, the
    gateway's check of them at start), the other dependencies' (`compat`), RTP, encoding, priority, echo cancellation."""
    paths = []
    fast = info.get("fast_paths")
    if fast:
        paths.append(f"engine: {fast}")
    paths.append(rtc_internals.summary(rtc_paths))
    paths += compat  # the other dependencies reached inside, each from its one module (Gateway.start)
    paths.append("RTP packets from templates" if settings.rtp_sender == "voxgate" else "RTP through aiortc's sender (--rtp-sender aiortc)")
    paths.append(f"encoding on {encode_pool.threads} thread(s)" if encode_pool.threads else "encoding on the event loop")
    if settings.media_priority != "normal":
        paths.append(f"{settings.media_priority} media priority")
    if settings.echo_cancel:
        paths.append("echo cancellation by libspeexdsp" if speex.available()
                     else "NO echo cancellation: libspeexdsp is missing (apt-get install libspeexdsp1)")
    return "fast paths: " + "; ".join(paths)
