"""Voices on torch: Piper's VITS ported to torch (streaming inside a sentence, batching across streams), and the CosyVoice 2 adapter."""
