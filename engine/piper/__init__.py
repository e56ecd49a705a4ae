"""The Piper voice on onnxruntime: its catalog, its graph split and rewritten at load, windows, word timings."""
