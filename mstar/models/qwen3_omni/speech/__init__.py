"""Qwen3-Omni's output side: the talker (codec frames from the thinker's text
and hidden states), its code predictor (each frame's residual codes) and
code2wav (codes to a 24 kHz waveform, streamed exactly)."""
