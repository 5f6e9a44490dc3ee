"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): thinker, talker, code
predictor and code2wav as one composite model. So far its config
(`config.py`) and its prompt positions (`positions.py`); the plan is
`docs/design/omni.md`."""
