"""The caller's side: the microphone's audio, echo cancellation, voice activity, the end of a turn, speech recognition and the barge-in decision. It imports the media below it, never a session."""
