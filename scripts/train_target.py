#!/usr/bin/env python3
"""Train a DeepSeek-V3-family target worth speculating on (issue 15), from scratch, seeded.

A Hugging Face `DeepseekV3ForCausalLM` with Kimi K3's per-rank attention shape (12 heads, MLA with
low-rank q and kv, separate nope / rope / v head dims), MoE layers of sigmoid-routed experts with an
`e_score_correction_bias` (DeepSeek-V3's auxiliary-loss-free balancing: the bias follows the
expert loads during training) and 2 shared experts, a dense first layer, YaRN RoPE. It trains on
the corpus of scripts/make_corpus.py (source code that Debian packages ship + the KJV) for at
most one epoch, inside a wall-clock budget, and writes a checkpoint ferry loads like any Hugging
Face one:

  OUT/config.json, OUT/model.safetensors (bf16, the original DeepSeek-V3 layout of
  scripts/make_tiny_k3.py's `to_deepseek_state_dict`; `--shard-mb` for shards + index),
  OUT/tokenizer.json, OUT/tokenizer_config.json (the corpus's tokenizer, ferry's chat template),
  OUT/train_report.json (tokens, epochs, train / held-out loss curve, wall time, tokens/s,
  parameters total and active, expert balance, greedy samples).

Presets (docs/spec_decode.md, "Training a target worth speculating on"):
  h200  20 layers, hidden 512, 32 routed experts (top 4) + 2 shared, seq 2048: the lease's
        target, ~6 minutes on one H200 (`--minutes`).
  tiny  4 layers, hidden 128: a CPU smoke test of the whole pipeline in a few minutes.

    python3 scripts/train_target.py --preset h200 --corpus corpus --out train-out/target
    python3 scripts/train_target.py --preset tiny --corpus /tmp/c --out /tmp/t --minutes 2

The schedule: linear warmup, then cosine to 10 % of the peak learning rate over the planned steps.
The plan is one epoch (or --max-tokens), shortened after a few timed steps so that the run ends
inside --minutes; the loop also stops at the budget whatever the plan said. Everything is seeded
(weights, data order); GPU kernels are not bitwise deterministic unless --deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_corpus  # noqa: E402
import make_tiny_k3 as k3  # noqa: E402

# K3 per rank (TP8): 12 heads, q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128, 896 routed
# experts top-16 + 2 shared, first layer dense. The h200 preset halves the per-head dims (64 / 32 /
# 64, so nope : rope : v stays 2 : 1 : 2) and takes kv_lora 128 (latent 160): every width is one
# ferry's tensor-core MLA / MoE kernels take (kv_lora % 128, latent % 32, MHA qk % 32 and v % 64,
# expert widths % 32).
PRESETS = {
    "h200": dict(
        model=dict(
            hidden_size=512,
            intermediate_size=1536,
            moe_intermediate_size=256,
            num_hidden_layers=20,
            num_attention_heads=12,
            q_lora_rank=256,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=32,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            max_position_embeddings=4096,
            rope_original=2048,
        ),
        train=dict(seq_len=2048, batch=16, lr=1.5e-3, warmup=40, minutes=6.0, eval_every=100,
                   eval_tokens=131072, final_eval_tokens=1 << 20, log_every=20),
    ),
    "tiny": dict(
        model=dict(
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=12,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            max_position_embeddings=512,
            rope_original=256,
        ),
        train=dict(seq_len=128, batch=8, lr=3e-3, warmup=5, minutes=2.0, eval_every=10,
                   eval_tokens=4096, final_eval_tokens=16384, log_every=5),
    ),
}


def model_config(preset: str, vocab_size: int) -> dict:
    m = dict(PRESETS[preset]["model"])
    orig = m.pop("rope_original")
    return dict(
        vocab_size=vocab_size,
        num_key_value_heads=m["num_attention_heads"],
        n_shared_experts=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_interleave=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=m["max_position_embeddings"] / orig,
            original_max_position_embeddings=orig,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        initializer_range=0.02,
        **m,
    )


def param_counts(cfg: dict, state_numel: int) -> dict:
    """Total parameters and those one token activates (routed experts: top-k of n)."""
    h, inter, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    expert = 3 * h * inter
    routed = moe_layers * e * expert
    idle = moe_layers * (e - cfg["num_experts_per_tok"]) * expert
    embed = cfg["vocab_size"] * h
    return {
        "total": state_numel,
        "routed_experts": routed,
        "active": state_numel - idle,
        "active_without_embedding": state_numel - idle - embed,
        "embedding": embed,
        "lm_head": embed,
    }


# --------------------------------------------------------------------------------------------
# Experts in bf16 on CUDA
# --------------------------------------------------------------------------------------------


def register_bf16_experts():
    """`bf16_grouped_mm`: transformers' grouped_mm experts forward with the fp32 master weights
    cast to bf16 (torch's grouped GEMM is a bf16 kernel and autocast does not cover it)."""
    import torch
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    class Bf16View:
        def __init__(self, module):
            self._m = module

        def __getattr__(self, name):
            v = getattr(self._m, name)
            if name in ("gate_up_proj", "down_proj", "up_proj") and torch.is_tensor(v):
                return v.to(torch.bfloat16)
            return v

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return grouped_mm_experts_forward(Bf16View(self), hidden_states, top_k_index, top_k_weights)

    ExpertsInterface.register("bf16_grouped_mm", forward)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def tokenize_split(tok, docs, np):
    """One packed stream: <|bos|> doc <|eos|> for every document, uint16."""
    parts = []
    for i in range(0, len(docs), 1024):
        for e in tok.encode_batch(docs[i : i + 1024], add_special_tokens=False):
            parts.append(np.asarray([0] + e.ids + [1], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def chunk_starts(n_tokens: int, seq: int) -> int:
    """Number of (seq + 1)-token windows at stride seq."""
    return max(0, (n_tokens - 1) // seq)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    p.add_argument("--corpus", default=str(ROOT / "corpus"),
                   help="scripts/make_corpus.py's output dir (train/heldout .txt.xz, tokenizer.json)")
    p.add_argument("--out", default=str(ROOT / "train-out" / "target"))
    p.add_argument("--device", default=None, help="default: cuda if present")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=None, help="wall budget of the training loop")
    p.add_argument("--epochs", type=float, default=1.0, help="at most this many epochs")
    p.add_argument("--max-tokens", type=float, default=0, help="at most this many training tokens")
    p.add_argument("--max-train-mb", type=float, default=0,
                   help="use only the first MB of the train split (smoke tests)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--min-lr-frac", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-update", type=float, default=1e-3,
                   help="e_score_correction_bias step per optimizer step (DeepSeek-V3's gamma)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-tokens", type=int, default=None)
    p.add_argument("--final-eval-tokens", type=int, default=None)
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--experts", default="auto",
                   help="experts implementation: auto (bf16_grouped_mm on CUDA, else transformers' "
                        "default), bf16_grouped_mm, grouped_mm, batched_mm, eager")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off: untested)")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--shard-mb", type=float, default=0, help="write shards of at most this size")
    p.add_argument("--samples", type=int, default=48, help="greedy tokens per report sample")
    args = p.parse_args()
    for k, v in PRESETS[args.preset]["train"].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)

    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    t_start = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if args.deterministic or not cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = Path(args.corpus)

    # ---- data
    tok = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    train_docs = make_corpus.read_docs(corpus / "train.txt.xz")
    held_docs = make_corpus.read_docs(corpus / "heldout.txt.xz")
    if args.max_train_mb > 0:
        # A deterministic prefix of a seeded shuffle (the split is path-sorted by source).
        perm = np.random.default_rng(args.seed).permutation(len(train_docs))
        keep, size = [], 0
        for i in perm:
            if size >= args.max_train_mb * 1e6:
                break
            keep.append(train_docs[i])
            size += len(train_docs[i])
        train_docs = keep
    t0 = time.time()
    train_ids = tokenize_split(tok, train_docs, np)
    held_ids = tokenize_split(tok, held_docs, np)
    t_tok = time.time() - t0
    seq = args.seq_len
    n_chunks = chunk_starts(len(train_ids), seq)
    print(f"train-target: {len(train_docs)} train files -> {len(train_ids):,} tokens "
          f"({n_chunks} windows of {seq}), {len(held_docs)} held-out files -> {len(held_ids):,} "
          f"tokens; tokenized in {t_tok:.1f}s; device {device}", flush=True)
    rng = np.random.default_rng(args.seed + 1)
    order = rng.permutation(n_chunks)
    held_chunks = chunk_starts(len(held_ids), seq)
    held_order = np.random.default_rng(args.seed + 2).permutation(held_chunks)

    def window(ids, i):
        return torch.from_numpy(ids[i * seq : i * seq + seq + 1].astype(np.int64))

    def batch_of(ids, idx):
        return torch.stack([window(ids, int(i)) for i in idx]).to(device, non_blocking=True)

    # ---- model
    cfg_dict = model_config(args.preset, vocab)
    config = DeepseekV3Config(**cfg_dict)
    experts = args.experts
    if experts == "auto":
        experts = "bf16_grouped_mm" if cuda else None
    if experts == "bf16_grouped_mm":
        register_bf16_experts()
    model = DeepseekV3ForCausalLM(config)  # seeded above: the same weights for the same seed
    model.to(device)
    model.train()
    total_params = sum(t.numel() for t in model.parameters())
    counts = param_counts(cfg_dict, total_params)
    print(f"train-target: preset {args.preset}: {counts['total'] / 1e6:.1f}M parameters, "
          f"{counts['active'] / 1e6:.1f}M active per token "
          f"({counts['active_without_embedding'] / 1e6:.1f}M without the embedding)", flush=True)

    decay, no_decay = [], []
    for name, prm in model.named_parameters():
        (decay if prm.dim() >= 2 and "embed_tokens" not in name else no_decay).append(prm)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda,
    )

    # Expert loads per MoE layer, for the auxiliary-loss-free bias update and the report.
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    n_exp = cfg_dict["n_routed_experts"]
    loads = torch.zeros(len(gates), n_exp, device=device)
    load_total = torch.zeros(len(gates), n_exp, device=device)
    track = {"on": True}

    def hook(i):
        def fn(_m, _inp, outp):
            if track["on"]:
                loads[i] += torch.bincount(outp[2].reshape(-1), minlength=n_exp).float()
        return fn

    for i, g in enumerate(gates):
        g.register_forward_hook(hook(i))

    # A probe step (forward + backward on one short sequence) so that an experts kernel this
    # machine cannot run falls back instead of ending an unattended lease.
    fallbacks = [experts] + [e for e in ("grouped_mm", "eager") if e != experts]
    for impl in fallbacks:
        try:
            if impl is not None:
                model.set_experts_implementation(impl)
            probe = batch_of(train_ids, [0])[:, :65]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                lg = model(input_ids=probe[:, :-1], use_cache=False).logits
            F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), probe[:, 1:].reshape(-1)).backward()
            break
        except Exception as e:  # noqa: BLE001 - any failure of the kernel path
            print(f"train-target: WARNING: experts implementation {impl} failed its probe step "
                  f"({type(e).__name__}: {str(e)[:200]}); trying the next", flush=True)
    model.zero_grad(set_to_none=True)
    loads.zero_()

    print(f"train-target: experts implementation {model.config._experts_implementation}", flush=True)
    fwd = model
    if args.compile:
        fwd = torch.compile(model)

    def loss_of(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = fwd(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(ids, idx_order, n_tokens):
        model.eval()
        track["on"] = False
        n = min(len(idx_order), max(1, n_tokens // seq))
        tot, cnt = 0.0, 0
        for i in range(0, n, args.batch):
            b = batch_of(ids, idx_order[i : min(i + args.batch, n)])
            tot += float(loss_of(b)) * b.shape[0]
            cnt += b.shape[0]
        track["on"] = True
        model.train()
        return tot / max(cnt, 1), n * seq

    # ---- the plan: one epoch (or fewer), cut to the time budget after timed steps
    budget = args.minutes * 60
    steps_epoch = int(n_chunks * args.epochs) // args.batch
    planned = steps_epoch
    if args.max_tokens > 0:
        planned = min(planned, int(args.max_tokens // (args.batch * seq)))
    planned = max(planned, 1)
    steps_data = planned
    warm = min(args.warmup, max(1, planned // 10))

    def lr_at(step):
        if step < warm:
            return args.lr * (step + 1) / warm
        t = min(1.0, (step - warm) / max(1, planned - warm))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))

    curve = []
    t_loop = time.time()
    h0, _ = evaluate(held_ids, held_order, args.eval_tokens)
    t_eval = time.time()
    evaluate(held_ids, held_order, args.eval_tokens)  # again, timed without first-call costs
    eval_s = time.time() - t_eval
    curve.append({"step": 0, "tokens": 0, "heldout_loss": round(h0, 4), "elapsed_s": round(eval_s, 1)})
    print(f"train-target: step 0 held-out loss {h0:.4f} (ln V = {math.log(vocab):.3f}; eval "
          f"{eval_s:.1f}s); plan {planned} steps x {args.batch} x {seq} tokens "
          f"({planned * args.batch * seq / max(1, len(train_ids)):.2f} epochs), budget {budget:.0f}s",
          flush=True)
    t_loop = time.time()
    timed_from, timed_at = 3, 13
    t_mark = None
    run_loss, run_n, step, stopped = 0.0, 0, 0, "plan"
    eval_spent = 0.0  # seconds of periodic evaluations inside the loop
    seen = 0
    for step in range(planned):
        if step == timed_from:
            if cuda:
                torch.cuda.synchronize()
            t_mark, spent_mark = time.time(), eval_spent
        if step == timed_at and t_mark is not None:
            if cuda:
                torch.cuda.synchronize()
            per = (time.time() - t_mark - (eval_spent - spent_mark)) / (timed_at - timed_from)
            # Periodic evaluations amortised per step, one more at the end, 3 % margin.
            per_eff = (per + eval_s / args.eval_every) * 1.03
            left = budget - (time.time() - t_loop) - eval_s
            fit = step + max(0, int(left / per_eff))
            if fit < planned:
                print(f"train-target: {per * 1000:.0f} ms/step: the budget fits {fit} of "
                      f"{planned} planned steps; the schedule now ends there", flush=True)
                planned = max(fit, step + 1)
            else:
                print(f"train-target: {per * 1000:.0f} ms/step: the plan fits the budget "
                      f"(~{planned * per:.0f}s)", flush=True)
        if step >= planned:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        b = batch_of(train_ids, np.take(order, range(step * args.batch, (step + 1) * args.batch), mode="wrap"))
        loss = loss_of(b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            # DeepSeek-V3: raise the bias of under-loaded experts, lower the over-loaded ones.
            mean = loads.mean(-1, keepdim=True)
            for i, g in enumerate(gates):
                g.e_score_correction_bias += args.bias_update * torch.sign(mean[i] - loads[i])
            load_total += loads
            loads.zero_()
        seen += b.shape[0] * seq
        run_loss += loss.detach()
        run_n += 1
        last = step + 1 >= planned
        over = time.time() - t_loop > budget
        if (step + 1) % args.log_every == 0 or last or over:
            el = time.time() - t_loop
            print(f"train-target: step {step + 1}/{planned} loss {float(loss.detach()):.4f} lr "
                  f"{lr_at(step):.2e} gnorm {float(gnorm):.2f} {seen / el:,.0f} tok/s {el:.0f}s",
                  flush=True)
        if (step + 1) % args.eval_every == 0 or last or over:
            t_ev = time.time()
            h, _ = evaluate(held_ids, held_order, args.eval_tokens)
            eval_spent += time.time() - t_ev
            tl = float(run_loss) / run_n
            curve.append({"step": step + 1, "tokens": seen, "train_loss": round(tl, 4),
                          "heldout_loss": round(h, 4), "lr": lr_at(step),
                          "elapsed_s": round(time.time() - t_loop, 1)})
            print(f"train-target: step {step + 1} train loss {tl:.4f} held-out loss {h:.4f}", flush=True)
            run_loss, run_n = 0.0, 0
        if over and not last:
            stopped = "budget"
            print(f"train-target: WARNING: the {budget:.0f}s budget ran out at step {step + 1} of "
                  f"{planned}", flush=True)
            break
    steps_run = step + 1
    train_s = time.time() - t_loop

    # ---- final numbers: held-out and an equal sample of seen training windows
    t0 = time.time()
    held_final, held_tok = evaluate(held_ids, held_order, args.final_eval_tokens)
    seen_order = order[: steps_run * args.batch]
    seen_sample = seen_order[np.random.default_rng(args.seed + 3).permutation(len(seen_order))]
    train_final, train_tok = evaluate(train_ids, seen_sample, min(args.final_eval_tokens, held_tok))
    print(f"train-target: final loss: held-out {held_final:.4f} ({held_tok:,} tokens), train "
          f"{train_final:.4f} ({train_tok:,} seen tokens); {time.time() - t0:.1f}s", flush=True)

    lt = load_total / load_total.sum(-1, keepdim=True).clamp(min=1)
    balance = (lt.max(-1).values * n_exp).tolist()  # max load / uniform load, per MoE layer
    bias = torch.stack([g.e_score_correction_bias.detach().float() for g in gates])

    # Greedy samples from held-out prompts (a sanity check, also of the saved weights' behaviour).
    samples = []
    model.eval()
    track["on"] = False
    for d in held_docs[:: max(1, len(held_docs) // 3)][:3]:
        prompt = tok.encode(d[:200]).ids[:32]
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            g = model.generate(input_ids=torch.tensor([prompt], device=device),
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                               max_new_tokens=args.samples, do_sample=False, eos_token_id=None,
                               pad_token_id=1)
        samples.append({"prompt": tok.decode(prompt[1:]), "greedy": tok.decode(g[0, len(prompt):].tolist())})

    # ---- write the checkpoint
    model.to("cpu")
    state = k3.to_deepseek_state_dict(model)
    write_weights(state, out, args.shard_mb, save_file)
    k3.write_hf_config(config, out)
    tcfg = json.loads((corpus / "tokenizer_config.json").read_text())
    tcfg["model_max_length"] = cfg_dict["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (out / "tokenizer.json").write_bytes((corpus / "tokenizer.json").read_bytes())
    verify_checkpoint(out, model, torch, DeepseekV3ForCausalLM)

    manifest = corpus / "manifest.json"
    report = {
        "produced_by": "scripts/train_target.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "experts_implementation": model.config._experts_implementation,
        "compiled": bool(args.compile),
        "seed": args.seed,
        "parameters": counts,
        "bf16_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "corpus": {
            "manifest_sha256_xz": {s: v.get("sha256_xz") for s, v in
                                   json.loads(manifest.read_text())["splits"].items()}
            if manifest.exists() else None,
            "train_files": len(train_docs),
            "train_tokens": int(len(train_ids)),
            "heldout_files": len(held_docs),
            "heldout_tokens": int(len(held_ids)),
            "vocab_size": vocab,
        },
        "schedule": {"seq_len": seq, "batch_sequences": args.batch, "tokens_per_step": args.batch * seq,
                     "peak_lr": args.lr, "warmup_steps": warm, "min_lr_frac": args.min_lr_frac,
                     "weight_decay": args.weight_decay, "bias_update": args.bias_update,
                     "steps_one_epoch": steps_epoch, "steps_data_plan": steps_data,
                     "steps_planned": planned, "steps_run": steps_run, "stopped_by": stopped},
        "tokens_seen": seen,
        "epochs": round(seen / max(1, len(train_ids)), 4),
        "final": {"heldout_loss": round(held_final, 4), "heldout_eval_tokens": held_tok,
                  "train_loss_on_seen_windows": round(train_final, 4), "train_eval_tokens": train_tok},
        "curve": curve,
        "expert_balance_max_over_uniform_per_layer": [round(x, 3) for x in balance],
        "e_score_correction_bias_abs_mean": round(float(bias.abs().mean()), 4),
        "tokenize_seconds": round(t_tok, 1),
        "train_seconds": round(train_s, 1),
        "tokens_per_second": round(seen / max(train_s, 1e-9)),
        "wall_seconds": round(time.time() - t_start, 1),
        "samples": samples,
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"train-target: {seen:,} tokens ({report['epochs']:.3f} epochs) in {train_s:.0f}s "
          f"({report['tokens_per_second']:,} tok/s); held-out {held_final:.4f}, train "
          f"{train_final:.4f}; {report['bf16_bytes'] / 1e6:.1f} MB bf16 -> {out} "
          f"({report['wall_seconds']:.0f}s in all)", flush=True)


def verify_checkpoint(out: Path, model, torch, cls) -> None:
    """Reload OUT through transformers (which re-fuses the per-expert tensors) and require every
    parameter and buffer to equal the trained model's, rounded as written: a checkpoint-layout
    mistake must not pass silently as a randomly initialised expert."""
    loaded = cls.from_pretrained(str(out), dtype=torch.bfloat16).state_dict()
    want = model.state_dict()
    bad = [n for n, t in loaded.items()
           if n not in want or not torch.equal(t, want[n].to(t.dtype))]
    missing = [n for n in want if n not in loaded]
    assert not bad and not missing, f"checkpoint round trip: differs {bad[:5]}, missing {missing[:5]}"
    print(f"train-target: checkpoint round trip through transformers: {len(loaded)} tensors equal",
          flush=True)


def write_weights(state: dict, out: Path, shard_mb: float, save_file) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    if shard_mb <= 0:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    limit = shard_mb * 1e6
    shards, cur, size = [], {}, 0
    for name, t in state.items():
        nb = t.numel() * t.element_size()
        if cur and size + nb > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += nb
    shards.append(cur)
    weight_map = {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in sh})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


if __name__ == "__main__":
    main()
