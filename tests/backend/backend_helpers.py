"""Test helpers for the session API: a WebRTC listener that joins a session made ahead."""

from __future__ import annotations



from voxgate.rtc_client import OfferRefused, RtcClient  # noqa: F401  (tests import OfferRefused from here)


def JoiningRtcClient(base_url: str, session_id: str | None, token: str | None, **kwargs) -> RtcClient:
    """An RtcClient whose offer joins a session made ahead through the session API."""
    return RtcClient(base_url, session_id=session_id, token=token, **kwargs)


