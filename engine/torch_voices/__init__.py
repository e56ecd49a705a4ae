"""Voices on torch: Piper's VITS ported to torch (streaming, batching across streams), and CosyVoice 2."""
