"""Speech with no WebRTC peer (POST /v1/tts, POST /v1/audio/speech, the TTS WebSocket's contexts): its utterances, their engine stream and the audio formats they leave in."""
