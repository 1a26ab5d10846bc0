#!/usr/bin/env python3
"""PyTorch SDPA (cuDNN backend) on the MHA-form MLA prefill shapes, the peer of
`ferry bench-gpu`'s flash kernel numbers (BENCHMARKS.md, "GPU backend").

Causal self-attention, batch 1, bf16, q/k head dim 192, v head dim 128, 12 and 16 heads, at
4k / 16k / 64k tokens. TFLOP/s counts 2·(192 + 128)·H·N²/2 FLOP, the same formula the Rust
benchmark uses. Prints a Markdown table. Needs a CUDA GPU and PyTorch >= 2.5.

    python3 scripts/bench_sdpa.py [--tokens 4096,16384,65536] [--heads 12,16]
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def bench(heads: int, n: int, backend) -> float:
    """Mean milliseconds of one causal SDPA call."""
    q = torch.randn(1, heads, n, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, heads, n, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16)
    reps = 3 if n >= 32768 else 10
    with sdpa_kernel(backend):
        for _ in range(2):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        stop.record()
        stop.synchronize()
    return start.elapsed_time(stop) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,16384,65536")
    ap.add_argument("--heads", default="12,16")
    args = ap.parse_args()
    print(f"### PyTorch {torch.__version__} SDPA, cuDNN backend ({torch.cuda.get_device_name()})\n")
    print("| heads | tokens | ms | TFLOP/s |\n|---|---|---|---|")
    for h in [int(x) for x in args.heads.split(",")]:
        for n in [int(x) for x in args.tokens.split(",")]:
            try:
                ms = bench(h, n, SDPBackend.CUDNN_ATTENTION)
                flops = 2 * (192 + 128) * h * n * n / 2
                print(f"| {h} | {n} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
            except RuntimeError as e:  # backend refused the shape
                print(f"| {h} | {n} | error: {str(e).splitlines()[0]} | |")
    print()


if __name__ == "__main__":
    main()
