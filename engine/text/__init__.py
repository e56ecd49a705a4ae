"""Text to speakable units: the segmenter, inline speech tags, the bounds on a unit, and the pipeline a stream is handed."""
