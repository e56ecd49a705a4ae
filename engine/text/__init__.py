"""Text to speakable units: the segmenter, inline speech tags, unit bounds, the pipeline a stream is handed."""
