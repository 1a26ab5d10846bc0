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

Serving-shaped data (`data_parts`, docs/spec_decode.md "The drafter against it"): the data above
is the "short" part; --drafter-long-prompt-lens adds a "long" part, long corpus prompts (a
benchmark's 1,024 tokens) with a short greedy tail, a share of every step's sequences. With
--drafter-anchor-from N anchors also fall inside the prompt, from position N on: long contexts
for the price of a prompt, no generated steps. A label there is the target's argmax after the
corpus prefix; block position k keeps its loss only while the corpus text between the anchor and
it equals the target's greedy tokens (`chain_mask`), i.e. while it is what the verifier would see
after accepting drafts 0..k-1. Held-out statistics are reported per part and per region
(`evaluate`: "generated", where the engine drafts, and "prompt"); the checkpoint is chosen and the
confidence head refitted on the long part's generated tail when there is one.
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
    assert float(weights.sum()) > 0, f"no corpus segment is longer than a {plen}-token prompt"
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


def draw_prompt_calls(ids, n_seqs, prompt_lens, gen_batch, random_frac, vocab, bos, segments, gen):
    """The prompts of n_seqs sequences, drawn as `build_dataset` has always drawn them: in calls of
    at most gen_batch prompts, few enough that every prompt length occurs, the prompt lengths in
    turn. Returns [(prompt length, prompts [n, plen])], on the CPU."""
    calls, done, g = [], 0, 0
    per_call = min(gen_batch, -(-n_seqs // len(prompt_lens)))
    while done < n_seqs:
        n = min(per_call, n_seqs - done)
        plen = prompt_lens[g % len(prompt_lens)]
        calls.append((plen, make_prompts(ids, n, plen, gen, random_frac, vocab, bos, segments)))
        done += n
        g += 1
    return calls


def greedy_continue(target, prompts, seq_len, device):
    """One target.generate call: the greedy continuations of prompts [n, plen] to seq_len tokens."""
    prompts = prompts.to(device)
    out = target.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=seq_len - prompts.shape[1],
        do_sample=False,
        eos_token_id=None,
        pad_token_id=1,
    )
    assert out.shape == (prompts.shape[0], seq_len), out.shape
    return out


def first_anchors(plens, anchor_from):
    """The first anchor of every sequence: the last prompt position (anchor_from < 0, the original
    behaviour), else position anchor_from, or the last prompt position if that comes earlier."""
    return [plen - 1 if anchor_from < 0 else min(anchor_from, plen - 1) for plen in plens]


@torch.no_grad()
def finish_dataset(target, cfg, seqs, plens, anchor_from, device, label, gen_seconds):
    """Per generated sequence [n, seq_len]: the taps, the final hidden state (for the target's
    distribution), the target's greedy token after every position (from one full forward), the
    prompt length and the first usable anchor."""
    t1 = time.time()
    n_seqs, seq_len = seqs.shape
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
        "first": torch.tensor(first_anchors(plens, anchor_from), device=device),
        "prompt_len": torch.tensor(plens, device=device),
        "taps": torch.cat(taps),
        "final": torch.cat(final),
        "greedy": torch.cat(greedy),
    }
    # How often the full forward's argmax agrees with the cached greedy generation (numerics).
    gen_pos = torch.arange(seq_len - 1, device=device)[None, :] >= data["prompt_len"][:, None] - 1
    agree = int(((data["greedy"][:, :-1] == seqs[:, 1:]) & gen_pos).sum())
    total = int(gen_pos.sum())
    print(
        f"train-drafter: {label}: {n_seqs} sequences x {seq_len} tokens, generate {gen_seconds:.1f}s, "
        f"taps {time.time() - t1:.1f}s; full-forward argmax == generated token at "
        f"{agree / max(total, 1):.4%} of generated positions",
        flush=True,
    )
    return data


@torch.no_grad()
def build_dataset(target, cfg, ids, n_seqs, seq_len, prompt_lens, gen_batch, random_frac,
                  segments, gen, device, label, anchor_from=-1):
    """Greedy continuations of n_seqs prompts to seq_len tokens, one generate call per prompt
    call of `draw_prompt_calls`, and per sequence what `finish_dataset` adds."""
    t0 = time.time()
    vocab, bos = target.config.vocab_size, target.config.bos_token_id
    calls = draw_prompt_calls(ids, n_seqs, prompt_lens, gen_batch, random_frac, vocab, bos,
                              segments, gen)
    seqs = torch.cat([greedy_continue(target, p, seq_len, device) for _, p in calls])
    plens = [plen for plen, p in calls for _ in range(p.shape[0])]
    return finish_dataset(target, cfg, seqs, plens, anchor_from, device, label, time.time() - t0)


@torch.no_grad()
def build_packed(target, cfg, ids, splits, seq_len, prompt_lens, gen_batch, random_frac, gen,
                 device, label, anchor_from=-1):
    """The train, validation and test data of one part with the fewest generate calls: the
    prompts are drawn exactly as three `build_dataset` calls would draw them (same generator
    order), then all prompts of one length, whichever split they belong to, are continued
    together in calls of at most gen_batch sequences. HF generate's cost grows with the number
    of generated steps far more than with the batch, so this costs about a third of three
    separate builds when the evaluation splits are small. splits: [(name, n_seqs, segments)].
    Returns {name: data}."""
    t0 = time.time()
    vocab, bos = target.config.vocab_size, target.config.bos_token_id
    drawn = []  # (split, plen, prompts) in draw order
    for name, n, segments in splits:
        for plen, p in draw_prompt_calls(ids, n, prompt_lens, gen_batch, random_frac, vocab, bos,
                                         segments, gen):
            drawn.append((name, plen, p))
    out = [None] * len(drawn)
    calls, steps = 0, 0
    for plen in dict.fromkeys(pl for _, pl, _ in drawn):
        which = [k for k, (_, pl, _) in enumerate(drawn) if pl == plen]
        prompts = torch.cat([drawn[k][2] for k in which])
        seqs = torch.cat([greedy_continue(target, prompts[i : i + gen_batch], seq_len, device)
                          for i in range(0, prompts.shape[0], gen_batch)])
        n_calls = -(-prompts.shape[0] // gen_batch)
        calls, steps = calls + n_calls, steps + n_calls * (seq_len - plen)
        for k, part in zip(which, seqs.split([drawn[k][2].shape[0] for k in which])):
            out[k] = part
    gen_s = time.time() - t0
    print(f"train-drafter: {label}: {sum(p.shape[0] for _, _, p in drawn)} sequences x {seq_len} "
          f"tokens (train, validation and test together) in {calls} generate calls of at most "
          f"{gen_batch}, {steps} generated steps, {gen_s:.1f}s", flush=True)
    result = {}
    for name, _, _ in splits:
        ks = [k for k, (s, _, _) in enumerate(drawn) if s == name]
        seqs = torch.cat([out[k] for k in ks])
        plens = [drawn[k][1] for k in ks for _ in range(drawn[k][2].shape[0])]
        result[name] = finish_dataset(target, cfg, seqs, plens, anchor_from, device,
                                      f"{label}, {name}", gen_s)
    return result


def generation_batch(gen_batch, seq_len, max_tokens):
    """Sequences per generate call: gen_batch, cut so that batch x seq_len <= max_tokens (the
    cache and the per-layer MLA re-expansion grow with it; see --drafter-long-gen-tokens)."""
    return max(1, min(gen_batch, max_tokens // seq_len))


def sample_anchors(first, seq_len, b, count, gen):
    """count anchors per sequence, uniform in [first, seq_len - 1 - b] (drafts at n+1..n+b)."""
    lo = first.cpu().float()
    span = (seq_len - b) - lo  # number of valid anchors
    u = torch.rand(len(lo), count, generator=gen)
    return (lo[:, None] + (u * span[:, None]).floor()).long()


def sample_anchors_split(first, prompt_len, seq_len, b, count, tail_share, gen):
    """count anchors per sequence, a tail_share of them uniform in the generated tail
    [prompt_len - 1, seq_len - 1 - b], the others uniform in the prompt region
    [first, prompt_len - 2] (all in the tail where the prompt region is empty)."""
    lo_p, lo_t = first.cpu().float(), (prompt_len.cpu() - 1).float()
    span_p, span_t = lo_t - lo_p, (seq_len - b) - lo_t
    u = torch.rand(len(lo_p), count, generator=gen)
    tail = (torch.rand(len(lo_p), count, generator=gen) < tail_share) | (span_p[:, None] <= 0)
    return torch.where(tail, lo_t[:, None] + (u * span_t[:, None]).floor(),
                       lo_p[:, None] + (u * span_p[:, None]).floor()).long()


def gather_targets(data, idx, anchors, b):
    """Labels y[s, a, k] = target's greedy token at n + 1 + k (= greedy[n + k]); Markov inputs
    prev[s, a, k] = the token at n + k (k = 0: the anchor)."""
    pos = anchors[:, :, None] + torch.arange(b, device=anchors.device)
    tok = data["tokens"][idx]
    grd = data["greedy"][idx]
    s = torch.arange(len(idx), device=anchors.device)[:, None, None]
    return tok[s, pos], grd[s, pos], pos


def chain_mask(data, idx, anchors, b):
    """[S, A, B] bool: whether block position k of anchor n has a label the verifier could see.
    The label greedy[n + k] is the target's argmax after the sequence's own tokens up to n + k;
    the verifier, after accepting drafts 0..k-1, asks for the argmax after the *target's greedy
    tokens* there. The two agree while the sequence follows the target's greedy chain: every
    token at n + 1 + j (j < k) is a generated one or a prompt token equal to greedy[n + j]. Always
    true for anchors in the generated region; in corpus text it keeps each block's leading
    positions up to the first token where the text leaves what the target would have said."""
    pos = anchors[:, :, None] + torch.arange(b, device=anchors.device)
    s = torch.arange(len(idx), device=anchors.device)[:, None, None]
    nxt = pos + 1
    on = (data["tokens"][idx][s, nxt] == data["greedy"][idx][s, pos]) | (
        nxt >= data["prompt_len"][idx][:, None, None])
    return torch.cat([torch.ones_like(on[..., :1]), on[..., :-1]], -1).long().cumprod(-1).bool()


def region_bounds(data, idx, region, b):
    """Per sequence the inclusive anchor range of a region: "generated" anchors n >= prompt_len - 1
    (every draft is a generated token's position; the original evaluation region), "prompt"
    anchors first <= n < prompt_len - 1 (the anchor and the first drafted position are corpus
    text)."""
    seq_len = data["tokens"].shape[1]
    last = data["prompt_len"][idx] - 1
    if region == "generated":
        return last, torch.full_like(last, seq_len - b - 1)
    assert region == "prompt", region
    return data["first"][idx], last - 1


# --------------------------------------------------------------------------------------------
# Evaluation: held-out acceptance of greedy drafts
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(cfg, w, embed, lm_head, data, stride, batch, min_survival=0.3, anchor_chunk=32,
             region="generated"):
    """For every stride-th anchor of a region (`region_bounds`) of the held-out sequences: the
    greedy Markov drafts (each draft fed the previous *draft*, as at inference) against the
    target's greedy tokens. Returns per-position conditional acceptance, unconditional match, the
    acceptance length with fixed gamma = B (1 + leading matches: tokens per round including the
    correction/bonus token), the same under the engine's default confidence:0.3 policy at
    concurrency 1, and calibration; None when the region has no anchor.

    In the "generated" region every label is what the verifier would see. In the "prompt" region
    (corpus text) a position's label is known only while the text follows the target's greedy
    chain (`chain_mask`); there the statistics count known positions only, and the acceptance
    lengths are 1 + sum_k prod_{i<=k} c_i from the conditional acceptances c_i (the same number
    as the mean when nothing is censored); "on_chain_per_position" says how much is known and
    "reached_and_known_per_position" how many blocks each conditional rate rests on (None where
    none: the acceptance lengths then stop there, a lower bound)."""
    b = cfg["block_size"]
    w = {k: v.float() for k, v in w.items()}
    lead, match, conf_all, tv, known = [], [], [], [], []
    n_seq = data["tokens"].shape[0]
    dev = data["tokens"].device
    for i in range(0, n_seq, batch):
        idx = torch.arange(i, min(i + batch, n_seq), device=dev)
        lo, hi = region_bounds(data, idx, region, b)
        if bool((hi < lo).all()):
            continue
        f0 = int(lo.min())
        feat = context_feature(cfg, w, data["taps"][idx])
        all_anchors = torch.arange(f0, int(hi.max()) + 1, stride, device=dev)
        for a0 in range(0, len(all_anchors), anchor_chunk):
            anchors = all_anchors[a0 : a0 + anchor_chunk].expand(len(idx), -1)
            valid = (anchors >= lo[:, None]) & (anchors <= hi[:, None])
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
            if region == "prompt":
                known.append(chain_mask(data, idx, anchors, b)[valid])
    if not lead:
        return None
    match, lead, conf_all, tv = (torch.cat(x).float() for x in (match, lead, conf_all, tv))
    # confidence:MIN at concurrency 1: gamma = longest prefix with cumulative survival >= MIN.
    gamma = (conf_all.cumprod(-1) >= min_survival).long().cumprod(-1).sum(-1)
    if known:
        return censored_stats(b, match, lead, conf_all, tv, torch.cat(known).float(), gamma,
                              min_survival)
    accepted = lead.sum(-1)
    # Conditional acceptance of slot k given slots < k accepted.
    reach = torch.cat([torch.ones_like(lead[:, :1]), lead[:, :-1]], -1)
    cond = (lead.sum(0) / reach.sum(0).clamp(min=1)).tolist()
    conf_given_reach = ((conf_all * reach).sum(0) / reach.sum(0).clamp(min=1)).tolist()
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


def censored_stats(b, match, lead, conf_all, tv, known, gamma, min_survival):
    """`evaluate`'s statistics where position k of a block is known only where known[:, k] (a
    leading mask): rates over known positions, acceptance lengths from conditional acceptance."""

    def conditional(lead_):
        reach_ = torch.cat([torch.ones_like(lead_[:, :1]), lead_[:, :-1]], -1) * known
        return (lead_ * known).sum(0) / reach_.sum(0).clamp(min=1), reach_

    def tau(cond_):
        # Up to the first position no known block reached (a lower bound if there is one).
        n = int(reached.long().cumprod(0).sum())
        return float(1 + cond_[:n].cumprod(0).sum())

    cond, reach = conditional(lead)
    reached = reach.sum(0) > 0
    # Under confidence:MIN a draft counts only if it is inside the verified prefix (k < gamma).
    cond_pol, _ = conditional(lead * (torch.arange(b, device=lead.device) < gamma[:, None]))
    per_known = known.sum(0).clamp(min=1)
    return {
        "blocks": int(lead.shape[0]),
        "on_chain_per_position": [round(x, 4) for x in known.mean(0).tolist()],
        "reached_and_known_per_position": [int(x) for x in reach.sum(0).tolist()],
        "match_rate_per_position": [round(x, 4) for x in ((match * known).sum(0) / per_known).tolist()],
        "conditional_acceptance_per_position": [
            round(x, 4) if r else None for x, r in zip(cond.tolist(), reached.tolist())],
        "mean_confidence_when_reached": [
            round(x, 4) for x in ((conf_all * reach).sum(0) / reach.sum(0).clamp(min=1)).tolist()],
        "acceptance_length_fixed_B": round(tau(cond), 4),
        "accepted_histogram": None,
        f"confidence_{min_survival}_mean_gamma": round(float(gamma.float().mean()), 4),
        f"confidence_{min_survival}_acceptance_length": round(tau(cond_pol), 4),
        "teacher_forced_1_minus_tv_T1": [round(x, 4) for x in ((tv * known).sum(0) / per_known).tolist()],
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


def evaluate_parts(cfg, w, embed, lm_head, data, ev_args, tag, skip=()):
    """`evaluate` on the test split of every data part, in both regions: {part: {region: stats}}
    (a region without anchors is left out). skip: one (part, region) not to evaluate (the
    caller's own `test_before` / `test_after`, the original report fields)."""
    out = {}
    for name, splits in data.items():
        out[name] = {}
        for region in ("generated", "prompt"):
            if (name, region) == tuple(skip):
                continue
            ev = evaluate(cfg, w, embed, lm_head, splits["test"], *ev_args, region=region)
            if ev is not None:
                out[name][region] = ev
                print_eval(f"{tag}: {name} data, {region} region", ev)
    return out


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def calibrate_confidence(cfg, w, embed, lm_head, data, stride, batch, steps, lr, anchor_chunk=32):
    """Refits the confidence head alone (a logistic regression on [h_k ; W1[x_{k-1}]]) on data
    the backbone never trained on, with the backbone as shipped (bf16): the training split's
    draft accuracy is optimistic, so a head fitted there over-predicts survival. Labels as in
    training: the greedy draft at k (teacher-forced Markov input) equals the target's token.
    Anchors in the generated region only (where the engine drafts)."""
    b = cfg["block_size"]
    wf = {k: v.float() for k, v in w.items()}
    seq_len = data["tokens"].shape[1]
    dev = data["tokens"].device
    xs, ys = [], []
    with torch.no_grad():
        for i in range(0, data["tokens"].shape[0], batch):
            idx = torch.arange(i, min(i + batch, data["tokens"].shape[0]), device=dev)
            feat = context_feature(cfg, wf, data["taps"][idx])
            lo = data["prompt_len"][idx] - 1  # the generated region (see region_bounds)
            all_anchors = torch.arange(int(lo.min()), seq_len - b, stride, device=dev)
            for a0 in range(0, len(all_anchors), anchor_chunk):
                anchors = all_anchors[a0 : a0 + anchor_chunk].expand(len(idx), -1)
                valid = anchors >= lo[:, None]
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


def data_parts(args, b: int) -> list:
    """The parts the training and evaluation data are made of, one dict each: prompt lengths,
    sequence length, training sequences, sequences per evaluation split (validation and test each),
    sequences per generate call, fraction of random-token prompts, whether the splits share
    generate calls (`build_packed`).

    "short" (always; --drafter-seq-len, --drafter-prompt-lens, ...): the original data, the target's
    greedy continuation of short prompts. "long" (with --drafter-long-prompt-lens): serving-shaped,
    long corpus prompts and a short generated tail; corpus prompts only, always packed, and at
    most --drafter-long-gen-tokens tokens (batch x sequence length) per generate call."""
    parts = [dict(name="short", prompt_lens=[int(x) for x in args.drafter_prompt_lens.split(",")],
                  seq_len=args.drafter_seq_len, seqs=args.drafter_seqs,
                  eval_seqs=args.drafter_eval_seqs, gen_batch=args.drafter_gen_batch,
                  random_frac=args.drafter_random_prompts, pack=args.drafter_pack_splits)]
    assert max(parts[0]["prompt_lens"]) + b + 1 < args.drafter_seq_len, "sequences too short for the prompts"
    if args.drafter_long_prompt_lens:
        seq_len = args.drafter_long_seq_len
        plens = [int(x) for x in args.drafter_long_prompt_lens.split(",")]
        assert max(plens) + b + 1 < seq_len, "long sequences too short for the long prompts"
        parts.append(dict(name="long", prompt_lens=plens, seq_len=seq_len,
                          seqs=args.drafter_long_seqs, eval_seqs=args.drafter_long_eval_seqs,
                          gen_batch=generation_batch(args.drafter_gen_batch, seq_len,
                                                     args.drafter_long_gen_tokens),
                          random_frac=0.0, pack=True))
    return parts


def has_prompt_anchors(data) -> bool:
    """Whether any sequence's anchors start inside its prompt (--drafter-anchor-from)."""
    return bool((data["first"] < data["prompt_len"] - 1).any())


def add_up(xs):
    """The sum of an iterable of tensors, the first one itself when there is one (no extra op)."""
    total = None
    for x in xs:
        total = x if total is None else total + x
    return total


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
    parts = data_parts(args, b)
    data, data_info = {}, {}
    for part in parts:
        t0 = time.time()
        name = part["name"]
        common = dict(seq_len=part["seq_len"], prompt_lens=part["prompt_lens"],
                      gen_batch=part["gen_batch"], random_frac=part["random_frac"], gen=gen,
                      device=device, anchor_from=args.drafter_anchor_from)
        splits = [("train", part["seqs"], train_segs), ("validation", part["eval_seqs"], val_segs),
                  ("test", part["eval_seqs"], test_segs)]
        prefix = "" if name == "short" else f"{name} "
        if part["pack"]:
            data[name] = build_packed(target, cfg, ids, splits, label=f"{prefix}data", **common)
        else:
            data[name] = {split: build_dataset(target, cfg, ids, n, segments=segs,
                                               label=f"{prefix}{split} data", **common)
                          for split, n, segs in splits}
        data_info[name] = {k: part[k] for k in ("prompt_lens", "seq_len", "seqs", "eval_seqs",
                                                 "gen_batch", "pack")}
        data_info[name]["seconds"] = round(time.time() - t0, 1)
    t_data = time.time() - t_start
    mem_data = peak_memory_gb(device)
    if mem_data is not None:
        print(f"train-drafter: device memory peak so far {mem_data:.1f} GB (data built)", flush=True)
    train_data, test_data = data["short"]["train"], data["short"]["test"]
    long = data.get("long")
    # Checkpoint choice and confidence calibration on the most serving-shaped validation data:
    # the long part's generated tail (a long corpus prompt, then the target's greedy text).
    select_on = "long" if long else "short"
    val_data = data[select_on]["validation"]

    w = {k: v.float().to(device).clone().requires_grad_(True) for k, v in init_state.items()}
    params = list(w.values())
    report = {"device": str(device), "torch_version": torch.__version__}
    ev_args = (args.drafter_eval_stride, args.drafter_eval_batch)
    ev0 = evaluate(cfg, w, embed, lm_head, test_data, *ev_args)
    print_eval("test before training", ev0)
    report["test_before"] = ev0
    report["test_before_by_part"] = evaluate_parts(cfg, w, embed, lm_head, data, ev_args,
                                                   "test before training", skip=("short", "generated"))

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
    # the device in one copy, so the loop never waits for the device. With a long part, a share of
    # each step's sequences comes from it (drawn after the short part's, so that a run without one
    # draws exactly what it always drew).
    n_long = 0 if long is None else max(1, round(args.drafter_batch * args.drafter_long_share))
    n_short = args.drafter_batch - n_long
    assert n_short >= 1, "--drafter-long-share leaves no short sequence in a step"
    first_cpu = train_data["first"].cpu()
    all_idx = torch.randint(0, n_train, (steps, n_short), generator=gen)
    all_anchors = torch.stack([
        sample_anchors(first_cpu[all_idx[i]], args.drafter_seq_len, b, args.drafter_anchors, gen)
        for i in range(steps)
    ]).to(device)
    all_idx = all_idx.to(device)
    batches = [(train_data, all_idx, all_anchors, has_prompt_anchors(train_data))]
    if long is not None:
        lt = long["train"]
        l_first, l_plen = lt["first"].cpu(), lt["prompt_len"].cpu()
        l_idx = torch.randint(0, lt["tokens"].shape[0], (steps, n_long), generator=gen)
        l_anchors = torch.stack([
            sample_anchors_split(l_first[l_idx[i]], l_plen[l_idx[i]], lt["tokens"].shape[1], b,
                                 args.drafter_anchors, args.drafter_long_tail_share, gen)
            for i in range(steps)
        ]).to(device)
        batches.append((lt, l_idx.to(device), l_anchors, has_prompt_anchors(lt)))
    for step in range(steps):
        terms = []
        for d, b_idx, b_anchors, masked in batches:
            idx, anchors = b_idx[step], b_anchors[step]
            prev, y, pos = gather_targets(d, idx, anchors, b)
            feat = context_feature(cfg, w, d["taps"][idx])
            hidden, u = block_forward(cfg, w, embed, lm_head, feat, prev[:, :, 0], anchors)
            logits = markov_logits(w, u, prev)  # teacher-forced: x_{k-1} = the sequence's token
            # Positions whose label the verifier would not see (corpus text that left the target's
            # greedy chain, `chain_mask`) get no loss; without prompt anchors there are none.
            mask = chain_mask(d, idx, anchors, b).float() if masked else None
            wk = pos_w.expand_as(y) if mask is None else pos_w * mask
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
            t = {"ce": (ce * wk.reshape(-1)).sum(), "w": wk.sum(), "mask": mask}
            if args.drafter_kl_weight > 0:
                s = torch.arange(len(idx), device=device)[:, None, None]
                with torch.no_grad():
                    logp_t = (d["final"][idx][s, pos] @ lm_head.T).log_softmax(-1)
                kl = (logp_t.exp() * (logp_t - logits.log_softmax(-1))).sum(-1)
                t["kl"] = (kl * wk).sum()
            t["hit"] = (logits.detach().argmax(-1) == y).float()
            t["zc"] = confidence_logit(w, hidden, prev, detach=True)
            terms.append(t)
        loss_ce = add_up(t["ce"] for t in terms) / add_up(t["w"] for t in terms)
        loss = args.drafter_ce_weight * loss_ce
        if args.drafter_kl_weight > 0:
            loss_kl = add_up(t["kl"] for t in terms) / add_up(t["w"] for t in terms)
            loss = loss + args.drafter_kl_weight * loss_kl
        if len(terms) == 1 and terms[0]["mask"] is None:
            loss_bce = F.binary_cross_entropy_with_logits(terms[0]["zc"], terms[0]["hit"])
        else:
            ms = [torch.ones_like(t["hit"]) if t["mask"] is None else t["mask"] for t in terms]
            loss_bce = add_up(
                (F.binary_cross_entropy_with_logits(t["zc"], t["hit"], reduction="none") * m).sum()
                for t, m in zip(terms, ms)) / add_up(m.sum() for m in ms)
        loss = loss + args.drafter_conf_weight * loss_bce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        over = (args.drafter_time_budget > 0 and time.time() - t_train > args.drafter_time_budget)
        if step % args.drafter_log_every == 0 or step == steps - 1 or over:
            acc = terms[0]["hit"].mean((0, 1)).tolist()
            extra = ""
            if len(terms) > 1:
                t, m = terms[1], (terms[1]["mask"] if terms[1]["mask"] is not None
                                  else torch.ones_like(terms[1]["hit"]))
                lacc = ((t["hit"] * m).sum((0, 1)) / m.sum((0, 1)).clamp(min=1)).tolist()
                extra = f", long {[round(a, 3) for a in lacc]}"
            print(
                f"train-drafter: step {step:5d} lr {sched.get_last_lr()[0]:.2e} loss {loss.item():.4f} "
                f"ce {loss_ce.item():.4f} bce {loss_bce.item():.4f} teacher-forced match "
                f"{[round(a, 3) for a in acc]}{extra} ({time.time() - t_train:.1f}s)",
                flush=True,
            )
        if (step + 1) % args.drafter_eval_every == 0 or step == steps - 1 or over:
            ev = evaluate(cfg, w, embed, lm_head, val_data, *ev_args)
            tau = ev["acceptance_length_fixed_B"]
            history.append({"step": step + 1, "val_acceptance_length": tau,
                            "val_match_rate_per_position": ev["match_rate_per_position"]})
            print(f"train-drafter: step {step + 1}: validation acceptance length {tau:.4f} "
                  f"match/position {ev['match_rate_per_position']}"
                  f"{' (long data, generated tail)' if long else ''}", flush=True)
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
    shipped = {k: v.to(device) for k, v in state.items()}
    ev1 = evaluate(cfg, shipped, embed, lm_head, test_data, *ev_args)
    print_eval("test after training (bf16 weights as written)", ev1)
    by_part = evaluate_parts(cfg, shipped, embed, lm_head, data, ev_args,
                             "test after training", skip=("short", "generated"))
    by_part.setdefault("short", {})["generated"] = ev1
    report.update(
        {
            "test_after": ev1,
            "test_after_by_part": by_part,
            "serving_shaped": None if long is None else {
                "what": "held-out test: a long corpus prompt, then the target's greedy tail; "
                        "anchors in the tail (the region the engine drafts in)",
                "prompt_lens": data_info["long"]["prompt_lens"],
                "seq_len": data_info["long"]["seq_len"],
                "test_after": by_part["long"].get("generated"),
            },
            "selection_data": f"{select_on} validation data, generated region",
            "data": data_info,
            "best_step": best[1],
            "steps_run": last_step + 1,
            "validation_history": history,
            "confidence_calibration": calib,
            "data_seconds": round(t_data, 1),
            "device_memory_peak_gb": {"data": mem_data, "all": peak_memory_gb(device)},
            "train_seconds": round(train_s, 1),
            "total_seconds": round(time.time() - t_start, 1),
            "settings": {
                k: getattr(args, k)
                for k in sorted(vars(args))
                if k.startswith("drafter_") and k != "drafter_out"
            },
        }
    )
    mem = peak_memory_gb(device)
    print(f"train-drafter: data {t_data:.1f}s, training {train_s:.1f}s, {time.time() - t_start:.1f}s in all"
          + ("" if mem is None else f"; device memory peak {mem:.1f} GB"), flush=True)
    return state, report


def peak_memory_gb(device):
    """torch's peak allocated CUDA memory so far (None on other devices)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 2)


def write_report(out: Path, report: dict) -> None:
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
