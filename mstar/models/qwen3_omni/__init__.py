"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): thinker, talker, code
predictor and code2wav as one composite model. So far: its config
(`config.py`), its prompt positions (`positions.py`), the thinker's text
decoder (`thinker.py`) and its weights (`loader.py`); the plan is
`docs/design/omni.md`."""
