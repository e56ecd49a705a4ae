"""Voxgate's voice inside the voice-agent frameworks people already use.

- `voxgate.integrations.pipecat`: a pipecat `TTSService` (`pip install ".[pipecat]"` in the clone).
- `voxgate.integrations.livekit`: a LiveKit Agents `tts.TTS` (`pip install ".[livekit]"` in the clone).

Both stream through the gateway's bi-streaming TTS WebSocket, `GET /v1/tts/ws`
(docs/tts-websocket.md), with each word's start and end. Importing this package
imports neither framework; each plugin module imports its own.
"""
