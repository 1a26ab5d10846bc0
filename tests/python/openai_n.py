"""`n` > 1 with the official `openai` Python client against ferry's OpenAI-compatible gateway.

Run by tests/cluster_python.rs against a live cluster:

    python3 tests/python/openai_n.py --base-url http://127.0.0.1:PORT/v1 --model tiny-k3

Checks, for chat completions and completions, whole and streamed: `n` = 3 returns 3 choices
with indexes 0, 1, 2; greedy samples are all the one-sample greedy text; seeded samples at
T = 1 are reproducible and not all equal; a stream carries chunks of every index and exactly
one finish per index, and its `usage` counts every sample's completion tokens; `n` above the
cap (16) and `n` = 0 are a 400 naming `n`. Prints {"requests": R, "forks": F} as one JSON
line: the generation requests it sent that reached a decode worker and the samples beyond
the first among them, for the caller to compare with the workers' prefill counters. Any
failed check raises, so the process exits non-zero.
"""

import argparse
import json

from openai import BadRequestError, OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    sent = {"requests": 0, "forks": 0}

    def count(n: int) -> None:
        sent["requests"] += 1
        sent["forks"] += n - 1

    max_tokens = 8
    messages = [{"role": "user", "content": "Who created the heaven and the earth?"}]
    greedy = dict(
        model=args.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )

    one = client.chat.completions.create(**greedy)
    count(1)
    expected = one.choices[0].message.content
    assert expected, one

    # Whole, greedy: three equal choices, indexed 0..2, usage counting all of them.
    three = client.chat.completions.create(n=3, **greedy)
    count(3)
    assert [c.index for c in three.choices] == [0, 1, 2], three
    for c in three.choices:
        assert c.message.content == expected, (c, expected)
        assert c.finish_reason == "length", c
    assert three.usage.completion_tokens == 3 * max_tokens, three.usage
    assert three.usage.prompt_tokens == one.usage.prompt_tokens, three.usage

    # Streamed, greedy: chunks of every index, one finish per index, usage of all samples.
    stream = client.chat.completions.create(
        n=3, stream=True, stream_options={"include_usage": True}, **greedy
    )
    count(3)
    texts, finishes, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.setdefault(choice.index, []).append(choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in finishes, f"second finish for {choice.index}"
                finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2], texts
    assert finishes == {0: "length", 1: "length", 2: "length"}, finishes
    for i in range(3):
        assert "".join(texts[i]) == expected, (i, texts[i], expected)
    assert usage is not None and usage.completion_tokens == 3 * max_tokens, usage

    # Seeded at T = 1: reproducible, and the samples are not all the same.
    seeded = dict(greedy, temperature=1.0, seed=11, max_tokens=16, n=4)
    a = client.chat.completions.create(**seeded)
    b = client.chat.completions.create(**seeded)
    count(4)
    count(4)
    texts_a = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2, 3], a
    assert texts_a == [c.message.content for c in b.choices], "same seed, other samples"
    assert len(set(texts_a)) > 1, f"4 samples at T=1 all equal: {texts_a!r}"

    # Completions, whole and streamed.
    comp = dict(
        model=args.model,
        prompt="In the beginning",
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(n=2, **comp)
    count(2)
    assert [c.index for c in whole.choices] == [0, 1], whole
    assert whole.choices[0].text == whole.choices[1].text, whole
    assert whole.usage.completion_tokens == 2 * max_tokens, whole.usage
    streamed, done = {}, {}
    for chunk in client.completions.create(n=2, stream=True, **comp):
        for choice in chunk.choices:
            streamed.setdefault(choice.index, []).append(choice.text)
            if choice.finish_reason is not None:
                done[choice.index] = done.get(choice.index, 0) + 1
    count(2)
    assert done == {0: 1, 1: 1}, done
    for i in range(2):
        assert "".join(streamed[i]) == whole.choices[i].text, (i, streamed[i])

    # Out of range: a 400 naming `n`, nothing sent to a worker.
    for bad in (17, 0):
        try:
            client.chat.completions.create(n=bad, **greedy)
        except BadRequestError as e:
            assert e.status_code == 400 and e.param == "n", (bad, e.status_code, e.body)
        else:
            raise AssertionError(f"n={bad} was accepted")

    print(json.dumps(sent))


if __name__ == "__main__":
    main()
