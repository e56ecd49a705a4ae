"""The caller's side: microphone audio, echo cancellation, voice activity, turn ends, recognition, barge-in."""
