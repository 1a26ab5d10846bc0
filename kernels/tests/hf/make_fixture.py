"""Regenerates tests/hf/fixture.json: tiny float32 DeepseekV3 pieces run through Hugging Face
transformers, so the CPU reference can be checked against the real thing.

Run where torch + transformers (>= 5) are installed:  python3 make_fixture.py > fixture.json
"""
import json
import sys

import torch
import transformers
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

torch.manual_seed(0)
torch.set_default_dtype(torch.float32)


def flat(t):
    return [float(v) for v in t.detach().reshape(-1).tolist()]


def init_(module, scale):
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-scale, scale)


ROPE = {
    "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
}
base = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=6,
    num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2,
    num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, rope_interleave=True,
    max_position_embeddings=163840, attention_bias=False,
)


def make_cfg(**overrides):
    kw = {**base, **overrides}
    try:
        c = DeepseekV3Config(**kw, rope_parameters=dict(ROPE))
    except TypeError:
        c = DeepseekV3Config(**kw, rope_scaling=dict(ROPE), rope_theta=10000.0)
    c._attn_implementation = "eager"
    return c


cfg = make_cfg()

out = {"transformers": transformers.__version__, "torch": torch.__version__}

# --- RoPE: DeepSeek-V3's YaRN table (dim 64) and the interleaved application. ---
rot64 = m.DeepseekV3RotaryEmbedding(make_cfg(qk_rope_head_dim=64))
positions = torch.tensor([[0, 1, 7, 4095, 163839]])
x = torch.empty(1, 2, 5, 64).uniform_(-1, 1)  # [b, heads, seq, dim]
cos, sin = rot64(x, positions)
q_out, _ = m.apply_rotary_pos_emb_interleave(x, x[:, :1], cos, sin)
out["rope"] = {
    "inv_freq": flat(rot64.inv_freq), "attention_scaling": float(rot64.attention_scaling),
    "positions": positions[0].tolist(), "cos": flat(cos), "sin": flat(sin),
    "x": flat(x), "x_out": flat(q_out),
}

# --- One attention layer, fresh prompt of 6 tokens, eager causal attention. ---
rot = m.DeepseekV3RotaryEmbedding(cfg)
attn = m.DeepseekV3Attention(cfg, layer_idx=0)
init_(attn, 0.3)
with torch.no_grad():
    attn.q_a_layernorm.weight.uniform_(0.5, 1.5)
    attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
S = 6
h = torch.empty(1, S, 32).uniform_(-1, 1)
pos = torch.arange(S)[None]
pe = rot(h, pos)
mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
with torch.no_grad():
    a_out = attn(hidden_states=h, position_embeddings=pe, attention_mask=mask)[0]
out["attn"] = {
    "scaling": float(attn.scaling),
    "weights": {n: flat(p) for n, p in attn.named_parameters()},
    "shapes": {n: list(p.shape) for n, p in attn.named_parameters()},
    "hidden": flat(h), "out": flat(a_out),
}

# --- One MoE layer, 5 tokens, with a mixed-sign correction bias. ---
moe = m.DeepseekV3MoE(cfg)
init_(moe, 0.3)
with torch.no_grad():
    moe.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
xm = torch.empty(5, 32).uniform_(-1, 1)
with torch.no_grad():
    g = moe.gate(xm)  # its return layout differs across transformers versions: keep all of it
    gate_out = [t.tolist() for t in (g if isinstance(g, tuple) else (g,))]
    m_out = moe(xm[None])[0]
out["moe"] = {
    "weights": {n: flat(p) for n, p in moe.named_parameters()},
    "shapes": {n: list(p.shape) for n, p in moe.named_parameters()},
    "bias": flat(moe.gate.e_score_correction_bias),
    "x": flat(xm), "gate_out": gate_out, "out": flat(m_out),
}
json.dump(out, sys.stdout)
