"""SnacDecoder against the snac package (`snac.SNAC`) with the same random
weights: checkpoints saved in the package's formats (pytorch_model.bin with
new or old weight-norm names, safetensors), decoded with the same global
seed before each decode, give the same waveform. Also: batched rows equal
rows alone (noise off, or per-row seeded noise), small configs with local
attention and without depthwise convs, loader errors, dummy weights, and a
bf16-vs-fp32 measurement (printed, loosely bounded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

snac = pytest.importorskip("snac")

from mstar.errors import ConfigError
from mstar.models.snac import (
    SNAC_24KHZ,
    SeededNoise,
    SnacConfig,
    SnacDecoder,
    load_snac_decoder,
    read_config,
)
from mstar.models.snac.noise import seeded_normal
from mstar.models.snac.spans import Span, take

ATOL = 1e-4
WINDOW = 4        # coarse frames in one Orpheus window (28 tokens)
LONG = 24

# a 32/44 kHz-style codec (local attention, four levels) and a plain-conv one, small enough for CPU
SMALL_ATTENTION = SnacConfig(sampling_rate=16_000, encoder_dim=8, encoder_rates=(2, 2), decoder_dim=128,
                             decoder_rates=(4, 2), attn_window_size=8, codebook_size=64, codebook_dim=4,
                             vq_strides=(8, 4, 2, 1), noise=True, depthwise=True)
SMALL_PLAIN = SnacConfig(sampling_rate=16_000, encoder_dim=8, encoder_rates=(2, 2), decoder_dim=64,
                         decoder_rates=(3, 2), attn_window_size=None, codebook_size=64, codebook_dim=4,
                         vq_strides=(2, 1), noise=False, depthwise=False)


def make_reference(cfg: SnacConfig, seed: int = 1234) -> torch.nn.Module:
    """snac.SNAC with random weights; weight-norm gains and snake alphas moved
    off their initial values, so a mis-folded or mis-mapped one shows."""
    torch.manual_seed(seed)
    ref = snac.SNAC(**cfg.to_dict()).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("alpha", "original0")):
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
            elif name.endswith(".bias") or ".norm." in name:
                p.add_(torch.randn_like(p) * 0.05)
    return ref


def save_folder(folder: Path, cfg: SnacConfig, state: dict[str, torch.Tensor], fmt: str = "bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
    if fmt == "bin":
        torch.save(state, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def old_weight_norm_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict as torch's old `weight_norm` named it (weight_g / weight_v)."""
    renamed = {}
    for k, v in state.items():
        k = k.replace(".parametrizations.weight.original0", ".weight_g")
        renamed[k.replace(".parametrizations.weight.original1", ".weight_v")] = v
    return renamed


def random_codes(cfg: SnacConfig, batch: int, coarse: int, seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.codebook_size, (batch, n), generator=gen) for n in cfg.level_lengths(coarse)]


def seeded_decodes(ref: torch.nn.Module, ours: SnacDecoder, codes: list[torch.Tensor],
                   seed: int = 99) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        torch.manual_seed(seed)
        expected = ref.decode(codes)
    torch.manual_seed(seed)
    return expected, ours.decode(codes)


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return make_reference(SNAC_24KHZ)


