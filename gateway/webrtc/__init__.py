"""A session's WebRTC peer: the peer connection and its data channel, the ICE policy, TURN credentials."""
