"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): thinker, talker, code
predictor and code2wav as one composite model. So far: its config
(`config.py`), its prompt positions (`positions.py`), the thinker's text
decoder (`thinker.py`), its weights (`loader.py`), the served model over
text (`model.py`) and the built-in tiny shape (`builtins.py`); the plan is
`docs/design/omni.md`."""
