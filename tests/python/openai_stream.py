"""The official `openai` Python client against ferry's OpenAI-compatible gateway.

Run by tests/cluster_python.rs against a live cluster:

    python3 tests/python/openai_stream.py --base-url http://127.0.0.1:PORT/v1 --model tiny-k3

Streams a chat completion (checking the chunks), makes the same request without streaming
(checking `usage`), then once more with speculative decoding off through `extra_body` (ferry's
`speculative` extension: the same greedy text), once with a wrong type for it (a 400 naming
the field), with parameters ferry does not implement (a 400 naming each) and with their no-op
values (the same text), with log-probabilities (whole and streamed: one entry per token, with
the asked alternatives, spelling the text), with penalties and `logit_bias` (another text, and
out-of-range values a 400 naming the field), and prints {"streamed": ..., "whole": ...} as one
JSON line. Any failed check raises, so the process exits non-zero.
"""

import argparse
import json

from openai import BadRequestError, OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Who created the heaven and the earth?"}]
    # Greedy and past end-of-sequence (ferry's `ignore_eos` extension): a fixed-length answer.
    common = dict(
        model=args.model,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )

    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **common
    )
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        assert chunk.object == "chat.completion.chunk", chunk
        assert chunk.model == args.model, chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0, chunk
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    streamed = "".join(pieces)
    assert len(pieces) > 1, f"expected the answer in several chunks, got {pieces!r}"
    assert streamed, "the streamed answer is empty"
    assert finish == "length", f"finish_reason {finish!r}"
    assert usage is not None, "no usage chunk despite stream_options.include_usage"
    assert usage.completion_tokens == args.max_tokens, usage

    whole = client.chat.completions.create(**common)
    assert whole.object == "chat.completion", whole
    assert whole.choices[0].message.role == "assistant", whole
    assert whole.choices[0].finish_reason == "length", whole
    text = whole.choices[0].message.content
    assert text, "the non-streaming answer is empty"
    u = whole.usage
    assert u is not None, "no usage in a non-streaming answer"
    assert u.prompt_tokens > 0 and u.completion_tokens == args.max_tokens, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    assert text == streamed, f"greedy: streamed {streamed!r} != whole {text!r}"

    # ferry's `speculative` extension, sent the way OpenAI clients send extra fields.
    plain = client.chat.completions.create(
        **{**common, "extra_body": {"ignore_eos": True, "speculative": False}}
    )
    plain_text = plain.choices[0].message.content
    assert plain_text == text, f"speculative off: {plain_text!r} != {text!r}"
    try:
        client.chat.completions.create(**{**common, "extra_body": {"speculative": "yes"}})
    except BadRequestError as e:
        assert e.status_code == 400 and e.param == "speculative", (e.status_code, e.body)
    else:
        raise AssertionError('"speculative": "yes" was accepted')

    # Nothing is ignored silently: parameters ferry does not implement yet are a 400 naming
    # them when they would change the output, accepted when they would not.
    for field, value in [
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("function_call", "auto"),
    ]:
        try:
            client.chat.completions.create(**{**common, field: value})
        except BadRequestError as e:
            assert e.status_code == 400 and e.param == field, (field, e.status_code, e.body)
        else:
            raise AssertionError(f"{field}={value!r} was accepted and ignored")
    same = client.chat.completions.create(
        **{**common, "presence_penalty": 0, "logit_bias": {}, "user": "test"}
    )
    assert same.choices[0].message.content == text, "no-op values changed the output"

    # Log-probabilities: one entry per token, `top_logprobs` alternatives each (greedy: the
    # chosen token is the most likely), the tokens spelling the text; streamed alike.
    lp = client.chat.completions.create(**{**common, "logprobs": True, "top_logprobs": 2})
    content = lp.choices[0].logprobs.content
    assert len(content) == args.max_tokens, len(content)
    assert "".join(t.token for t in content) == text, [t.token for t in content]
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2, t
        assert t.top_logprobs[0].token == t.token, t
        assert bytes(t.bytes) == t.token.encode(), t
    entries = 0
    for chunk in client.chat.completions.create(
        stream=True, **{**common, "logprobs": True, "top_logprobs": 1}
    ):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                entries += len(choice.logprobs.content)
    assert entries == args.max_tokens, entries
    assert whole.choices[0].logprobs is None, "not asked: null"

    # Penalties and logit_bias change the greedy text; out of range is a 400 naming the field.
    other = client.chat.completions.create(
        **{**common, "frequency_penalty": 2.0, "presence_penalty": 2.0}
    )
    assert other.choices[0].message.content != text, "the penalties changed nothing"
    for field, value in [("presence_penalty", 2.5), ("logit_bias", {"999999": 1})]:
        try:
            client.chat.completions.create(**{**common, field: value})
        except BadRequestError as e:
            assert e.status_code == 400 and e.param == field, (field, e.status_code, e.body)
        else:
            raise AssertionError(f"{field}={value!r} was accepted")

    models = [m.id for m in client.models.list()]
    assert models == [args.model], models

    print(json.dumps({"streamed": streamed, "whole": text}))


if __name__ == "__main__":
    main()
