"""Qwen3-Omni's code2wav against transformers: a tiny random model saved as
transformers saves it, loaded by mstar's loader. The whole decode equals
transformers' forward; streaming in pieces (frame by frame, uneven chunks,
rows at different offsets sharing one state tensor, slots reused dirty)
gives `held` zeros then the whole decode, sample for sample; and every piece
of the per-row state is needed for that.

Weights are random, std 0.08 as in the thinker's test, but for the layer
scales, set to 1 (transformers starts them at 0.01, which would leave the
transformer's part near nothing), and the convolutions, drawn at about unit
gain (std 0.9 / sqrt(fan-in)), the last one scaled by 0.1: at std 0.08 the
tiny decoder damps the codes' part of the waveform to a few thousandths of
a near-constant output, and at unit gain it grows past the final clamp. So
the waveform has std about 0.2 and stays inside (-1, 1), its codes move it
by about 0.05 and the attention by about 0.02.

Tolerances: streamed float32 differs from the whole decode only by
summation order (matmuls, attention and convolutions over other shapes),
float32 rounding that the decoder's gain carries to at most 2e-6 of a
signal of order 1 here: 1e-5 absolute, while losing any one piece of state
moves the waveform by more than 5e-3. In float64 the same comparisons hold
to 1e-12 (seen: 3e-15), so the streamed waveform is the whole decode up to
rounding. The whole decode is transformers' forward to the bit on CPU
(same operations in the same order); it is held to the same tolerances.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration

from mstar.engine.memory.state_slots import StatePool
from mstar.errors import ConfigError
from mstar.models.qwen3_omni.config import Code2WavConfig, Qwen3OmniConfig
from mstar.models.qwen3_omni.speech.code2wav import Code2Wav, load_code2wav
from mstar.types import StateRows
from test_qwen3_omni_config import tiny

ATOL32, ATOL64 = 1e-5, 1e-12
FRAME = 1920
CODES, GROUPS = 64, 4


def _save(folder: Path, kv_heads: int | None = None) -> Qwen3OmniMoeForConditionalGeneration:
    cfg = tiny()
    if kv_heads is not None:
        cfg.code2wav_config.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.code2wav.named_parameters():
            p.normal_(0.0, 0.08)
            if name.endswith("layer_scale.scale"):
                p.fill_(1.0)
            elif p.dim() > 1 and name.startswith(("upsample.", "decoder.")):
                p.normal_(0.0, 0.9 / math.sqrt(p[0].numel()))
        model.code2wav.decoder[-1].conv.weight.mul_(0.1)
    model.save_pretrained(folder)
    return model


def _ours(folder: Path, dtype: torch.dtype = torch.float32) -> Code2Wav:
    module = Code2Wav(Qwen3OmniConfig.from_folder(folder).code2wav).eval()
    load_code2wav(module, folder)
    return module.to(dtype)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Streaming is many small ops: on a CPU shared with other work, torch's
    thread hand-offs made these tests several times slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3OmniMoeForConditionalGeneration]:
    folder = tmp_path_factory.mktemp("omni-code2wav")
    return folder, _save(folder)


def _codes(rows: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODES, (rows, GROUPS, frames), generator=torch.Generator().manual_seed(seed))


class Streams:
    """Rows streamed through one state pool, each row's outputs kept."""

    def __init__(self, module: Code2Wav, slots: int, dtype: torch.dtype) -> None:
        self.module = module
        self.pool = StatePool(module.state_spec(dtype), slots, "cpu")
        self.out: dict[str, list[torch.Tensor]] = {}

    def step(self, rows: dict[str, tuple[int, torch.Tensor, bool]]) -> None:
        """rows: name -> (slot, codes [Q, k], fresh); one call for them all."""
        names = list(rows)
        slots = torch.tensor([rows[n][0] for n in names])
        codes = torch.stack([rows[n][1] for n in names])
        fresh = torch.tensor([rows[n][2] for n in names])
        wav = self.module.stream(codes, StateRows(self.pool.tensors, slots), fresh)
        assert wav.shape == (len(names), FRAME * codes.shape[-1])
        for n, w in zip(names, wav, strict=True):
            if rows[n][2]:
                self.out[n] = []
            self.out[n].append(w)

    def wav(self, name: str) -> torch.Tensor:
        return torch.cat(self.out[name])


def _check_streamed(module: Code2Wav, streamed: torch.Tensor, codes: torch.Tensor, atol: float) -> None:
    """`streamed` of a row's frames `codes` [Q, n] is `held` zeros, then the
    whole decode of those frames."""
    held = module.held
    assert streamed.shape == (FRAME * codes.shape[-1],)
    assert torch.equal(streamed[:held], torch.zeros(held, dtype=streamed.dtype))
    whole = module.decode(codes[None])[0]
    torch.testing.assert_close(streamed[held:], whole, atol=atol, rtol=0)


