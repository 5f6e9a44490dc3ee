"""Qwen3-Omni's input side, run once per request before the thinker: audio
(16 kHz waveform -> log-mel -> audio encoder rows) and images (pixels ->
patches -> vision encoder rows and deepstack features)."""
