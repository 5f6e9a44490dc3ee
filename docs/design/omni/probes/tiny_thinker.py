import time
t0 = time.time()
import torch
from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

torch.manual_seed(0)
# small vocab; special ids remapped into it
AUD, AUD_S, AUD_E, IMG, VID, VIS_S, VIS_E = 250, 251, 252, 253, 254, 255, 256
cfg = Qwen3OmniMoeThinkerConfig(
    text_config=dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, intermediate_size=128, norm_topk_prob=True,
                     rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[4, 2, 2], interleaved=True)),
    audio_config=dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                      encoder_ffn_dim=64, downsample_hidden_size=8, output_dim=64, n_window=50, n_window_infer=800),
    vision_config=dict(depth=3, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                       num_position_embeddings=64, deepstack_visual_indexes=[0, 1, 2]),
    audio_token_id=AUD, audio_start_token_id=AUD_S, audio_end_token_id=AUD_E, image_token_id=IMG,
    video_token_id=VID, vision_start_token_id=VIS_S, vision_end_token_id=VIS_E, position_id_per_seconds=13,
)
cfg._attn_implementation = "eager"
model = Qwen3OmniMoeThinkerForConditionalGeneration(cfg).eval()
print("params", sum(p.numel() for p in model.parameters()))
print(model.model.language_model.layers[0].self_attn.q_proj, model.model.language_model.layers[0].mlp.__class__.__name__)

# 1) text-only forward
ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
print("text logits", tuple(out.logits.shape), "n_hidden", len(out.hidden_states), "rope_deltas", model.model.rope_deltas.tolist())

# 2) audio forward: 250 mel frames -> N audio tokens
T = 250
n_aud = int(_get_feat_extract_output_lengths(torch.tensor(T)))
feats = torch.randn(1, 128, T)
fmask = torch.ones(1, T, dtype=torch.long)
ids = torch.tensor([[1, 2, AUD_S] + [AUD] * n_aud + [AUD_E, 7, 8]])
with torch.no_grad():
    af = model.model.get_audio_features(feats, fmask).last_hidden_state
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=feats, feature_attention_mask=fmask)
print("audio frames", T, "-> tokens", n_aud, "audio feats", tuple(af.shape), "logits", tuple(out.logits.shape))
pos, delta = model.get_rope_index(ids, None, None, torch.ones_like(ids), False, fmask.sum(-1))
print("audio-only pos row0", pos[0, 0].long().tolist(), "delta", delta.tolist())

# 3) image forward: 64x96 px image -> grid (1,4,6) patches -> 6 merged tokens (patch vector = 3*2*16*16)
thw = torch.tensor([[1, 4, 6]])
n_img = int(thw.prod() // 4)
pix = torch.randn(int(thw.prod()), 3 * 2 * 16 * 16)
ids = torch.tensor([[1, 2, VIS_S] + [IMG] * n_img + [VIS_E, AUD_S] + [AUD] * n_aud + [AUD_E, 7, 8]])
am = torch.ones_like(ids)
pos, delta = model.get_rope_index(ids, thw, None, am, False, fmask.sum(-1))
print("img+audio pos T", pos[0, 0].long().tolist()); print("            H", pos[1, 0].long().tolist()); print("            W", pos[2, 0].long().tolist())
print("delta", delta.tolist(), "seq", ids.shape[1])
with torch.no_grad():
    out = model(input_ids=ids, attention_mask=am, input_features=feats, feature_attention_mask=fmask,
                pixel_values=pix, image_grid_thw=thw)
print("img+audio logits", tuple(out.logits.shape))

# 4) generate with hidden states (what the talker consumes)
with torch.no_grad():
    g = model.generate(input_ids=ids, attention_mask=am, input_features=feats, feature_attention_mask=fmask,
                       pixel_values=pix, image_grid_thw=thw, max_new_tokens=4, do_sample=False,
                       output_hidden_states=True, return_dict_in_generate=True)
print("sequences", tuple(g.sequences.shape), "steps", len(g.hidden_states),
      "per-step layers", len(g.hidden_states[0]),
      "step shapes", [tuple(s[0].shape) for s in g.hidden_states])
emb = torch.cat([s[0] for s in g.hidden_states], 1)
print("concat layer-0 hidden", tuple(emb.shape), "(= seq_len - 1)")
print("rope_deltas after generate", model.model.rope_deltas.tolist())
print("TOTAL seconds", round(time.time() - t0, 2))
