"""The Qwen3-VL vision side that Qwen3-Omni and Qwen3.5 share: its config,
pictures into patches (a folder's preprocessing settings), the encoder and
its step, and where a multimodal prompt's tokens sit (M-RoPE positions)."""
