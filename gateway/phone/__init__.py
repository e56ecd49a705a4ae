"""A phone call on a session (Twilio Media Streams): the caller's μ-law in, speech out, DTMF, the call's link."""