@pytest.fixture(scope="module")
def folder(reference: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_folder(tmp_path_factory.mktemp("snac_bin"), SNAC_24KHZ, reference.state_dict())


@pytest.fixture(scope="module")
def decoder(folder: Path) -> SnacDecoder:
    return load_snac_decoder(folder)


# ---------------------------------------------------------------- config


def test_config_24khz(folder: Path) -> None:
    cfg = read_config(folder)
    assert cfg == SNAC_24KHZ
    assert cfg.hop_length == 512 and cfg.latent == 768 and cfg.num_levels == 3
    assert cfg.samples_per_coarse_frame == 2048
    assert cfg.level_lengths(WINDOW) == (4, 8, 16)


def test_config_defaults_and_errors() -> None:
    d = SNAC_24KHZ.to_dict()
    del d["attn_window_size"]    # the package's default is 32
    assert SnacConfig.from_dict(d).attn_window_size == 32
    with pytest.raises(ConfigError, match="missing key 'decoder_rates'"):
        SnacConfig.from_dict({k: v for k, v in SNAC_24KHZ.to_dict().items() if k != "decoder_rates"})
    with pytest.raises(ConfigError, match="vq_strides"):
        SnacConfig.from_dict({**SNAC_24KHZ.to_dict(), "vq_strides": [4, 3, 1]})


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("coarse", [WINDOW, LONG])
def test_matches_package(reference: torch.nn.Module, decoder: SnacDecoder, coarse: int) -> None:
    codes = random_codes(SNAC_24KHZ, 1, coarse)
    with torch.no_grad():
        torch.testing.assert_close(decoder.embed_codes(codes), reference.quantizer.from_codes(codes),
                                   atol=ATOL, rtol=0)
    expected, got = seeded_decodes(reference, decoder, codes)
    assert got.shape == (1, 1, coarse * 2048) == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert expected.std() > 0.05   # the weights make real signal, not a flat line


def test_matches_package_batched(reference: torch.nn.Module, decoder: SnacDecoder) -> None:
    """With the global generator, a batch draws what the package draws for that batch."""
    codes = random_codes(SNAC_24KHZ, 3, WINDOW, seed=3)
    expected, got = seeded_decodes(reference, decoder, codes)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("form", ["safetensors", "old_weight_norm"])
def test_checkpoint_forms(reference: torch.nn.Module, tmp_path: Path, form: str) -> None:
    state = reference.state_dict()
    if form == "old_weight_norm":
        folder = save_folder(tmp_path, SNAC_24KHZ, old_weight_norm_names(state))
    else:
        folder = save_folder(tmp_path, SNAC_24KHZ, state, fmt="safetensors")
    codes = random_codes(SNAC_24KHZ, 1, WINDOW, seed=11)
    expected, got = seeded_decodes(reference, load_snac_decoder(folder), codes)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("cfg", [SMALL_ATTENTION, SMALL_PLAIN], ids=["attention", "plain"])
def test_other_configs_match_package(tmp_path: Path, cfg: SnacConfig) -> None:
    ref = make_reference(cfg, seed=5)
    decoder = load_snac_decoder(save_folder(tmp_path, cfg, ref.state_dict()))
    codes = random_codes(cfg, 2, 2)   # 16 latent frames for the attention config: two windows
    expected, got = seeded_decodes(ref, decoder, codes)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- played spans


@pytest.mark.parametrize("coarse,play", [(4, (2048, 4096)), (4, (2048, 8192)), (3, (2048, 6144)), (2, (2048, 4096)),
                                         (4, (0, 100)), (4, (8191, 8192)), (1, (0, 2048)), (4, (0, 8192))])
def test_a_played_span_equals_the_whole_decode_there(decoder: SnacDecoder, coarse: int,
                                                     play: tuple[int, int]) -> None:
    """Orpheus's windows play one frame of four (and a stream's last window
    the frames from the second on): the layers compute only what those
    samples depend on, with the padding of the signal's true ends, and give
    the whole decode's samples (seeded noise, and the generator's)."""
    codes = random_codes(SNAC_24KHZ, 2, coarse, seed=23)
    seeds = torch.tensor([11, -4])
    whole = decoder.decode(codes, seeds=seeds)
    part = decoder.decode(codes, seeds=seeds, play=play)
    assert part.shape == (2, 1, play[1] - play[0])
    torch.testing.assert_close(part, whole[..., play[0]:play[1]], atol=2e-6, rtol=0)
    drawn = decoder.decode(codes, generator=torch.Generator().manual_seed(8), play=play)
    again = decoder.decode(codes, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(drawn, again[..., play[0]:play[1]], atol=2e-6, rtol=0)


@pytest.mark.parametrize("play", [None, (2048, 4096), (2048, 6144)])
def test_fused_residual_units_decode_as_the_modules(decoder: SnacDecoder, play: tuple[int, int] | None) -> None:
    """The passes CUDA runs (each snake computed once and carried to what
    reads it, 1x1 convs as batched GEMMs), here through their torch
    references: the modules' samples, whole or over a played span."""
    codes = random_codes(SNAC_24KHZ, 2, 3, seed=24)
    seeds = torch.tensor([3, 77])
    modules = decoder.decode(codes, seeds=seeds, play=play, fused=False)
    fused = decoder.decode(codes, seeds=seeds, play=play, fused=True)
    torch.testing.assert_close(fused, modules, atol=2e-6, rtol=0)
    quiet = decoder.decode(codes, noise=False, play=play, fused=True)
    torch.testing.assert_close(quiet, decoder.decode(codes, noise=False, play=play), atol=2e-6, rtol=0)


@pytest.mark.parametrize("cfg", [SMALL_ATTENTION, SMALL_PLAIN], ids=["attention", "plain"])
def test_played_spans_of_other_configs(tmp_path: Path, cfg: SnacConfig) -> None:
    """A local attention sees its whole signal (no span before it), and a
    plain (not depthwise) stem and residual convolution take spans too."""
    decoder = load_snac_decoder(save_folder(tmp_path, cfg, make_reference(cfg, seed=6).state_dict()))
    codes = random_codes(cfg, 2, 2)
    whole = decoder.decode(codes, noise=False)
    length = whole.shape[-1]
    for play in ((length // 4, length // 2), (0, 3), (length - 5, length)):
        part = decoder.decode(codes, noise=False, play=play)
        torch.testing.assert_close(part, whole[..., play[0]:play[1]], atol=2e-6, rtol=0)


def test_an_empty_played_span_is_no_samples(decoder: SnacDecoder) -> None:
    codes = random_codes(SNAC_24KHZ, 2, 2, seed=25)
    for play in ((0, 0), (5, 5), (4096, 4096)):
        assert decoder.decode(codes, seeds=torch.tensor([1, 2]), play=play).shape == (2, 1, 0)


def test_spans_reject_what_they_do_not_hold() -> None:
    with pytest.raises(ValueError, match="does not lie"):
        Span(3, 2, 10)
    with pytest.raises(ValueError, match="not inside"):
        take(torch.zeros(1, 1, 4), Span(2, 6, 10), Span(1, 3, 10))


# ---------------------------------------------------------------- batching and noise


def test_batched_equals_alone(decoder: SnacDecoder) -> None:
    codes = random_codes(SNAC_24KHZ, 4, WINDOW, seed=21)
    seeds = torch.tensor([5, 6, -7, 2**40 + 3])
    quiet = decoder.decode(codes, noise=False)
    noisy = decoder.decode(codes, seeds=seeds)
    for row in range(4):
        alone = [c[row:row + 1] for c in codes]
        torch.testing.assert_close(decoder.decode(alone, noise=False), quiet[row:row + 1], atol=1e-5, rtol=0)
        torch.testing.assert_close(decoder.decode(alone, seeds=seeds[row:row + 1]), noisy[row:row + 1],
                                   atol=1e-5, rtol=0)
    assert (noisy - quiet).abs().max() > 1e-3   # the seeded noise is really there


def test_generator_makes_batches_deterministic(decoder: SnacDecoder) -> None:
    codes = random_codes(SNAC_24KHZ, 2, WINDOW, seed=22)
    first = decoder.decode(codes, generator=torch.Generator().manual_seed(3))
    again = decoder.decode(codes, generator=torch.Generator().manual_seed(3))
    other = decoder.decode(codes, generator=torch.Generator().manual_seed(4))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_seeded_noise_is_standard_normal() -> None:
    seeds = torch.arange(8)
    draw = seeded_normal(seeds, block=0, length=20_000)
    assert draw.shape == (8, 20_000)
    assert abs(draw.mean().item()) < 0.01 and abs(draw.std().item() - 1.0) < 0.01
    assert abs(torch.corrcoef(draw[:2])[0, 1].item()) < 0.03     # rows are independent
    assert not torch.equal(seeded_normal(seeds, 1, 100), seeded_normal(seeds, 0, 100))
    # a row's draw does not depend on the rows beside it, or on the length drawn
    torch.testing.assert_close(seeded_normal(seeds[3:4], 0, 50), draw[3:4, :50], atol=0, rtol=0)


# ---------------------------------------------------------------- loader


def test_missing_and_unexpected_tensors(reference: torch.nn.Module, tmp_path: Path) -> None:
    state = dict(reference.state_dict())
    del state["decoder.model.3.block.0.alpha"]
    state["decoder.model.99.weight"] = torch.zeros(1)
    state["encoder.block.0.whatever"] = torch.zeros(1)      # encoder tensors are ignored
    folder = save_folder(tmp_path, SNAC_24KHZ, state)
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\): decoder\.model\.3\.block\.0\.alpha; "
                                          r"unexpected 1 tensor\(s\): decoder\.model\.99\.weight"):
        load_snac_decoder(folder)


def test_shape_mismatch_and_no_checkpoint(reference: torch.nn.Module, tmp_path: Path) -> None:
    bigger = SnacConfig.from_dict({**SNAC_24KHZ.to_dict(), "codebook_size": 8192})
    with pytest.raises(ConfigError, match=r"codebook\.weight' has shape \(4096, 8\).*\(8192, 8\)"):
        load_snac_decoder(save_folder(tmp_path / "a", bigger, reference.state_dict()))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(SNAC_24KHZ.to_dict()))
    with pytest.raises(ConfigError, match="no pytorch_model.bin"):
        load_snac_decoder(tmp_path / "b")


def test_dummy_weights_are_seeded() -> None:
    a = load_snac_decoder(None, load_format="dummy")
    b = load_snac_decoder(None, load_format="dummy")
    c = load_snac_decoder(None, load_format="dummy", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.levels[0].codebook.weight, c.levels[0].codebook.weight)
    audio = a.decode(random_codes(SNAC_24KHZ, 1, WINDOW), noise=False)
    assert audio.shape == (1, 1, 8192) and torch.isfinite(audio).all()
    assert 0.01 < audio.std() and audio.abs().max() < 1.0


def test_bad_codes(decoder: SnacDecoder) -> None:
    codes = random_codes(SNAC_24KHZ, 1, WINDOW)
    with pytest.raises(ValueError, match="3 levels"):
        decoder.decode(codes[:2])
    with pytest.raises(ValueError, match=r"level 2 codes have shape \(1, 15\), expected \(1, 16\)"):
        decoder.decode([codes[0], codes[1], codes[2][:, :15]])


# ---------------------------------------------------------------- precision


def test_bf16_error_report(decoder: SnacDecoder, folder: Path) -> None:
    """Not a parity bound: measures how far a bf16 decode lands from fp32
    (same seeded noise), printed for the record; loosely bounded."""
    half = load_snac_decoder(folder, dtype=torch.bfloat16)
    codes = random_codes(SNAC_24KHZ, 2, WINDOW, seed=31)
    seeds = torch.tensor([1, 2])
    full = decoder.decode(codes, seeds=seeds)
    low = half.decode(codes, seeds=seeds).float()
    err = (low - full).abs()
    rel = (err.pow(2).mean() / full.pow(2).mean()).sqrt().item()
    print(f"\nsnac bf16 vs fp32: max abs {err.max().item():.4f}, mean abs {err.mean().item():.5f}, "
          f"relative rms {rel:.4f}")
    assert rel < 0.25


def test_in_place_inference_equals_autograd_path() -> None:
    """decode's in-place arithmetic (no grad) computes what the plain
    expressions compute with autograd on."""
    decoder = load_snac_decoder(None, load_format="dummy", config=SMALL_ATTENTION)
    codes = random_codes(SMALL_ATTENTION, 2, 2)
    with torch.no_grad():
        z = decoder.embed_codes(codes)
    seeds = torch.tensor([3, 4])
    with torch.enable_grad():
        plain = decoder.synthesize(z.clone().requires_grad_(True), SeededNoise(seeds))
    torch.testing.assert_close(decoder.decode(codes, seeds=seeds), plain.detach(), atol=0, rtol=0)
