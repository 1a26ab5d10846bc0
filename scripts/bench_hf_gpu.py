#!/usr/bin/env python3
"""The transformers peer for issue 13's reference shape on one GPU: the same config
(default `models/dummy/deepseek-v2-lite`), seeded random bf16 weights drawn on the device, a
batch of random prompts of `--prompt-len` tokens, then `--decode-steps` greedy steps with the
model's own KV cache — what a plain `transformers` server would do per batch (no continuous
batching, no paged cache). Prints a Markdown table and writes JSON rows comparable with
`ferry bench-gpu`'s batched decode table and `scripts/bench_reference_shape.sh`:

  python3 scripts/bench_hf_gpu.py --batch 1,4,16,64 --prompt-len 1024 --decode-steps 32 \
      --json benchmarks/results/DATE-hf-v2-lite-h200.json

Time to first token = the batch's prefill forward (wall clock, synchronised); step time = the
median decode step. Attention is transformers' default for the model (`sdpa` where supported).
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def measure(model, batch, prompt_len, steps, vocab, seed):
    g = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
    ids = torch.randint(16, vocab, (batch, prompt_len), generator=g, device=DEVICE)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        ttft = time.perf_counter() - t0
        cache = out.past_key_values
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            times.append(time.perf_counter() - t0)
    return ttft, statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / "models" / "dummy" / "deepseek-v2-lite"))
    p.add_argument("--batch", default="1,4,16,64")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--device", default="cuda", help="cpu only to try the script on a tiny model")
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    torch.manual_seed(a.seed)
    config = AutoConfig.from_pretrained(a.model)
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    sync()
    params = sum(x.numel() for x in model.parameters())
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}; {params / 1e9:.2f} B parameters drawn in "
        f"{time.perf_counter() - t0:.1f} s; attention {model.config._attn_implementation}"
    )
    vocab = config.vocab_size
    # Warm-up: kernels, allocator.
    measure(model, 1, 64, 2, vocab, 99)
    rows = []
    print("| batch | prompt | TTFT ms (batch prefill) | decode ms/step | decode tok/s |")
    print("|---|---|---|---|---|")
    for b in [int(x) for x in a.batch.split(",")]:
        try:
            ttft, step = measure(model, b, a.prompt_len, a.decode_steps, vocab, b)
        except torch.OutOfMemoryError as e:
            print(f"| {b} | {a.prompt_len} | out of memory | | |")
            rows.append({"batch": b, "error": f"out of memory: {e}"[:200]})
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            continue
        print(f"| {b} | {a.prompt_len} | {ttft * 1e3:.1f} | {step * 1e3:.2f} | {b / step:.0f} |")
        rows.append({"batch": b, "prompt_tokens": a.prompt_len, "ttft_ms": ttft * 1e3,
                     "decode_ms_per_step": step * 1e3, "decode_tok_s": b / step})
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps({
            "benchmark": "transformers peer for the reference shape: random bf16 weights on the "
                         "GPU, batch prefill then greedy decode steps with the model's KV cache",
            "model": a.model, "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
            "attention": model.config._attn_implementation,
            "decode_steps": a.decode_steps, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
