#!/usr/bin/env python3
"""Replays ferry's greedy speculative rounds for one prompt with the PyTorch reference drafter.

Why: a drafter's offline acceptance length (τ, from `train_drafter.py`'s evaluation) and the τ
ferry measures while serving can differ for two reasons — the prompts differ, or ferry's serving
path (the drafter context written step by step, rolled back, deferred, shipped) feeds the drafter
something other than what it was trained on. This script removes the first reason: it takes one
prompt, lets the target (Hugging Face transformers, float32) continue it greedily, and walks the
rounds ferry would run on that text under `--verify-len fixed:G` — at each round the reference
drafter (`train_drafter.py`'s `block_forward` + `greedy_drafts`, the code that trained the
drafter) drafts from the target's taps of every position before the anchor, and the round accepts
the drafts that match the target's greedy text. With `--ferry LOG` it replays instead the
rounds ferry itself ran on the same prompt (the engine's `speculative round` trace lines, which
name each round's anchor position and verify length, so any `--verify-len` policy works,
`goodput`'s plain steps and deferred drafter context included) and compares the drafts accepted
round by round.

Equal counts mean ferry's drafter sees the context it was trained on; the first round that
differs names the position where it does not. Float32 on both sides; a draft whose two best
logits are within `--tie` of each other may legitimately go either way and is reported as a tie.

    cargo build --release -p ferry
    FERRY_LOG=warn,ferry_model=trace target/release/ferry generate --device cpu \
        --prompt "The quick brown fox" --max-tokens 160 --ignore-eos --speculative on \
        --verify-len goodput 2> ferry.log
    python scripts/spec_replay.py --prompt "The quick brown fox" --max-tokens 160 --ferry ferry.log
    python scripts/spec_replay.py --prompt "The quick brown fox" --max-tokens 160 --gamma 4

`--golden FILE` adds a simulated run (prompt ids, the target's greedy tokens, each round's
position, verify length and drafts accepted) to a JSON list: `models/tiny-k3-dspark/golden/
replay.json`, which `model/tests/spec_engine.rs` holds the engine to without Python.

Needs torch, transformers, safetensors, tokenizers (`scripts/requirements-train.txt`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_drafter import block_forward, context_feature, greedy_drafts, target_taps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def ferry_rounds(log: Path) -> list[tuple[int, int, int]]:
    """(position, gamma, accepted) of every `speculative round` trace line, in order."""
    pat = re.compile(r"speculative round seq=\d+ position=(\d+) gamma=(\d+) accepted=(\d+)")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())  # the log's colours, if any
    return [tuple(int(x) for x in m.groups()) for m in pat.finditer(plain)]


def greedy_text(target, ids: list[int], new: int) -> list[int]:
    """The target's greedy continuation (first maximum, as ferry's argmax), `new` tokens."""
    out = list(ids)
    dev = target.device
    with torch.no_grad():
        for _ in range(new):
            logits = target(input_ids=torch.tensor([out], device=dev)).logits[0, -1].float()
            out.append(int(logits.argmax()))
    return out


class Reference:
    """The reference drafter over one text: the target's taps of every position, once."""

    def __init__(self, cfg: dict, w: dict, target, text: list[int], tie: float):
        self.cfg, self.w, self.text, self.tie = cfg, w, text, tie
        self.dev = target.device
        with torch.no_grad():
            taps, _, _ = target_taps(target, cfg, torch.tensor([text], device=self.dev))
            self.feat = context_feature(cfg, w, taps)
            self.embed = target.model.embed_tokens.weight.float()
            self.lm_head = target.lm_head.weight.float()

    def round(self, p: int, g: int) -> dict:
        """The round anchored at position `p` (anchor `text[p]`, context: positions < p) that
        verifies `g` greedy drafts against the text."""
        text = self.text
        with torch.no_grad():
            at = lambda x: torch.tensor(x, device=self.dev)  # noqa: E731
            hidden, u = block_forward(self.cfg, self.w, self.embed, self.lm_head, self.feat,
                                      at([[text[p]]]), at([[p]]))
            drafts, markov, _ = greedy_drafts(self.w, hidden[0, 0], u[0, 0], at(text[p]))
            top2 = torch.topk(markov, 2, dim=-1).values
        drafts = [int(d) for d in drafts[:g]]
        a = 0
        while a < g and p + 1 + a < len(text) and drafts[a] == text[p + 1 + a]:
            a += 1
        # The first rejected draft (or the last accepted one) decides the count: a near-tie
        # there may go either way in another implementation's float32.
        k = min(a, g - 1)
        margin = float(top2[k, 0] - top2[k, 1])
        # Every draft up to the text's end matched: the count stops there, not at a rejection
        # (ferry may accept more of a round that runs past the request's last token).
        end = a < g and p + 1 + a >= len(text)
        return {"position": p, "gamma": g, "accepted": a, "tie": margin < self.tie,
                "margin": round(margin, 6), "end": end}