@torch.inference_mode()
@pytest.mark.parametrize("dtype, atol", [(torch.float32, ATOL32), (torch.float64, ATOL64)])
def test_the_whole_decode_is_transformers_forward(saved, dtype: torch.dtype, atol: float) -> None:
    folder, model = saved
    ours = _ours(folder, dtype)
    codes = _codes(2, 30, seed=1)
    reference = copy.deepcopy(model.code2wav).to(dtype)
    want = reference(codes)
    got = ours.decode(codes)
    assert ours.held == 555 and got.shape == (2, FRAME * 30 - 555) and want.shape == (2, 1, FRAME * 30 - 555)
    assert got.std() > 0.05 and got.abs().max() < 1   # a waveform, not a constant nor the clamp's ±1
    torch.testing.assert_close(got, want[:, 0], atol=atol, rtol=0)
    one = ours.decode(codes[:, :, :1])   # a single frame: 1920 - 555 samples, all from its own code
    assert one.shape == (2, FRAME - 555)
    torch.testing.assert_close(one, reference(codes[:, :, :1])[:, 0], atol=atol, rtol=0)


@torch.inference_mode()
def test_grouped_kv_heads_decode_as_transformers(tmp_path: Path) -> None:
    model = _save(tmp_path, kv_heads=2)
    codes = _codes(1, 12, seed=2)
    torch.testing.assert_close(_ours(tmp_path).decode(codes), model.code2wav(codes)[:, 0], atol=ATOL32, rtol=0)


