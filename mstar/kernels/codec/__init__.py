"""Kernels of the audio codecs' decoders (SNAC, Qwen3-Omni's code2wav): snake
activations alone and fused with their convolutions, convolutions as GEMMs,
and the decoders' seeded noise."""
