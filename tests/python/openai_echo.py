"""`echo` with `logprobs` on completions with the official `openai` Python client.

Run by tests/cluster_python.rs against a live cluster:

    python3 tests/python/openai_echo.py --base-url http://127.0.0.1:PORT/v1 --model tiny-k3 \
        --prompt TEXT

Sends the prompt once without `echo` (so its prefix is in the workers' prefix caches), then
with `echo=True, logprobs=2`: whole, again whole (the prefix cached by now), streamed, and
with `max_tokens=0` (the prompt alone). Checks what a client sees: each text starts with the
prompt; the `logprobs` lists cover the prompt's tokens then the generated ones, the first
with `None` for its log-probability and alternatives, the others with 2 alternatives each;
`text_offset` starts at 0 and counts the tokens' texts; the cached and streamed answers equal
the first; `max_tokens=0` gives the prompt and its entries alone with `finish_reason` length.
Prints {"tokens", "token_logprobs", "prompt_tokens", "generated"} of the first echo as one
JSON line, for the caller to compare with a direct forward. Any failed check raises, so the
process exits non-zero.
"""

import argparse
import json
import math

from openai import OpenAI

TOL = 2e-4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    max_tokens = 4
    base = dict(model=args.model, prompt=args.prompt, temperature=0, extra_body={"ignore_eos": True})

    plain = client.completions.create(max_tokens=max_tokens, **base)
    generated = plain.choices[0].text
    prompt_tokens = plain.usage.prompt_tokens

    def check(choice, n_generated: int, what: str):
        lp = choice.logprobs
        assert lp is not None, (what, choice)
        n = prompt_tokens + n_generated
        assert len(lp.tokens) == n, (what, len(lp.tokens), n)
        assert len(lp.token_logprobs) == n and len(lp.top_logprobs) == n, what
        assert len(lp.text_offset) == n, what
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, (what, lp.token_logprobs[:2])
        at = 0
        for i, (tok, off) in enumerate(zip(lp.tokens, lp.text_offset)):
            assert off == at, (what, i, off, at)
            at += len(tok)
        for i in range(1, n):
            v = lp.token_logprobs[i]
            assert v is not None and v <= 0 and math.isfinite(v), (what, i, v)
            assert len(lp.top_logprobs[i]) == 2, (what, i, lp.top_logprobs[i])
        return lp

    echo = client.completions.create(max_tokens=max_tokens, echo=True, logprobs=2, **base)
    c = echo.choices[0]
    assert c.text == args.prompt + generated, (c.text, generated)
    first = check(c, max_tokens, "echo")
    assert echo.usage.completion_tokens == max_tokens, echo.usage

    # The prefix is cached by now: the answer is still complete and equal.
    again = check(
        client.completions.create(max_tokens=max_tokens, echo=True, logprobs=2, **base).choices[0],
        max_tokens,
        "echo again",
    )
    assert again.tokens == first.tokens
    for i in range(1, len(first.tokens)):
        assert abs(again.token_logprobs[i] - first.token_logprobs[i]) <= TOL, (i,)

    # Streamed: the prompt comes first; the entries equal the whole answer's.
    text, tokens, logprobs = "", [], []
    stream = client.completions.create(
        max_tokens=max_tokens, echo=True, logprobs=2, stream=True, **base
    )
    for k, chunk in enumerate(stream):
        for ch in chunk.choices:
            if k == 0:
                assert ch.text.startswith(args.prompt), ch.text
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                logprobs += ch.logprobs.token_logprobs
    assert text == args.prompt + generated, text
    assert tokens == first.tokens, (tokens, first.tokens)
    assert logprobs[0] is None
    for i in range(1, len(tokens)):
        assert abs(logprobs[i] - first.token_logprobs[i]) <= TOL, i

    # `max_tokens=0`: the prompt alone.
    only = client.completions.create(max_tokens=0, echo=True, logprobs=2, **base)
    oc = only.choices[0]
    assert oc.text == args.prompt, oc.text
    assert oc.finish_reason == "length", oc
    assert only.usage.completion_tokens == 0, only.usage
    lp = check(oc, 0, "prompt only")
    assert lp.tokens == first.tokens[:prompt_tokens]

    print(
        json.dumps(
            {
                "tokens": first.tokens,
                "token_logprobs": first.token_logprobs,
                "prompt_tokens": prompt_tokens,
                "generated": generated,
            }
        )
    )


if __name__ == "__main__":
    main()
