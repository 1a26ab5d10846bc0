#!/usr/bin/env python3
"""The peer for `ferry bench-engine`: the same model, shapes and thread count through Hugging Face
transformers (float32, eager attention) on CPU. Prints rows shaped like ferry's table.

  python3 scripts/bench_hf_cpu.py --batch 1,4,16 --prompt-len 512 --decode-steps 64
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def measure(model, batch, prompt_len, steps, vocab, salt):
    g = torch.Generator().manual_seed(1000 + salt)
    ids = torch.randint(16, vocab, (batch, prompt_len), generator=g)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t0
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        decode = time.perf_counter() - t0
    return batch * prompt_len / prefill, batch * steps / decode


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-k3"))
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    model = DeepseekV3ForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    print(f"transformers on CPU, torch threads {torch.get_num_threads()}")
    print("| batch | prompt | prefill tok/s | decode steps | decode tok/s |\n|---|---|---|---|---|")
    for b in [int(x) for x in a.batch.split(",")]:
        runs = [measure(model, b, a.prompt_len, a.decode_steps, vocab, r) for r in range(a.repeat)]
        pre = statistics.median(r[0] for r in runs)
        dec = statistics.median(r[1] for r in runs)
        print(f"| {b} | {a.prompt_len} | {pre:.0f} | {a.decode_steps} | {dec:.1f} |")


if __name__ == "__main__":
    main()
