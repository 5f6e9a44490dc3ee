"""Qwen3-Omni's audio input side against transformers, in float32: log-mel
features against the Whisper feature extractor as the processor calls it;
the audio encoder, loaded from a tiny random folder transformers saved,
against transformers' audio tower per clip (attention windows of 4 s, so a
5.55 s clip spans two) and batched; and the splice: transformers' thinker
with its own audio tower equals the thinker given the token embeddings with
the placeholder rows replaced by mstar's encoder rows and mstar's M-RoPE
positions, in prefill logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

from mstar.errors import ConfigError, RequestError
from mstar.models.qwen3_omni.config import Qwen3OmniConfig
from mstar.models.layers.linear import padded_rows
from mstar.models.qwen3_omni.encoders.audio import AudioEncoder, AudioLayout, load_audio_encoder
from mstar.models.qwen3_omni.encoders.mel import LogMel, mel_frames
from mstar.models.qwen3_omni.positions import audio_tokens, mrope_positions
from test_qwen3_omni_config import tiny

WINDOW_FRAMES = 400   # the tiny model's attention window: 4 s, 52 tokens
# 0.7 s (less than a chunk), 2.3 s (not a whole number of hops), 5.55 s (two windows), 1.45 s
SAMPLES = (11_200, 36_805, 88_800, 23_230)


def _clip(samples: int, seed: int) -> torch.Tensor:
    """A tone over noise, with a near-silent stretch so the max - 8 floor acts."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(samples) / 16_000
    wave = 0.3 * torch.sin(2 * torch.pi * (220 + 100 * seed) * t) + 0.05 * torch.randn(samples, generator=g)
    wave[samples // 3: samples // 2] *= 1e-5
    return wave.float()


CLIPS = [_clip(n, k) for k, n in enumerate(SAMPLES)]


def _extract(clip: torch.Tensor) -> tuple[np.ndarray, int]:
    """The features and valid frames transformers' processor gives one clip
    (its audio kwargs: 16 kHz, padding, no truncation, the attention mask)."""
    out = WhisperFeatureExtractor(feature_size=128)(clip.numpy(), sampling_rate=16_000, padding=True,
                                                    truncation=False, return_attention_mask=True,
                                                    return_tensors="np")
    return out["input_features"][0], int(out["attention_mask"].sum())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3OmniMoeForConditionalGeneration]:
    cfg = tiny()
    cfg.thinker_config.audio_config.n_window_infer = WINDOW_FRAMES
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers leaves stacked experts uninitialised
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    folder = tmp_path_factory.mktemp("omni-audio-weights")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def encoder(saved) -> AudioEncoder:
    folder, _ = saved
    enc = AudioEncoder(Qwen3OmniConfig.from_folder(folder).audio).eval()
    load_audio_encoder(enc, folder)
    return enc


def test_log_mel_equals_the_feature_extractor_for_each_clip() -> None:
    """One batched call over clips of different lengths gives each clip what
    the extractor gives it alone: the same valid frame count, and values
    within 1e-5 of its torch STFT path (the same float32 FFT; seen: 6e-8)
    and 1e-4 of its numpy path (a float64 FFT; seen: 3e-5)."""
    clips = CLIPS + [CLIPS[0][:201], CLIPS[1][:330]]  # the shortest clip it takes: one frame
    got = LogMel()(clips)
    fe = WhisperFeatureExtractor(feature_size=128)
    for clip, ours in zip(clips, got):
        want, frames = _extract(clip)
        assert ours.dtype == torch.float32 and ours.shape == (128, frames) == (128, mel_frames(clip.numel()))
        torch.testing.assert_close(ours, torch.from_numpy(want), atol=1e-5, rtol=0)
        numpy_path = fe._np_extract_fbank_features(clip.numpy()[None], "cpu")[0]
        torch.testing.assert_close(ours, torch.from_numpy(numpy_path).float(), atol=1e-4, rtol=0)
    assert float(got[0].min()) == pytest.approx(float(got[0].max()) - 2.0)  # the floor: 8 in log10, / 4


