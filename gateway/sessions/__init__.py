"""A session and its parts: the utterance queue, the speech output, the text pump, the data-channel protocol, and the registry of who holds each session. It imports the caller side and the media."""
