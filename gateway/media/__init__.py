"""Speech out, and the audio under every part: frames, clock, codecs, resampling, feeder, playout, the paced track."""