def differs(r: dict) -> bool:
    """Whether ferry's count for a replayed round differs from the reference's: a round cut
    by the text's end agrees when ferry accepted at least as many."""
    if r["end"]:
        return r["ferry_accepted"] < r["accepted"]
    return r["ferry_accepted"] != r["accepted"]


def simulate(ref: Reference, n0: int, max_tokens: int, gamma: int) -> list[dict]:
    """The rounds ferry runs under `--verify-len fixed:gamma` on the reference's text (prompt
    of `n0` tokens + `max_tokens` greedy tokens): every decode step drafts while the request
    has room for a draft."""
    block = ref.cfg["block_size"]
    rounds = []
    generated, p = 1, n0  # the prefill emitted text[n0]; it is the first anchor
    while generated < max_tokens:
        g = min(gamma, max_tokens - (generated + 1), block)
        if g == 0:  # a plain step
            generated += 1
            p += 1
            continue
        r = ref.round(p, g)
        rounds.append(r)
        generated += r["accepted"] + 1
        p += r["accepted"] + 1
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models/tiny-k3")
    ap.add_argument("--drafter", type=Path, default=ROOT / "models/tiny-k3-dspark")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--gamma", type=int, default=4,
                    help="without --ferry: simulate --verify-len fixed:GAMMA")
    ap.add_argument("--ferry", type=Path,
                    help="ferry's trace log of the same prompt and --max-tokens: replay its rounds")
    ap.add_argument("--tie", type=float, default=1e-3, help="logit margin reported as a tie")
    ap.add_argument("--device", default="cpu", help="torch device (float32 either way)")
    ap.add_argument("--json", type=Path, help="write the rounds and the comparison here")
    ap.add_argument("--golden", type=Path,
                    help="add this prompt's simulated run to a golden file (JSON list of cases)")
    args = ap.parse_args()

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.manual_seed(0)
    cfg = json.loads((args.drafter / "config.json").read_text())
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on a GPU too
    w = {k: v.float().to(args.device)
         for k, v in load_file(str(args.drafter / "model.safetensors")).items()}
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = target.to(args.device).eval()
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    ids = tok.encode(args.prompt, add_special_tokens=True).ids
    text = greedy_text(target, ids, args.max_tokens)
    ref = Reference(cfg, w, target, text, args.tie)
    rc = 0
    if args.ferry:
        # ferry's own rounds, at its positions and verify lengths (any policy; plain steps in
        # between are fine): the reference must accept as many drafts in each.
        theirs = ferry_rounds(args.ferry)
        rounds = [ref.round(p, g) for p, g, _ in theirs]
        for r, (_, _, a) in zip(rounds, theirs):
            r["ferry_accepted"] = a
    else:
        rounds = simulate(ref, len(ids), args.max_tokens, args.gamma)
    acc = sum(r["accepted"] for r in rounds)
    tau = (acc + len(rounds)) / len(rounds) if rounds else None
    report = {"prompt_tokens": len(ids), "max_tokens": args.max_tokens, "rounds": len(rounds),
              "accepted": acc, "tau": tau, "per_round": rounds}
    print(f"reference: {len(rounds)} rounds, {acc} accepted, tau "
          + (f"{tau:.3f}" if tau is not None else "-"))
    if args.ferry:
        f_acc = sum(r["ferry_accepted"] for r in rounds)
        differ = [r for r in rounds if differs(r)]
        real = [r for r in differ if not r["tie"]]
        report["ferry"] = {"accepted": f_acc, "rounds_differing": len(differ),
                           "of_them_near_ties": len(differ) - len(real)}
        print(f"ferry:     {len(rounds)} rounds, {f_acc} accepted; {len(differ)} rounds differ"
              f" ({len(differ) - len(real)} at a near-tie)")
        if real:
            print(f"first difference: {real[0]}")
            rc = 1
        elif not rounds:
            print("ferry's log has no speculative round (FERRY_LOG=ferry_model=trace?)")
            rc = 1
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.golden:
        if args.ferry or any(r["tie"] for r in rounds):
            print("--golden takes a simulated run without near-ties", file=sys.stderr)
            return 2
        cases = json.loads(args.golden.read_text()) if args.golden.exists() else []
        cases = [c for c in cases if c["prompt"] != args.prompt]
        cases.append({
            "prompt": args.prompt, "prompt_ids": ids, "max_tokens": args.max_tokens,
            "verify_len": f"fixed:{args.gamma}", "tokens": text[len(ids):],
            "rounds": len(rounds), "drafted": sum(r["gamma"] for r in rounds), "accepted": acc,
            "per_round": [[r["position"], r["gamma"], r["accepted"]] for r in rounds],
        })
        args.golden.write_text(json.dumps(cases) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
