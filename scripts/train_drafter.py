"""The DSpark drafter in torch: one batched forward for the golden reference and for training.

Imported by `scripts/make_tiny_k3.py` (stages `drafter` and `train-drafter`); it holds no model
constants of its own. The forward is ferry's `model/src/drafter/dspark.rs` + `heads.rs`:

- context rows 0..n-1 (committed tokens, whose target hidden states exist):
  `f = RMSNorm(fc(concat(h_l for l in target_layer_ids)))` with `h_l` the residual stream leaving
  target decoder layer l (transformers' `hidden_states[l + 1]`); per drafter layer
  `K = RoPE(k_norm(k_proj(f)))`, `V = v_proj(f)` at the row's own position; no queries, no MLP.
- block rows `[anchor, MASK x (B-1)]` at positions n..n+B-1 (the anchor is the last sampled token,
  not yet in the target cache, so it is *not* a context row): pre-norm layers with per-head q/k
  RMSNorm, plain RoPE (rotate_half), GQA (query head h reads KV head h // group), SwiGLU. Block
  queries see every context row j < n and all B block rows (bidirectional, no causal mask).
- final RMSNorm -> the target's LM head (shared, frozen) -> U_k; block input through the target's
  embedding (shared, frozen).
- Markov head: draft k is drawn from softmax(U_k + W2 . W1[x_{k-1}]), x_{-1} = anchor; greedy
  drafts take the lowest-index argmax. Draft k predicts the token at position n + 1 + k.
- confidence head: c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b), the survival of draft k given that
  drafts 0..k-1 survived (the engine admits slots by the cumulative product, spec.rs VerifyLen).

Weights are a dict name -> tensor with the safetensors names ferry loads.

Training (`train`): self-distillation. The frozen target continues corpus prompts greedily, so
every token after the prompt is the target's own greedy choice; for random anchors n in that
region, draft k is trained (teacher-forced Markov input x_{k-1} = the target's token at n + k)
with cross-entropy towards the target's greedy token at n + 1 + k plus a KL term towards the
target's full distribution there; the confidence head (on detached inputs) is trained with
binary cross-entropy towards "the greedy draft equals the target's greedy token", which under
teacher forcing is exactly the conditional survival the engine multiplies.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., heads, hd], pos [...] (x's leading dims): plain RoPE, rotate_half layout."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    freqs = pos.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[..., None, :], emb.sin()[..., None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def context_feature(cfg: dict, w: dict, taps: torch.Tensor) -> torch.Tensor:
    """taps [..., T, hidden x taps] (concatenated in target_layer_ids order) -> f [..., T, hidden]."""
    return rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], cfg["rms_norm_eps"])


def block_forward(
    cfg: dict,
    w: dict,
    embed: torch.Tensor,
    lm_head: torch.Tensor | None,
    feat: torch.Tensor,
    anchor_tok: torch.Tensor,
    anchor_pos: torch.Tensor,
):
    """The one-pass block forward for A anchors in each of S sequences.

    feat [S, T, hidden]: context features of positions 0..T-1. anchor_tok, anchor_pos [S, A]:
    the anchor token and its position n (context rows j < n are visible; n <= T). Returns the
    final normed hidden states [S, A, B, hidden] and the LM-head logits U [S, A, B, vocab]
    (None when lm_head is None).
    """
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    hd, heads, kvh = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    b = cfg["block_size"]
    s_, t_ = feat.shape[0], feat.shape[1]
    a_ = anchor_tok.shape[1]
    r_ = a_ * b
    dev = feat.device
    offs = torch.arange(b, device=dev)
    tokens = torch.full((s_, a_, b), cfg["mask_token_id"], dtype=torch.long, device=dev)
    tokens[:, :, 0] = anchor_tok
    pos_blk = (anchor_pos[:, :, None] + offs).reshape(s_, r_)
    pos_ctx = torch.arange(t_, device=dev).expand(s_, t_)
    # [S, R, T + R]: context row j visible iff j < n of the query's anchor; block rows visible
    # iff they belong to the same anchor (bidirectional inside the block).
    blk_of = torch.arange(r_, device=dev) // b
    ctx_vis = torch.arange(t_, device=dev)[None, None, :] < anchor_pos.repeat_interleave(b, 1)[:, :, None]
    blk_vis = (blk_of[:, None] == blk_of[None, :]).expand(s_, r_, r_)
    mask = torch.cat([ctx_vis, blk_vis], -1)[:, None]  # [S, 1, R, T + R]
    x = embed[tokens.reshape(s_, r_)]
    group = heads // kvh
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        h = rms(x, w[f"{p}.input_layernorm.weight"], eps)
        q = (h @ w[f"{p}.self_attn.q_proj.weight"].T).view(s_, r_, heads, hd)
        q = rope(rms(q, w[f"{p}.self_attn.q_norm.weight"], eps), pos_blk, theta)

        def kv(src, pos):
            k = (src @ w[f"{p}.self_attn.k_proj.weight"].T).view(s_, -1, kvh, hd)
            k = rope(rms(k, w[f"{p}.self_attn.k_norm.weight"], eps), pos, theta)
            v = (src @ w[f"{p}.self_attn.v_proj.weight"].T).view(s_, -1, kvh, hd)
            return k, v

        k_ctx, v_ctx = kv(feat, pos_ctx)
        k_blk, v_blk = kv(h, pos_blk)
        k = torch.cat([k_ctx, k_blk], 1).repeat_interleave(group, dim=2)
        v = torch.cat([v_ctx, v_blk], 1).repeat_interleave(group, dim=2)
        scores = torch.einsum("sqhd,skhd->shqk", q, k) / hd**0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.einsum("shqk,skhd->sqhd", scores.softmax(-1), v).reshape(s_, r_, heads * hd)
        x = x + attn @ w[f"{p}.self_attn.o_proj.weight"].T
        h = rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        g = h @ w[f"{p}.mlp.gate_proj.weight"].T
        u = h @ w[f"{p}.mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ w[f"{p}.mlp.down_proj.weight"].T
    hidden = rms(x, w["norm.weight"], eps).view(s_, a_, b, -1)
    logits = None if lm_head is None else hidden @ lm_head.T
    return hidden, logits


def markov_logits(w: dict, u: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """U [..., vocab] + W2 . W1[prev]: the logits drafts are drawn from."""
    return u + w["markov_head.w1.weight"][prev] @ w["markov_head.w2.weight"].T


def confidence_logit(w: dict, hidden: torch.Tensor, prev: torch.Tensor, detach: bool = False):
    """w . [h ; W1[prev]] + b (before the sigmoid)."""
    e = w["markov_head.w1.weight"][prev]
    if detach:
        hidden, e = hidden.detach(), e.detach()
    return torch.cat([hidden, e], -1) @ w["confidence_head.weight"][0] + w["confidence_head.bias"][0]


def greedy_drafts(w: dict, hidden: torch.Tensor, u: torch.Tensor, anchor_tok: torch.Tensor):
    """The Markov head left to right with greedy drafts, as ferry drafts for a greedy request.
    hidden [..., B, hid], u [..., B, vocab], anchor_tok [...]. Returns drafts [..., B], the
    corrected logits [..., B, vocab] and confidences [..., B]."""
    prev = anchor_tok
    drafts, logits, conf = [], [], []
    for k in range(u.shape[-2]):
        lk = markov_logits(w, u[..., k, :], prev)
        conf.append(torch.sigmoid(confidence_logit(w, hidden[..., k, :], prev)))
        prev = lk.argmax(-1)  # first (lowest-index) maximum, as ferry's argmax
        drafts.append(prev)
        logits.append(lk)
    return torch.stack(drafts, -1), torch.stack(logits, -2), torch.stack(conf, -1)


def target_taps(target, cfg: dict, ids: torch.Tensor):
    """One target forward: (concatenated taps [S, T, hid x taps], final normed hidden [S, T, hid],
    logits [S, T, vocab])."""
    final = []
    hook = target.model.norm.register_forward_hook(lambda _m, _i, out: final.append(out))
    try:
        out = target(input_ids=ids, output_hidden_states=True)
    finally:
        hook.remove()
    # hidden_states[l + 1] is the residual stream leaving decoder layer l.
    taps = torch.cat([out.hidden_states[l + 1].float() for l in cfg["target_layer_ids"]], -1)
    return taps, final[-1].float(), out.logits.float()


def reference(cfg: dict, w: dict, target, prompt_ids: list, anchor: int) -> dict:
    """The golden reference for one prompt (float32; run it on the CPU): the block at position
    n = len(prompt_ids) after all of the prompt as context."""
    f = {k: v.float() for k, v in w.items()}
    ids = torch.tensor([prompt_ids])
    n = len(prompt_ids)
    with torch.no_grad():
        taps, _, _ = target_taps(target, cfg, ids)
        feat = context_feature(cfg, f, taps)
        embed = target.model.embed_tokens.weight.float()
        lm_head = target.lm_head.weight.float()
        hidden, u = block_forward(
            cfg, f, embed, lm_head, feat, torch.tensor([[anchor]]), torch.tensor([[n]])
        )
        drafts, markov, conf = greedy_drafts(f, hidden[0, 0], u[0, 0], torch.tensor(anchor))
        top2 = torch.topk(markov, 2, dim=-1).values
    return {
        "block_logits": u[0, 0].contiguous(),
        "markov_logits": markov.contiguous(),
        "drafts": [int(x) for x in drafts],
        "confidence": [float(c) for c in conf],
        "min_draft_margin": float((top2[:, 0] - top2[:, 1]).min()),
    }


# --------------------------------------------------------------------------------------------
# Data: the target's own greedy continuations of corpus prompts
# --------------------------------------------------------------------------------------------


def make_prompts(ids, n, plen, gen, random_frac, vocab, bos, segments):
    """n prompts of plen tokens: BOS + corpus text from a random offset inside `segments`
    (a list of (start, end) token ranges), or, with probability random_frac, plen random tokens
    from 16..vocab (like `ferry bench-engine`'s synthetic prompts, no BOS)."""
    weights = torch.tensor([float(e - s - plen) for s, e in segments]).clamp(min=0)
    seg = torch.multinomial(weights, n, replacement=True, generator=gen)
    rows = []
    for i in range(n):
        if float(torch.rand((), generator=gen)) < random_frac:
            rows.append(torch.randint(16, vocab, (plen,), generator=gen))
            continue
        s, e = segments[int(seg[i])]
        start = s + int(torch.randint(0, e - s - plen, (), generator=gen))
        rows.append(torch.cat([torch.tensor([bos]), ids[start : start + plen - 1]]))
    return torch.stack(rows)


@torch.no_grad()
def build_dataset(target, cfg, ids, n_seqs, seq_len, prompt_lens, gen_batch, random_frac,
                  segments, gen, device, label):
    """Greedy continuations of n_seqs prompts to seq_len tokens, and per sequence: the taps, the
    final hidden state (for the target's distribution), the target's greedy token after every
    position (from one full forward), and the first usable anchor (last prompt position)."""
    t0 = time.time()
    vocab, bos = target.config.vocab_size, target.config.bos_token_id
    seqs, first = [], []
    done, g = 0, 0
    # Calls of at most gen_batch sequences, enough of them for every prompt length to occur.
    per_call = min(gen_batch, -(-n_seqs // len(prompt_lens)))
    while done < n_seqs:
        n = min(per_call, n_seqs - done)
        plen = prompt_lens[g % len(prompt_lens)]
        prompts = make_prompts(ids, n, plen, gen, random_frac, vocab, bos, segments).to(device)
        out = target.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=seq_len - plen,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
        assert out.shape == (n, seq_len), out.shape
        seqs.append(out)
        first += [plen - 1] * n
        done += n
        g += 1
    seqs = torch.cat(seqs)
    t1 = time.time()
    taps, final, greedy = [], [], []
    chunk = max(1, 65536 // seq_len)
    for i in range(0, n_seqs, chunk):
        tp, fh, logits = target_taps(target, cfg, seqs[i : i + chunk])
        taps.append(tp)
        final.append(fh)
        greedy.append(logits.argmax(-1))
        del logits
    data = {
        "tokens": seqs,
        "first": torch.tensor(first, device=device),
        "taps": torch.cat(taps),
        "final": torch.cat(final),
        "greedy": torch.cat(greedy),
    }
    # How often the full forward's argmax agrees with the cached greedy generation (numerics).
    gen_pos = torch.arange(seq_len - 1, device=device)[None, :] >= data["first"][:, None]
    agree = int(((data["greedy"][:, :-1] == seqs[:, 1:]) & gen_pos).sum())
    total = int(gen_pos.sum())
    print(
        f"train-drafter: {label}: {n_seqs} sequences x {seq_len} tokens, generate {t1 - t0:.1f}s, "
        f"taps {time.time() - t1:.1f}s; full-forward argmax == generated token at "
        f"{agree / max(total, 1):.4%} of generated positions",
        flush=True,
    )
    return data


def sample_anchors(first, seq_len, b, count, gen):
    """count anchors per sequence, uniform in [first, seq_len - 1 - b] (drafts at n+1..n+b)."""
    lo = first.cpu().float()
    span = (seq_len - b) - lo  # number of valid anchors
    u = torch.rand(len(lo), count, generator=gen)
    return (lo[:, None] + (u * span[:, None]).floor()).long()


def gather_targets(data, idx, anchors, b):
    """Labels y[s, a, k] = target's greedy token at n + 1 + k (= greedy[n + k]); Markov inputs
    prev[s, a, k] = the token at n + k (k = 0: the anchor)."""
    pos = anchors[:, :, None] + torch.arange(b, device=anchors.device)
    tok = data["tokens"][idx]
    grd = data["greedy"][idx]
    s = torch.arange(len(idx), device=anchors.device)[:, None, None]
    return tok[s, pos], grd[s, pos], pos


# --------------------------------------------------------------------------------------------
# Evaluation: held-out acceptance of greedy drafts
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(cfg, w, embed, lm_head, data, stride, batch, min_survival=0.3, anchor_chunk=32):
    """For every stride-th anchor of the held-out sequences: the greedy Markov drafts (each draft
    fed the previous *draft*, as at inference) against the target's greedy tokens. Returns
    per-position conditional acceptance, unconditional match, the acceptance length with fixed
    gamma = B (1 + leading matches: tokens per round including the correction/bonus token), the
    same under the engine's default confidence:0.3 policy at concurrency 1, and calibration."""
    b = cfg["block_size"]
    w = {k: v.float() for k, v in w.items()}
    seq_len = data["tokens"].shape[1]
    lead, match, conf_all, tv = [], [], [], []
    n_seq = data["tokens"].shape[0]
    dev = data["tokens"].device
    for i in range(0, n_seq, batch):
        idx = torch.arange(i, min(i + batch, n_seq), device=dev)
        f0 = int(data["first"][idx].min())
        feat = context_feature(cfg, w, data["taps"][idx])
        all_anchors = torch.arange(f0, seq_len - b, stride, device=dev)
        for a0 in range(0, len(all_anchors), anchor_chunk):
            anchors = all_anchors[a0 : a0 + anchor_chunk].expand(len(idx), -1)
            valid = anchors >= data["first"][idx][:, None]
            prev, y, pos = gather_targets(data, idx, anchors, b)
            hidden, u = block_forward(cfg, w, embed, lm_head, feat, prev[:, :, 0], anchors)
            drafts, _, conf = greedy_drafts(w, hidden, u, prev[:, :, 0])
            ok = drafts == y
            # Teacher-forced T=1 acceptance 1 - TV(p, q) per position (sampled requests).
            tf = markov_logits(w, u, prev)
            s = torch.arange(len(idx), device=dev)[:, None, None]
            p_t = (data["final"][idx][s, pos] @ lm_head.T).softmax(-1)
            tv.append((1 - 0.5 * (tf.softmax(-1) - p_t).abs().sum(-1))[valid])
            match.append(ok[valid])
            lead.append(ok.long().cumprod(-1)[valid])
            conf_all.append(conf[valid])
    match, lead, conf_all, tv = (torch.cat(x).float() for x in (match, lead, conf_all, tv))
    accepted = lead.sum(-1)
    # Conditional acceptance of slot k given slots < k accepted.
    reach = torch.cat([torch.ones_like(lead[:, :1]), lead[:, :-1]], -1)
    cond = (lead.sum(0) / reach.sum(0).clamp(min=1)).tolist()
    conf_given_reach = ((conf_all * reach).sum(0) / reach.sum(0).clamp(min=1)).tolist()
    # confidence:MIN at concurrency 1: gamma = longest prefix with cumulative survival >= MIN.
    gamma = (conf_all.cumprod(-1) >= min_survival).long().cumprod(-1).sum(-1)
    acc_policy = torch.minimum(accepted, gamma.float())
    return {
        "blocks": int(lead.shape[0]),
        "match_rate_per_position": [round(x, 4) for x in match.mean(0).tolist()],
        "conditional_acceptance_per_position": [round(x, 4) for x in cond],
        "mean_confidence_when_reached": [round(x, 4) for x in conf_given_reach],
        "acceptance_length_fixed_B": round(float(1 + accepted.mean()), 4),
        "accepted_histogram": [int((accepted == a).sum()) for a in range(b + 1)],
        f"confidence_{min_survival}_mean_gamma": round(float(gamma.float().mean()), 4),
        f"confidence_{min_survival}_acceptance_length": round(float(1 + acc_policy.mean()), 4),
        "teacher_forced_1_minus_tv_T1": [round(x, 4) for x in tv.mean(0).tolist()],
    }


def print_eval(tag, ev):
    """One line per evaluation; the acceptance length is 1 + leading accepted drafts (gamma = B)."""
    print(
        f"train-drafter: {tag}: acceptance length (gamma=B, greedy) {ev['acceptance_length_fixed_B']:.3f}; "
        f"match/position {ev['match_rate_per_position']}; conditional {ev['conditional_acceptance_per_position']}; "
        f"confidence {ev['mean_confidence_when_reached']}; "
        f"confidence:0.3 policy: gamma {ev['confidence_0.3_mean_gamma']:.2f}, "
        f"acceptance length {ev['confidence_0.3_acceptance_length']:.3f}; "
        f"T=1 1-TV {ev['teacher_forced_1_minus_tv_T1']} ({ev['blocks']} blocks)",
        flush=True,
    )


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def calibrate_confidence(cfg, w, embed, lm_head, data, stride, batch, steps, lr, anchor_chunk=32):
    """Refits the confidence head alone (a logistic regression on [h_k ; W1[x_{k-1}]]) on data
    the backbone never trained on, with the backbone as shipped (bf16): the training split's
    draft accuracy is optimistic, so a head fitted there over-predicts survival. Labels as in
    training: the greedy draft at k (teacher-forced Markov input) equals the target's token."""
    b = cfg["block_size"]
    wf = {k: v.float() for k, v in w.items()}
    seq_len = data["tokens"].shape[1]
    dev = data["tokens"].device
    xs, ys = [], []
    with torch.no_grad():
        for i in range(0, data["tokens"].shape[0], batch):
            idx = torch.arange(i, min(i + batch, data["tokens"].shape[0]), device=dev)
            feat = context_feature(cfg, wf, data["taps"][idx])
            all_anchors = torch.arange(int(data["first"][idx].min()), seq_len - b, stride, device=dev)
            for a0 in range(0, len(all_anchors), anchor_chunk):
                anchors = all_anchors[a0 : a0 + anchor_chunk].expand(len(idx), -1)
                valid = anchors >= data["first"][idx][:, None]
                prev, y, _ = gather_targets(data, idx, anchors, b)
                hidden, u = block_forward(cfg, wf, embed, lm_head, feat, prev[:, :, 0], anchors)
                hit = (markov_logits(wf, u, prev).argmax(-1) == y).float()
                e = wf["markov_head.w1.weight"][prev]
                xs.append(torch.cat([hidden, e], -1)[valid])
                ys.append(hit[valid])
    x, y = torch.cat(xs), torch.cat(ys)  # [N, B, hid + rank], [N, B]
    cw = wf["confidence_head.weight"].clone().requires_grad_(True)
    cb = wf["confidence_head.bias"].clone().requires_grad_(True)
    opt = torch.optim.Adam([cw, cb], lr=lr)
    loss0 = None
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(x @ cw[0] + cb[0], y)
        loss0 = loss0 if loss0 is not None else float(loss.detach())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        loss1 = float(F.binary_cross_entropy_with_logits(x @ cw[0] + cb[0], y))
    print(
        f"train-drafter: confidence head recalibrated on {x.shape[0]} held-out blocks "
        f"(draft accuracy {[round(v, 3) for v in y.mean(0).tolist()]}): BCE {loss0:.4f} -> {loss1:.4f}",
        flush=True,
    )
    out = dict(w)
    out["confidence_head.weight"] = cw.detach().to(w["confidence_head.weight"].dtype)
    out["confidence_head.bias"] = cb.detach().to(w["confidence_head.bias"].dtype)
    return out, {"blocks": int(x.shape[0]), "bce_before": round(loss0 or 0.0, 4), "bce_after": round(loss1, 4)}


def corpus_dir_segments(tok, corpus: Path, max_mb: float, seed: int):
    """A scripts/make_corpus.py corpus: prompts come from whole files. Training prompts from a
    seeded sample of about max_mb MB of train files; validation and test prompts from alternate
    held-out files (the split the target never trained on). Returns the token stream (files
    concatenated) and the (start, end) range of every file in each part."""
    import random

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_corpus

    train_docs = make_corpus.read_docs(corpus / "train.txt.xz")
    random.Random(seed).shuffle(train_docs)
    keep, size = [], 0
    for d in train_docs:
        if size >= max_mb * 1e6:
            break
        keep.append(d)
        size += len(d)
    held = make_corpus.read_docs(corpus / "heldout.txt.xz")
    parts = {"train": keep, "val": held[0::2], "test": held[1::2]}
    chunks, segs, pos = [], {}, 0
    for name, docs in parts.items():
        segs[name] = []
        for i in range(0, len(docs), 1024):
            for e in tok.encode_batch(docs[i : i + 1024], add_special_tokens=False):
                chunks.append(torch.tensor(e.ids, dtype=torch.long))
                segs[name].append((pos, pos + len(e.ids)))
                pos += len(e.ids)
    return torch.cat(chunks), segs["train"], segs["val"], segs["test"]


def train(args, cfg: dict, init_state: dict, target_dir: Path) -> tuple[dict, dict]:
    """Trains the drafter against the frozen target; returns (bf16 state dict, report)."""
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(args.drafter_seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t_start = time.time()
    b = cfg["block_size"]

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    if Path(args.corpus).is_dir():
        ids, train_segs, val_segs, test_segs = corpus_dir_segments(
            tok, Path(args.corpus), args.drafter_corpus_mb, args.drafter_seed)
        print(
            f"train-drafter: {ids.numel()} corpus tokens of {args.corpus}: {len(train_segs)} train "
            f"files, {len(val_segs)} validation and {len(test_segs)} test files (held-out split); "
            f"on {device}",
            flush=True,
        )
    else:
        text = Path(args.corpus).read_text(encoding="utf-8")
        ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
        # 4096-token segments of the corpus: every 20th is test text (the reported acceptance), the
        # ones 5 after those are validation text (checkpoint choice, confidence calibration).
        seg = 4096
        bounds = [(s, min(s + seg, ids.numel())) for s in range(0, ids.numel(), seg)]
        test_segs = [x for i, x in enumerate(bounds) if i % 20 == 10]
        val_segs = [x for i, x in enumerate(bounds) if i % 20 == 5]
        train_segs = [x for i, x in enumerate(bounds) if i % 20 not in (5, 10)]
        print(
            f"train-drafter: {ids.numel()} corpus tokens; {len(train_segs)} train, {len(val_segs)} "
            f"validation, {len(test_segs)} test segments of {seg}; on {device}",
            flush=True,
        )

    target = DeepseekV3ForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    target.eval().to(device)
    for p in target.parameters():
        p.requires_grad_(False)
    embed = target.model.embed_tokens.weight.float()
    lm_head = target.lm_head.weight.float()

    gen = torch.Generator().manual_seed(args.drafter_seed)
    plens = [int(x) for x in args.drafter_prompt_lens.split(",")]
    assert max(plens) + b + 1 < args.drafter_seq_len, "sequences too short for the prompts"
    common = dict(seq_len=args.drafter_seq_len, prompt_lens=plens, gen_batch=args.drafter_gen_batch,
                  random_frac=args.drafter_random_prompts, gen=gen, device=device)
    train_data = build_dataset(target, cfg, ids, args.drafter_seqs, segments=train_segs,
                               label="train data", **common)
    val_data = build_dataset(target, cfg, ids, args.drafter_eval_seqs, segments=val_segs,
                             label="validation data", **common)
    test_data = build_dataset(target, cfg, ids, args.drafter_eval_seqs, segments=test_segs,
                              label="test data", **common)
    t_data = time.time() - t_start

    w = {k: v.float().to(device).clone().requires_grad_(True) for k, v in init_state.items()}
    params = list(w.values())
    report = {"device": str(device), "torch_version": torch.__version__}
    ev_args = (args.drafter_eval_stride, args.drafter_eval_batch)
    ev0 = evaluate(cfg, w, embed, lm_head, test_data, *ev_args)
    print_eval("test before training", ev0)
    report["test_before"] = ev0

    opt = torch.optim.AdamW(params, lr=args.drafter_lr, betas=(0.9, 0.95), weight_decay=0.01)
    steps, warm = args.drafter_steps, max(1, args.drafter_steps // 20)

    def lr_at(step):
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    pos_w = torch.exp(-torch.arange(b, dtype=torch.float32, device=device) / args.drafter_pos_decay)
    n_train = train_data["tokens"].shape[0]
    best = (-1.0, -1, None)  # (validation acceptance length, step, weights)
    history = []
    t_train = time.time()
    last_step = steps - 1
    # Every step's sequences and anchors, drawn up front on the CPU (deterministic) and moved to
    # the device in one copy, so the loop never waits for the device.
    first_cpu = train_data["first"].cpu()
    all_idx = torch.randint(0, n_train, (steps, args.drafter_batch), generator=gen)
    all_anchors = torch.stack([
        sample_anchors(first_cpu[all_idx[i]], args.drafter_seq_len, b, args.drafter_anchors, gen)
        for i in range(steps)
    ]).to(device)
    all_idx = all_idx.to(device)
    for step in range(steps):
        idx, anchors = all_idx[step], all_anchors[step]
        prev, y, pos = gather_targets(train_data, idx, anchors, b)
        feat = context_feature(cfg, w, train_data["taps"][idx])
        hidden, u = block_forward(cfg, w, embed, lm_head, feat, prev[:, :, 0], anchors)
        logits = markov_logits(w, u, prev)  # teacher-forced: x_{k-1} = the target's token
        wk = pos_w.expand_as(y)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        loss_ce = (ce * wk.reshape(-1)).sum() / wk.sum()
        loss = args.drafter_ce_weight * loss_ce
        if args.drafter_kl_weight > 0:
            s = torch.arange(len(idx), device=device)[:, None, None]
            with torch.no_grad():
                logp_t = (train_data["final"][idx][s, pos] @ lm_head.T).log_softmax(-1)
            kl = (logp_t.exp() * (logp_t - logits.log_softmax(-1))).sum(-1)
            loss_kl = (kl * wk).sum() / wk.sum()
            loss = loss + args.drafter_kl_weight * loss_kl
        hit = (logits.detach().argmax(-1) == y).float()
        zc = confidence_logit(w, hidden, prev, detach=True)
        loss_bce = F.binary_cross_entropy_with_logits(zc, hit)
        loss = loss + args.drafter_conf_weight * loss_bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        over = (args.drafter_time_budget > 0 and time.time() - t_train > args.drafter_time_budget)
        if step % args.drafter_log_every == 0 or step == steps - 1 or over:
            acc = hit.mean((0, 1)).tolist()
            print(
                f"train-drafter: step {step:5d} lr {sched.get_last_lr()[0]:.2e} loss {loss.item():.4f} "
                f"ce {loss_ce.item():.4f} bce {loss_bce.item():.4f} teacher-forced match "
                f"{[round(a, 3) for a in acc]} ({time.time() - t_train:.1f}s)",
                flush=True,
            )
        if (step + 1) % args.drafter_eval_every == 0 or step == steps - 1 or over:
            ev = evaluate(cfg, w, embed, lm_head, val_data, *ev_args)
            tau = ev["acceptance_length_fixed_B"]
            history.append({"step": step + 1, "val_acceptance_length": tau,
                            "val_match_rate_per_position": ev["match_rate_per_position"]})
            print(f"train-drafter: step {step + 1}: validation acceptance length {tau:.4f} "
                  f"match/position {ev['match_rate_per_position']}", flush=True)
            if tau > best[0]:
                best = (tau, step + 1, {k: v.detach().clone() for k, v in w.items()})
        if over:
            print(f"train-drafter: WARNING: time budget {args.drafter_time_budget}s reached at step "
                  f"{step + 1} of {steps}; stopping early", flush=True)
            last_step = step
            break
    train_s = time.time() - t_train
    print(f"train-drafter: best validation acceptance length {best[0]:.4f} at step {best[1]}", flush=True)

    state = {k: v.to("cpu", torch.float32).to(torch.bfloat16).contiguous() for k, v in best[2].items()}
    calib = None
    if args.drafter_calib_steps > 0:
        dev_state = {k: v.to(device) for k, v in state.items()}
        dev_state, calib = calibrate_confidence(cfg, dev_state, embed, lm_head, val_data, *ev_args,
                                                steps=args.drafter_calib_steps, lr=1e-2)
        state = {k: v.to("cpu").to(torch.bfloat16).contiguous() for k, v in dev_state.items()}
    # Test acceptance of the weights as shipped (bf16-rounded).
    ev1 = evaluate(cfg, {k: v.to(device) for k, v in state.items()}, embed, lm_head, test_data, *ev_args)
    print_eval("test after training (bf16 weights as written)", ev1)
    report.update(
        {
            "test_after": ev1,
            "best_step": best[1],
            "steps_run": last_step + 1,
            "validation_history": history,
            "confidence_calibration": calib,
            "data_seconds": round(t_data, 1),
            "train_seconds": round(train_s, 1),
            "total_seconds": round(time.time() - t_start, 1),
            "settings": {
                k: getattr(args, k)
                for k in sorted(vars(args))
                if k.startswith("drafter_") and k != "drafter_out"
            },
        }
    )
    print(f"train-drafter: data {t_data:.1f}s, training {train_s:.1f}s, {time.time() - t_start:.1f}s in all", flush=True)
    return state, report


def write_report(out: Path, report: dict) -> None:
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
