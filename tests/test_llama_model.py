"""LlamaModel and the registry: builtin tiny-llama, folder loading errors,
request preparation."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mstar.errors import ConfigError, RequestError
from mstar.graph import compile_walks
from mstar.models.llama import LlamaModel
from mstar.models.registry import load_model
from mstar.types import GenerateRequest, SamplingParams


def _request(ids, max_tokens=16):
    return GenerateRequest("r", "m", {"prompt_ids": ids}, SamplingParams(max_tokens=max_tokens))


def test_tiny_llama_builtin():
    model = load_model("tiny-llama")
    assert isinstance(model, LlamaModel)
    assert model.max_model_len == 2048
    assert model.tokenizer is not None and model.tokenizer.vocab_size == model.config.vocab_size
    assert set(model.eos_token_ids) == {257, 260}
    spec = model.kv_spec("llm")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)
    plans = compile_walks(model.walks, model.components)
    assert model.default_walk in plans
    a = model.build_component("llm", torch.device("cpu"), torch.float32)
    b = load_model("tiny-llama").build_component("llm", torch.device("cpu"), torch.float32)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name  # every start gets the same weights
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    assert 0.015 < float(a.embed_tokens.weight.std()) < 0.025


def test_max_model_len_override():
    assert load_model("tiny-llama", max_model_len=64).max_model_len == 64
    with pytest.raises(ConfigError):
        load_model("tiny-llama", load_format="pt")


def test_prepare():
    model = load_model("tiny-llama", max_model_len=32)
    out = model.prepare(_request([256, 104, 105]))
    assert out.values["prompt_ids"].dtype == torch.long and out.values["prompt_ids"].tolist() == [256, 104, 105]
    with pytest.raises(RequestError) as e:
        model.prepare(_request([]))
    assert e.value.field == "prompt"
    with pytest.raises(RequestError) as e:
        model.prepare(_request([1, model.config.vocab_size]))
    assert e.value.field == "prompt" and str(model.config.vocab_size) in str(e.value)
    with pytest.raises(RequestError) as e:
        model.prepare(_request([1, -1]))
    assert e.value.field == "prompt"
    with pytest.raises(RequestError) as e:
        model.prepare(_request(["a"]))
    assert e.value.field == "prompt"
    with pytest.raises(RequestError) as e:
        model.prepare(_request([1] * 20, max_tokens=13))
    assert e.value.field == "max_tokens" and "20" in e.value.message and "32" in e.value.message
    model.prepare(_request([1] * 20, max_tokens=12))


def test_unknown_names_and_folders(tmp_path):
    with pytest.raises(ConfigError, match="tiny-llama"):
        load_model("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="gpt2"):
        load_model(str(tmp_path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=100, max_position_embeddings=128,
                                   eos_token_id=[5, 6], bos_token_id=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def test_folder_eos_and_dummy(folder):
    model = load_model(str(folder))
    assert model.tokenizer is None
    assert model.eos_token_ids == (5, 6)
    dummy = load_model(str(folder), load_format="dummy").build_component("llm", torch.device("cpu"), torch.float32)
    assert dummy.lm_head.weight.shape == (100, 32)


def _rewrite(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_unexpected_and_misshapen_tensors(folder, tmp_path):
    cpu = torch.device("cpu")
    bad = _rewrite(folder, tmp_path / "missing", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing 1 tensor.*qkv_proj\.weight\[k\]"):
        load_model(str(bad)).build_component("llm", cpu, torch.float32)
    bad = _rewrite(folder, tmp_path / "extra",
                   lambda t: t.update({"model.layers.7.mlp.up_proj.weight": t["lm_head.weight"].clone()}))
    with pytest.raises(ConfigError, match=r"unexpected 1 tensor.*layers\.7"):
        load_model(str(bad)).build_component("llm", cpu, torch.float32)
    bad = _rewrite(folder, tmp_path / "shape", lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(ConfigError, match="shape"):
        load_model(str(bad)).build_component("llm", cpu, torch.float32)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(str(tmp_path / "empty")).build_component("llm", cpu, torch.float32)


def test_an_untied_config_without_a_head_serves_the_embedding_and_says_so(folder, tmp_path, caplog):
    headless = _rewrite(folder, tmp_path / "headless", lambda t: t.pop("lm_head.weight"))
    with caplog.at_level("WARNING"):
        decoder = load_model(str(headless)).build_component("llm", torch.device("cpu"), torch.float32)
    assert decoder.lm_head.weight.data_ptr() == decoder.embed_tokens.weight.data_ptr()
    assert any("no lm_head.weight though config.json unties it" in r.getMessage() for r in caplog.records)


def test_an_unreadable_safetensors_file_is_refused_naming_it(folder, tmp_path):
    """A truncated download, or an index that puts a tensor in a shard without it: a `ConfigError` naming the
    file (the engine shows a ConfigError's message alone), not safetensors' bare error."""
    cpu = torch.device("cpu")
    cut = _rewrite(folder, tmp_path / "cut", lambda t: None)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match=r"cut/model\.safetensors: cannot read.*not fully covered"):
        load_model(str(cut)).build_component("llm", cpu, torch.float32)
    lies = tmp_path / "lies"
    lies.mkdir()
    (lies / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:2]}, str(lies / "a.safetensors"))
    save_file({n: tensors[n] for n in names[2:]}, str(lies / "b.safetensors"))
    where = {n: "a.safetensors" for n in names[:2]} | {n: "b.safetensors" for n in names[2:]}
    where[names[-1]] = "a.safetensors"
    (lies / "model.safetensors.index.json").write_text(json.dumps({"weight_map": where}))
    with pytest.raises(ConfigError, match=rf"lies/a\.safetensors: cannot read.*{re.escape(names[-1])}"):
        load_model(str(lies)).build_component("llm", cpu, torch.float32)


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_pads_its_rows_and_computes_the_vocabulary(tied):
    """An odd vocabulary's head multiplies a matrix padded to 64 rows (zero past
    the vocabulary), returns only the vocabulary's logits, and a tied
    embedding reads the same (unpadded) rows."""
    from mstar.models.llama.config import LlamaConfig
    from mstar.models.llama.loader import dummy_weights
    from mstar.models.llama.model import LlamaDecoder

    cfg = LlamaConfig(vocab_size=301, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    decoder = LlamaDecoder(cfg, tie_word_embeddings=tied, dtype=torch.float32)
    dummy_weights(decoder, seed=3)
    head = decoder.lm_head
    assert head.padded.shape == (320, 32) and head.weight.shape == (301, 32)
    assert head.weight.data_ptr() == head.padded.data_ptr() and not head.padded[301:].any()
    assert (decoder.embed_tokens.weight is head.weight) == tied
    names = [name for name, _ in decoder.named_parameters()]
    assert names[0] == "embed_tokens.weight" and ("lm_head.weight" in names) != tied
    x = torch.randn(5, 32)
    assert head(x).shape == (5, 301)
    torch.testing.assert_close(head(x), x @ head.weight.T)
