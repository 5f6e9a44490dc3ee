"""Model names in, `Model` objects out.

A name is either a builtin (`tiny-llama`; `orpheus-tiny`; `orpheus-3b`, a shape without
a checkpoint, served with `load_format="dummy"`; `qwen3-omni-tiny`; `qwen3-omni-30b-a3b`, a shape
served with `load_format="dummy"`; `qwen3.5-tiny`; `qwen3.5-vl-tiny`; `qwen3.5-9b` and
`qwen3.5-35b-a3b`, shapes) or a local Hugging Face folder whose config.json `model_type` picks the
model class (a llama folder with a `snac/` subfolder is Orpheus; `qwen3_omni_moe` is Qwen3-Omni;
`qwen3_5` and `qwen3_5_moe` are Qwen3.5). Model files register themselves here by name; the
runtime only calls `load_model`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

from mstar.errors import ConfigError
from mstar.models.checkpoint import generation_defaults, read_json
from mstar.models.base import Model

log = logging.getLogger(__name__)

# (name_or_path, load_format, max_model_len) -> Model
ModelFactory = Callable[[str, str, "int | None"], Model]

BUILTINS: dict[str, ModelFactory] = {}
MODEL_TYPES: dict[str, ModelFactory] = {}


def register_builtin(name: str, factory: ModelFactory) -> None:
    """A model served by name alone, without a folder."""
    BUILTINS[name] = factory


def register_model_type(model_type: str, factory: ModelFactory) -> None:
    """The model class for folders whose config.json has this `model_type`."""
    MODEL_TYPES[model_type] = factory


def _tiny_llama(name: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.llama import LlamaModel

    return LlamaModel(name, None, load_format, max_model_len)


def _orpheus_3b(name: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.llama.config import ORPHEUS_3B, ORPHEUS_3B_MAX_MODEL_LEN
    from mstar.models.orpheus.model import DUMMY_3B_AUDIO_LEAN, OrpheusModel

    # random weights that speak, so a benchmark's requests carry audio like a real checkpoint's
    lean = DUMMY_3B_AUDIO_LEAN if load_format == "dummy" else 0.0
    return OrpheusModel(name, None, load_format, max_model_len, builtin=ORPHEUS_3B,
                        default_max_model_len=ORPHEUS_3B_MAX_MODEL_LEN, audio_lean=lean)


def _orpheus_tiny(name: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.orpheus.model import ORPHEUS_TINY, TINY_AUDIO_LEAN, OrpheusModel

    # no checkpoint: always seeded random weights, like tiny-llama
    return OrpheusModel(name, None, "dummy", max_model_len, builtin=ORPHEUS_TINY, audio_lean=TINY_AUDIO_LEAN)


def _llama_folder(path: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.llama import LlamaModel

    if (Path(path) / "snac").is_dir():
        from mstar.models.orpheus import OrpheusModel

        return OrpheusModel(path, path, load_format, max_model_len)
    return LlamaModel(path, path, load_format, max_model_len)


def _qwen3_omni_folder(path: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.qwen3_omni.model import Qwen3OmniModel

    return Qwen3OmniModel(path, path, load_format, max_model_len)


def _qwen3_omni_30b_a3b(name: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.qwen3_omni.builtins import QWEN3_OMNI_30B_A3B
    from mstar.models.qwen3_omni.model import Qwen3OmniModel

    return Qwen3OmniModel(name, None, load_format, max_model_len, builtin=QWEN3_OMNI_30B_A3B)


def _qwen3_omni_tiny(name: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.qwen3_omni.builtins import QWEN3_OMNI_TINY
    from mstar.models.qwen3_omni.model import Qwen3OmniModel

    # no checkpoint: always seeded random weights, like tiny-llama
    return Qwen3OmniModel(name, None, "dummy", max_model_len, builtin=QWEN3_OMNI_TINY)


def _qwen35(name: str, load_format: str, max_model_len: int | None) -> Model:
    """A builtin of `qwen3_5.builtins.BY_NAME`."""
    from mstar.models.qwen3_5.builtins import BY_NAME
    from mstar.models.qwen3_5.model import Qwen35Model

    # tiny: always seeded random weights; a real shape serves only with --load-format dummy
    if not name.endswith("-tiny") and load_format != "dummy":
        raise ConfigError(f"model '{name}' has no bundled checkpoint: pass a local Hugging Face folder "
                          f"as the model, or --load-format dummy for random weights of its shape")
    return Qwen35Model(name, None, "dummy", max_model_len, builtin=BY_NAME[name])


def _qwen35_folder(path: str, load_format: str, max_model_len: int | None) -> Model:
    from mstar.models.qwen3_5.model import Qwen35Model

    return Qwen35Model(path, path, load_format, max_model_len)


register_builtin("tiny-llama", _tiny_llama)
register_builtin("orpheus-tiny", _orpheus_tiny)
register_builtin("orpheus-3b", _orpheus_3b)
register_builtin("qwen3-omni-tiny", _qwen3_omni_tiny)
register_builtin("qwen3-omni-30b-a3b", _qwen3_omni_30b_a3b)
register_model_type("llama", _llama_folder)
register_model_type("qwen3_omni_moe", _qwen3_omni_folder)
for _name in ("qwen3.5-tiny", "qwen3.5-vl-tiny", "qwen3.5-9b", "qwen3.5-35b-a3b"):  # qwen3_5.builtins.BY_NAME's
    register_builtin(_name, _qwen35)
for _type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
    register_model_type(_type, _qwen35_folder)


def _model_type(folder: Path) -> object:
    data = read_json(folder / "config.json")
    return data.get("model_type") if isinstance(data, dict) else None


def load_model(name_or_path: str, load_format: str = "auto", max_model_len: int | None = None,
               generation_config: str = "auto") -> Model:
    """The model named `name_or_path`: a builtin name or a local HF folder,
    with the sampling defaults `generation_config` gives it
    (`sampling_defaults`) where its model file takes them."""
    model = _build(name_or_path, load_format, max_model_len)
    if model.takes_generation_config:
        defaults = sampling_defaults(generation_config, name_or_path)
        if defaults:  # said once: answers differ from the API's defaults by these
            log.info("sampling defaults from %s: %s", generation_config, defaults)
        model.generation_defaults = MappingProxyType(defaults)
    return model


def _build(name_or_path: str, load_format: str, max_model_len: int | None) -> Model:
    if name_or_path in BUILTINS:
        return BUILTINS[name_or_path](name_or_path, load_format, max_model_len)
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        model_type = _model_type(folder)
        factory = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
        if factory is None:
            raise ConfigError(f"{folder}: model_type '{model_type}' is not supported "
                              f"(supported: {', '.join(sorted(MODEL_TYPES))})")
        return factory(str(folder), load_format, max_model_len)
    raise ConfigError(f"unknown model '{name_or_path}': not a builtin ({', '.join(sorted(BUILTINS))}) "
                      f"and not a local folder")


def sampling_defaults(source: str, model: str) -> dict[str, float | int]:
    """`--generation-config`: what a text request of `model` gets for the
    sampling fields it leaves out. 'auto': its folder's generation_config.json
    (a built-in model has none); 'none' (or vLLM's spelling, 'vllm'): none;
    else the generation_config.json of the folder `source` names."""
    if source in ("none", "vllm"):
        return {}
    if source == "auto":
        folder = Path(model).expanduser()
        return generation_defaults(folder) if model not in BUILTINS and folder.is_dir() else {}
    folder = Path(source).expanduser()
    if not (folder / "generation_config.json").is_file():
        raise ConfigError(f"--generation-config '{source}' is not auto, none or a folder with a "
                          "generation_config.json")
    return generation_defaults(folder)
