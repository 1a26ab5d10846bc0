#!/usr/bin/env python3
"""Tiny DeepSeek-V2 checkpoints and transformers' logits on them: the outside reference for
ferry's DeepSeek-V2 support (softmax routing; `model/tests/parity.rs`, module `deepseek_v2`).

Two models under models/tiny-v2/, each a Hugging Face `DeepseekV2ForCausalLM` in float32 with
seeded random weights (transformers' own init, the router's weights scaled up so routing is
decisive, not a near-tie of 1/E scores):

  greedy/   V2-Lite's structure: full-rank q, one dense layer then MoE, 8 routed experts top-2 +
            1 shared, `topk_method: greedy`, YaRN RoPE with mscale (as V2-Lite's config)
  grouped/  V2's structure: low-rank q, `group_limited_greedy` with 4 groups keeping 2, top-3,
            `routed_scaling_factor` 16

For each: config.json, model.safetensors, and golden.safetensors holding the float32 logits of
every position of three fixed token sequences (transformers 5.25, float32, CPU, eager attention).

  python3 scripts/make_tiny_v2.py            # needs torch and transformers
"""
import json
import os

import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "models", "tiny-v2")
SEQUENCES = [
    [1, 17, 200, 5, 99, 42, 42, 7],
    [1] + [(i * 37 + 11) % 250 + 3 for i in range(40)],
    [3, 4],
]

COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)

MODELS = {
    "greedy": dict(
        q_lora_rank=None, num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="greedy",
        routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=128, beta_fast=32, beta_slow=1,
                             mscale=0.707, mscale_all_dim=0.707),
    ),
    "grouped": dict(
        q_lora_rank=24, num_experts_per_tok=3, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=16.0, norm_topk_prob=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
}


def main():
    torch.manual_seed(0)
    for name, extra in MODELS.items():
        out = os.path.join(ROOT, name)
        os.makedirs(out, exist_ok=True)
        config = DeepseekV2Config(**COMMON, **extra, attn_implementation="eager")
        model = DeepseekV2ForCausalLM(config).float().eval()
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.weight.mul_(40.0)
        model.save_pretrained(out, safe_serialization=True)
        golden = {}
        with torch.no_grad():
            for i, ids in enumerate(SEQUENCES):
                logits = model(torch.tensor([ids])).logits[0].float().contiguous()
                golden[f"logits_{i}"] = logits
        save_file(golden, os.path.join(out, "golden.safetensors"))
        with open(os.path.join(out, "sequences.json"), "w") as f:
            json.dump({"sequences": SEQUENCES, "transformers": __import__("transformers").__version__,
                       "torch": torch.__version__}, f, indent=1)
        print(name, sum(p.numel() for p in model.parameters()), "parameters")


if __name__ == "__main__":
    main()