@torch.inference_mode()
@pytest.mark.parametrize("dtype, atol", [(torch.float32, ATOL32), (torch.float64, ATOL64)])
@pytest.mark.parametrize("convs", ["torch", "gemm"])
def test_three_rows_at_different_offsets_stream_the_whole_decode(saved, dtype: torch.dtype, atol: float, convs: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Frame by frame and in uneven chunks, rows joining late and in shuffled
    order in one state tensor, 40 frames each: past the window (8) and the
    convolutions' reach (about 10 frames) many times over. `gemm`: the
    step's convolutions as CUDA runs them (`mstar.kernels.codec.conv`)."""
    from mstar.models.qwen3_omni.speech import code2wav_blocks

    monkeypatch.setattr(code2wav_blocks, "_as_gemm", lambda x: convs == "gemm")
    module = _ours(saved[0], dtype)
    n = 40
    codes = {name: _codes(1, n, seed)[0] for seed, name in enumerate("abc")}
    slot = {"a": 3, "b": 0, "c": 2}
    start = {"a": 0, "b": 2, "c": 5}                        # the call each row joins at
    chunks = [1] * 6 + [3, 2, 5, 1, 4, 7, 2, 1, 6, 3, 5, 8, 1, 2, 9]
    at = dict.fromkeys(codes, 0)
    streams = Streams(module, 5, dtype)
    for call, k in enumerate(chunks):
        rows = {}
        for name in ("c", "a", "b") if call % 2 else ("b", "c", "a"):
            if call >= start[name] and at[name] < n:
                k_row = min(k, n - at[name])
                rows.setdefault(k_row, {})[name] = (slot[name], codes[name][:, at[name]:at[name] + k_row],
                                                    at[name] == 0)
                at[name] += k_row
        for group in rows.values():   # rows near their end take fewer frames: a call per chunk size
            streams.step(group)
    assert set(at.values()) == {n}
    for name in codes:
        _check_streamed(module, streams.wav(name), codes[name], atol)


@torch.inference_mode()
def test_a_fresh_row_in_a_dirty_slot_starts_over(saved) -> None:
    """A row that takes a slot another row left mid-utterance, with `fresh`
    (the runtime's zeroing skipped), streams its own whole decode."""
    module = _ours(saved[0])
    old, new = _codes(2, 17, seed=7), _codes(1, 13, seed=8)[0]
    streams = Streams(module, 3, torch.float32)
    streams.step({"old0": (1, old[0, :, :9], True), "old1": (2, old[1, :, :9], True)})
    streams.step({"old1": (2, old[1, :, 9:], False), "new": (1, new[:, :8], True)})
    streams.step({"new": (1, new[:, 8:], False)})
    _check_streamed(module, streams.wav("new"), new, ATOL32)
    _check_streamed(module, streams.wav("old1"), old[1], ATOL32)


@torch.inference_mode()
def test_every_piece_of_the_state_is_needed(saved) -> None:
    """Wiping any one state tensor of a row between two calls changes what
    follows beyond the tolerance: none is dead weight, and the streaming
    tests above can fail."""
    module = _ours(saved[0])
    codes = _codes(1, 24, seed=3)[0]
    whole = module.decode(codes[None])[0]
    names = [name for name, _, _ in module.state_spec().tensors]
    assert len(names) == 2 + 2 + 1 + 4 * 4 + 1   # frames, kv, 2 ConvNeXt, conv_in, 4 blocks x (up + 3 units), conv_out
    streams = Streams(module, len(names), torch.float32)   # row i in slot i loses state tensor i
    streams.step({name: (i, codes[:, :12], True) for i, name in enumerate(names)})
    for i, name in enumerate(names):
        streams.pool.tensors[name][i].zero_()
    streams.step({name: (i, codes[:, 12:], False) for i, name in enumerate(names)})
    for name in names:
        assert (streams.wav(name)[module.held:] - whole).abs().max() > 100 * ATOL32, name


def test_the_state_at_the_released_size() -> None:
    """Per row, in bfloat16 (hidden 1024, 16 heads, 8 layers, window 72,
    decoder 1536, rates 8·5·4·3 after 2·2): the K/V of 71 frames is 90% of
    it. A meta-device module: nothing is allocated."""
    cfg = Code2WavConfig(codebook_size=2048, num_quantizers=16, hidden_size=1024, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=16, intermediate_size=3072, sliding_window=72,
                         decoder_dim=1536, upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2), rope_theta=1e4,
                         rms_norm_eps=1e-5)
    module = Code2Wav(cfg, device="meta", dtype=torch.bfloat16)
    kv = 8 * 2 * 71 * 1024
    convs = 2 * 1024 * 6 + 1024 * 6 + sum(c + 6 * 13 * c // 2 for c in (1536, 768, 384, 192)) + 96 * 6
    assert (kv, convs) == (1_163_264, 134_208)
    assert StatePool.bytes_per_slot(module.state_spec()) == 2 * (kv + convs) + 8 == 2_594_952   # 2.47 MiB
    assert StatePool.bytes_per_slot(module.state_spec(torch.float32)) == 4 * (kv + convs) + 8
    assert module.held == 555 and module.samples_per_frame == FRAME


def test_a_checkpoint_without_a_tensor_is_refused(saved, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = saved
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k.startswith("code2wav.")}
    del tensors["code2wav.decoder.2.block.3.conv1.conv.bias"]
    tensors["code2wav.decoder.9.conv.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\): blocks\.1\.units\.1\.conv1\.bias; "
                                          r"unexpected 1 tensor\(s\): code2wav\.decoder\.9\.conv\.weight"):
        _ours(tmp_path)


def test_snake_beta_follows_its_parameters_when_they_change_in_place() -> None:
    """Its exp(alpha) and exp(beta) are kept between steps, and worked out
    again once a load (or anything) writes the parameters."""
    from mstar.models.qwen3_omni.speech.code2wav_blocks import SNAKE_EPS, SnakeBeta

    snake = SnakeBeta(3)
    x = torch.randn(2, 3, 5)

    def expected() -> torch.Tensor:
        freq, magnitude = snake.alpha.exp()[None, :, None], snake.beta.exp()[None, :, None]
        return x + 1.0 / (magnitude + SNAKE_EPS) * torch.sin(x * freq).pow(2)

    with torch.no_grad():
        first = snake(x)
        assert torch.equal(first, expected())
        snake.alpha.add_(0.5)
        snake.beta.sub_(0.25)
        assert torch.equal(snake(x), expected()) and not torch.equal(snake(x), first)
        kept = snake._scales(snake.alpha, snake.beta)[0]
        snake.alpha.mul_(0.5)  # written in place again: refilled into the same tensors a graph would read
        assert snake._scales(snake.alpha, snake.beta)[0] is kept and torch.equal(snake(x), expected())
        snake.double()  # new storage: new tensors
        x = x.double()
        assert torch.equal(snake(x), expected())


@torch.inference_mode()
def test_zeroed_slots_are_read_as_they_are_and_others_are_masked(saved) -> None:
    """`zeroed` (the runtime zeroes a slot when it hands it out): a fresh
    row's slot is read without masking, which gives what masking gives on a
    zeroed slot. Without it, whatever a fresh row's slot holds is ignored."""
    module = _ours(saved[0])
    codes = _codes(2, 6, seed=5)
    pool = StatePool(module.state_spec(torch.float32), 4, "cpu")
    slots, fresh = torch.tensor([0, 1]), torch.tensor([True, True])
    masked = module.stream(codes, StateRows(pool.tensors, slots), fresh)
    for t in pool.tensors.values():
        t.zero_()
    assert torch.equal(module.stream(codes, StateRows(pool.tensors, slots), fresh, zeroed=True), masked)
    for t in pool.tensors.values():  # slots left dirty by the steps above: masking ignores that
        t[:2] = t[:2] + 1
    assert torch.equal(module.stream(codes, StateRows(pool.tensors, slots), fresh), masked)