@pytest.mark.parametrize("clip, says", [
    (torch.zeros(0), "audio is empty"),
    (torch.zeros(200), r"at least 12.6 ms \(201 samples\)"),
    (torch.tensor([0.1] * 300 + [float("nan")]), "not a finite number"),
    (torch.tensor([0.1] * 300 + [float("inf")]), "not a finite number"),
    (torch.zeros(2, 16_000), "one channel"),
    (torch.zeros(16_000, dtype=torch.int16), "must be floats"),
])
def test_bad_audio_is_refused_naming_its_field(clip: torch.Tensor, says: str) -> None:
    with pytest.raises(RequestError, match=says) as err:
        LogMel()([CLIPS[0], clip], fields=["messages[0].content[0]", "messages[0].content[2]"])
    assert err.value.field == "messages[0].content[2]"


def test_the_layout_counts_the_tokens_the_prompt_holds() -> None:
    """Every length from one frame to 10 s: the encoder's chunks leave
    `positions.audio_tokens` tokens a clip, the count transformers prompts
    with, and 52-token windows tile each clip from its start."""
    frames = list(range(1, 1001))
    layout = AudioLayout.of(frames, 52)
    assert layout.tokens == tuple(audio_tokens(n) for n in frames)
    assert layout.window_slots.numel() == sum(layout.tokens) == int(layout.key_mask.sum())
    assert layout.key_mask.shape == (sum(-(-n // 52) for n in layout.tokens), 52)


def _tower(model: Qwen3OmniMoeForConditionalGeneration, features: list[torch.Tensor]) -> torch.Tensor:
    return model.thinker.model.audio_tower(torch.cat(features, dim=1),
                                           feature_lens=torch.tensor([f.shape[1] for f in features])).last_hidden_state


@torch.inference_mode()
def test_the_encoder_equals_transformers_audio_tower_clip_by_clip(saved, encoder: AudioEncoder) -> None:
    """Each clip's rows, from one batched pass, equal transformers' tower
    given that clip alone (1e-5: the same float32 ops; seen: 2e-8), and the
    5.55 s clip's 72 tokens span two attention windows."""
    _, model = saved
    features = LogMel()(CLIPS)
    got = encoder(features)
    counts = [audio_tokens(f.shape[1]) for f in features]
    assert got.shape == (sum(counts), 64) and got.dtype == torch.float32
    assert counts[2] == 72 > encoder.window == 52
    for clip, (rows, f) in enumerate(zip(got.split(counts), features)):
        torch.testing.assert_close(rows, _tower(model, [f]), atol=1e-5, rtol=1e-5, msg=f"clip {clip}")


@torch.inference_mode()
def test_a_batch_equals_each_clip_alone(saved, encoder: AudioEncoder) -> None:
    """Clips of one chunk or less keep their rows in a batch (1e-6), where
    transformers' batched tower pads them to a full chunk and changes them;
    its rows for clips over one chunk are ours."""
    _, model = saved
    features = LogMel()(CLIPS) + [torch.randn(128, 37), torch.randn(128, 100)]
    counts = [audio_tokens(f.shape[1]) for f in features]
    alone = [encoder([f]) for f in features]
    torch.testing.assert_close(encoder(features), torch.cat(alone), atol=1e-6, rtol=1e-6)
    batched = _tower(model, features).split(counts)
    for f, theirs, ours in zip(features, batched, alone):
        if f.shape[1] >= 100:
            torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
        else:
            assert (theirs - _tower(model, [f])).abs().max() > 1e-6  # transformers' own batch changes the clip
            torch.testing.assert_close(ours, _tower(model, [f]), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_padded_grids_leave_every_clip_as_it_was(saved, encoder: AudioEncoder) -> None:
    """On padded grids (as on CUDA: chunks and token rows at `padded_rows`)
    the clips' rows are the unpadded ones (1e-6: only GEMM shapes differ),
    and no more rows come out."""
    features = LogMel()(CLIPS) + [torch.randn(128, 37), torch.randn(128, 100), torch.randn(128, 900)]
    frames = [f.shape[1] for f in features]
    layout = AudioLayout.of(frames, encoder.window, padded=True)
    plain = AudioLayout.of(frames, encoder.window)
    assert layout.chunks == padded_rows(plain.chunks) > plain.chunks
    assert layout.token_slots.numel() == padded_rows(sum(plain.tokens)) > sum(plain.tokens)
    assert layout.tokens == plain.tokens and int(layout.key_mask.sum()) == layout.token_slots.numel()
    want = encoder(features)
    encoder.padded = True
    try:
        got = encoder(features)
    finally:
        encoder.padded = None
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
@torch.inference_mode()
def test_the_encoder_on_cuda_gives_the_cpu_rows(saved, encoder: AudioEncoder) -> None:
    """On CUDA the clips go on padded grids and attention takes torch's
    efficient kernel: float32 rows within 1e-4 of the CPU's, two batches of
    different sizes in a row."""
    import copy

    features = LogMel()(CLIPS) + [torch.randn(128, 37), torch.randn(128, 900)]
    gpu = copy.deepcopy(encoder).to("cuda")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # cuDNN's default is TF32
    try:
        for batch in (features, features[:3]):
            got = gpu([f.cuda() for f in batch])
            torch.testing.assert_close(got.cpu(), encoder(batch), atol=1e-4, rtol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_the_loader_names_missing_and_unexpected_tensors(saved, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = saved
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["thinker.audio_tower.layers.0.fc1.bias"]
    tensors["thinker.audio_tower.conv2d4.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    enc = AudioEncoder(Qwen3OmniConfig.from_folder(folder).audio)
    with pytest.raises(ConfigError, match=r"missing 1 tensor\(s\): layers\.0\.fc1\.bias; unexpected 1 tensor\(s\): "
                                          r"thinker\.audio_tower\.conv2d4\.weight"):
        load_audio_encoder(enc, tmp_path)


@torch.inference_mode()
def test_encoder_rows_spliced_into_the_prompt_give_transformers_prefill_logits(saved, encoder: AudioEncoder) -> None:
    """A user turn of text, a 2.3 s clip, text, a 5.55 s clip: transformers'
    thinker encoding the extractor's features itself, against its prefill
    from the token embeddings with mstar's encoder rows at the placeholders
    and mstar's positions. The logits here are within +-0.3, so the bound is
    1e-6 (seen: 7e-8, the encoder rows' float32 rounding; attending across
    the 5.55 s clip's windows moves them by 5e-6)."""
    folder, model = saved
    cfg = Qwen3OmniConfig.from_folder(folder)
    ids_cfg = cfg.ids
    picked = [CLIPS[1], CLIPS[2]]
    frames = [mel_frames(c.numel()) for c in picked]
    audio_end = ids_cfg.audio_start + 1

    def clip_tokens(n: int) -> list[int]:
        return [ids_cfg.audio_start] + [ids_cfg.audio] * audio_tokens(n) + [audio_end]

    ids = ([ids_cfg.im_start, ids_cfg.user, 198, 100, 2001] + clip_tokens(frames[0]) + [37, 4242]
           + clip_tokens(frames[1]) + [ids_cfg.im_end, 198, ids_cfg.im_start, ids_cfg.assistant, 198])
    input_ids = torch.tensor([ids])

    extracted = [torch.from_numpy(_extract(c)[0]) for c in picked]
    padded = torch.zeros(2, 128, max(frames))
    mask = torch.zeros(2, max(frames), dtype=torch.long)
    for k, f in enumerate(extracted):
        padded[k, :, :f.shape[1]], mask[k, :f.shape[1]] = f, 1
    want = model.thinker(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), input_features=padded,
                         feature_attention_mask=mask).logits

    rows = encoder(LogMel()(picked))
    embeds = model.thinker.get_input_embeddings()(input_ids).clone()
    placeholders = input_ids[0] == ids_cfg.audio
    assert int(placeholders.sum()) == rows.shape[0]
    embeds[0, placeholders] = rows
    positions, delta = mrope_positions(ids, audio_id=ids_cfg.audio, image_id=ids_cfg.image, audio_frames=frames)
    assert delta == 0
    got = model.thinker(inputs_embeds=embeds, attention_mask=torch.ones_like(input_ids),
                        position_ids=positions[:, None, :].float()).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # the splice is what carries the audio: the placeholder embeddings alone give other logits
    plain = model.thinker(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    assert (plain - want).abs().max() > 1e-3


@pytest.mark.parametrize("field, value, says", [
    ("n_window", 100, r"n_window is 100; only 50"),
    ("n_window_infer", 60, r"n_window_infer 60 is shorter than one chunk"),
    ("activation_function", "relu", r"activation_function must be gelu"),
])
def test_an_audio_config_the_encoder_cannot_follow_is_refused(field: str, value: object, says: str) -> None:
    data = tiny().to_dict()
    data["thinker_config"]["audio_config"][field] = value
    with pytest.raises(ConfigError, match=r"thinker_config\.audio_config.*" + says):
        Qwen3OmniConfig.from_dict(data)
