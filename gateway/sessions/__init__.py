"""A session and its parts: the utterance queue, the speech output, the text pump, the protocol, the registry."""
