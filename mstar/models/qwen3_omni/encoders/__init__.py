"""Qwen3-Omni's audio input side, run once per request before the thinker:
16 kHz waveform -> log-mel -> audio encoder rows. (Its images go through the
vision encoder it shares with Qwen3.5: `mstar/models/vision/`.)"""
