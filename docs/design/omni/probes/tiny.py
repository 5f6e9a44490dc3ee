import time, torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
torch.manual_seed(0)
H=64; CB=64; G=4; TV=1024+CB   # talker vocab: suppressed range is [TV-1024, TV) minus codec_eos
rope = lambda hd: {"rope_type":"default","rope_theta":1e6,"mrope_section":[hd//2-2*(hd//2//3), hd//2//3, hd//2//3],"interleaved":True}
txt = dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, rope_parameters=rope(16))
cfg = Qwen3OmniMoeConfig(
  thinker_config=dict(vision_start_token_id=151652,
    text_config=dict(txt, vocab_size=152064),
    audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16, output_dim=H, downsample_hidden_size=8),
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H, deepstack_visual_indexes=[0]),
  ),
  talker_config=dict(
    text_config=dict(txt, vocab_size=TV, shared_expert_intermediate_size=32),
    code_predictor_config=dict(hidden_size=H, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=CB, num_code_groups=G,
                               rope_parameters={"rope_type":"default","rope_theta":1e6}),
    num_code_groups=G, thinker_hidden_size=H, accept_hidden_layer=1, spatial_merge_size=2,
    codec_pad_id=CB+0, codec_bos_id=CB+1, codec_eos_token_id=CB+2, codec_nothink_id=CB+3,
    codec_think_bos_id=CB+4, codec_think_eos_id=CB+5, speaker_id={"chelsie":CB+10,"ethan":CB+11,"aiden":CB+12},
  ),
  code2wav_config=dict(codebook_size=CB, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, num_quantizers=G, decoder_dim=64, sliding_window=8,
                       rope_parameters={"rope_type":"default","rope_theta":1e4}),
)
t0=time.time(); model = Qwen3OmniMoeForConditionalGeneration(cfg).eval(); print("build s", round(time.time()-t0,2))
print("params M", sum(p.numel() for p in model.parameters())/1e6)
# system / user / assistant prompt (token ids of the real Qwen tokenizer: 151644=<|im_start|>, 8948=system, 872=user, 77091=assistant, 198='\n', 151645=<|im_end|>)
ids = [151644,8948,198, 100,101, 151645,198, 151644,872,198, 200,201,202,203, 151645,198, 151644,77091,198]
input_ids = torch.tensor([ids])
# instrument talker forward
calls=[]
def pre(mod, a, k):
    e=k.get("inputs_embeds"); calls.append((None if e is None else tuple(e.shape), k.get("generation_step"), None if k.get("residual_codes") is None else tuple(k["residual_codes"].shape)))
model.talker.register_forward_pre_hook(pre, with_kwargs=True)
t0=time.time()
seqs, wav = model.generate(input_ids=input_ids, return_audio=True, thinker_max_new_tokens=6, talker_max_new_tokens=12,
                           thinker_do_sample=False, talker_do_sample=True)
dt=time.time()-t0
print("generate s", round(dt,2))
print("sequences", tuple(seqs.shape), seqs[0, len(ids):].tolist())
print("wav", type(wav), tuple(wav.shape), wav.dtype)
print("talker calls (inputs_embeds shape, generation_step, residual_codes shape):")
for c in calls: print("  ", c)
n = len([c for c in calls if c[2] is not None]); print("frames", n, "expected samples", 1920*n-555)
