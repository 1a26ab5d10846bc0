#!/usr/bin/env python3
"""Held-out benchmark prompts for the trained target (issue 15): windows of held-out corpus files
(scripts/make_corpus.py's held-out split, which neither the target nor the drafter trained on),
each exactly --tokens tokens of the target's tokenizer (after its BOS), as JSON lines
{"prompt": text, "prompt_tokens": n, "ids": [...], "source": "heldout[i]@offset"}.

    python3 scripts/heldout_prompts.py --corpus corpus --model train-out/target \\
        --tokens 1024 --count 8192 --out train-out/prompts-1024.jsonl

Windows start at file beginnings, then every --tokens + --room tokens inside long files (room for
the generated tokens the benchmark asks for); files are taken in sha256 order (deterministic).
When the held-out split has fewer such windows than --count, the stride shrinks to the largest
one that gives --count (the windows then overlap, but no two start at the same token of a file,
so a benchmark request prefills its whole prompt unless two files begin alike: 22 of 8,192
windows shared their first 64 tokens with another in session 54's split); the stride used is
printed. A benchmark that needs more prompts than the file holds reuses them, and a
reused prompt is served from the prefix cache: give --count at least the requests of a run.
The text is the decoded window: re-encoding it gives the same ids for byte-level BPE in nearly
every case; `ids` are what the target saw, `prompt_tokens` their count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_corpus  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--corpus", default="corpus")
    p.add_argument("--model", required=True, help="the target's directory (tokenizer.json)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--room", type=int, default=400, help="tokens between windows of one file")
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    docs = make_corpus.read_docs(Path(args.corpus) / "heldout.txt.xz")
    order = sorted(range(len(docs)), key=lambda i: hashlib.sha256(docs[i].encode()).hexdigest())
    encoded = [(i, tok.encode(docs[i], add_special_tokens=False).ids) for i in order]
    lengths = [len(ids) for _, ids in encoded]
    stride = window_stride(lengths, args.tokens, args.tokens + args.room, args.count)
    rows = []
    for i, ids in encoded:
        for off in range(0, len(ids) - args.tokens + 1, stride):
            w = ids[off : off + args.tokens]
            rows.append({"prompt": tok.decode(w), "prompt_tokens": len(w), "ids": w,
                         "source": f"heldout[{i}]@{off}"})
            if len(rows) == args.count:
                break
        if len(rows) == args.count:
            break
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    short = f" (asked for {args.count}: the held-out split holds no more)" if len(rows) < args.count else ""
    print(f"heldout-prompts: {len(rows)} prompts of {args.tokens} tokens, windows every {stride} "
          f"tokens{short} -> {args.out}")


def windows(lengths: list[int], tokens: int, stride: int) -> int:
    """Windows of `tokens` tokens starting every `stride` tokens, over files of `lengths`."""
    return sum((n - tokens) // stride + 1 for n in lengths if n >= tokens)


def window_stride(lengths: list[int], tokens: int, widest: int, count: int) -> int:
    """The widest stride, at most `widest`, that gives `count` windows (1 if none does)."""
    if windows(lengths, tokens, widest) >= count:
        return widest
    lo, hi = 1, widest  # windows(lo) >= count > windows(hi), or lo is the best there is
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if windows(lengths, tokens, mid) >= count:
            lo = mid
        else:
            hi = mid
    return lo


if __name__ == "__main__":
    main()
