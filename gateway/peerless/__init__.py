"""Speech with no WebRTC peer (/v1/tts, /v1/audio/speech, the TTS WebSocket): utterances and audio formats."""
