"""The official `openai` Python client's Responses API (`client.responses.create`) against
ferry's `/v1/responses`.

Run by tests/cluster_python.rs against a live cluster:

    python3 tests/python/openai_responses.py --base-url http://127.0.0.1:PORT/v1 --model tiny-k3

Greedy with `max_output_tokens` (and ferry's `ignore_eos` extension, so the length is fixed):
the whole response is `incomplete` for `max_output_tokens` with the counted usage, and its text
equals `/v1/chat/completions` on the same conversation (instructions as the system turn); the
stream's typed events come in the API's order with increasing sequence numbers, their deltas
add up to the same text, and the last event carries the same response; a list input with
`input_text` parts gives the same text as the string; log-probabilities (`include` +
`top_logprobs`) equal chat completions', whole and streamed; `previous_response_id` and a
built-in tool (`web_search`) are 400s naming the field (function tools: openai_tools.py). Prints {"text": ..., "events": N} as one JSON line; a failed check
raises, so the process exits non-zero.
"""

import argparse
import json

from openai import BadRequestError, OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    instructions = "Answer in the words of the King James Bible."
    question = "Who created the heaven and the earth?"
    common = dict(
        model=args.model,
        instructions=instructions,
        max_output_tokens=args.max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )

    whole = client.responses.create(input=question, **common)
    assert whole.object == "response", whole
    assert whole.id.startswith("resp"), whole.id
    assert whole.model == args.model, whole
    assert whole.status == "incomplete", whole
    assert whole.incomplete_details is not None, whole
    assert whole.incomplete_details.reason == "max_output_tokens", whole
    assert len(whole.output) == 1 and whole.output[0].type == "message", whole.output
    assert whole.output[0].role == "assistant", whole.output
    text = whole.output_text
    assert text, "the response's text is empty"
    u = whole.usage
    assert u is not None and u.output_tokens == args.max_tokens, u
    assert u.input_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens, u

    chat = client.chat.completions.create(
        model=args.model,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": question},
        ],
        max_tokens=args.max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == text, (chat.choices[0].message.content, text)
    assert chat.usage.prompt_tokens == u.input_tokens, (chat.usage, u)

    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": instructions}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]},
    ]
    listed = client.responses.create(
        input=items, **{k: v for k, v in common.items() if k != "instructions"}
    )
    assert listed.output_text == text, (listed.output_text, text)

    kinds, deltas, seq, last = [], [], [], None
    for event in client.responses.create(input=question, stream=True, **common):
        kinds.append(event.type)
        seq.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            last = event.response
    expected_head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    expected_tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert kinds[:4] == expected_head, kinds
    assert kinds[-4:] == expected_tail, kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"}, kinds
    assert len(deltas) > 1, f"expected the text in several deltas, got {deltas!r}"
    assert seq == sorted(seq) and len(set(seq)) == len(seq), seq
    assert "".join(deltas) == text, ("".join(deltas), text)
    assert last is not None and last.output_text == text, last
    assert last.usage.output_tokens == args.max_tokens, last.usage

    # Log-probabilities: the same tokens and values as chat completions' on the same
    # conversation, on the whole response and on the stream's deltas.
    lp_args = dict(include=["message.output_text.logprobs"], top_logprobs=2, **common)
    with_lp = client.responses.create(input=question, **lp_args)
    part = with_lp.output[0].content[0]
    chat_lp = client.chat.completions.create(
        model=args.model,
        messages=[
            {"role": "system", "content": instructions},
            {"role": "user", "content": question},
        ],
        max_tokens=args.max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    ).choices[0].logprobs.content
    assert len(part.logprobs) == args.max_tokens, part.logprobs
    for mine, theirs in zip(part.logprobs, chat_lp):
        assert mine.token == theirs.token, (mine, theirs)
        assert abs(mine.logprob - theirs.logprob) < 1e-6, (mine, theirs)
        assert len(mine.top_logprobs) == 2, mine
        assert [t.token for t in mine.top_logprobs] == [t.token for t in theirs.top_logprobs]
    streamed_lp = []
    for event in client.responses.create(input=question, stream=True, **lp_args):
        if event.type == "response.output_text.delta":
            streamed_lp.extend(event.logprobs)
    got = [(x.token, x.logprob) for x in streamed_lp]
    want = [(x.token, x.logprob) for x in part.logprobs]
    assert got == want, f"streamed log-probabilities {got} differ from the whole response's {want}"
    assert whole.output[0].content[0].logprobs == [], "log-probabilities only when asked"

    for field, extra in [
        ("previous_response_id", {"previous_response_id": "resp_0123"}),
        ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ]:
        try:
            client.responses.create(input=question, model=args.model, **extra)
        except BadRequestError as e:
            assert e.status_code == 400, e
            body = e.body if isinstance(e.body, dict) else {}
            param = body.get("param") or body.get("error", {}).get("param")
            assert param == field, (field, e.body)
        else:
            raise AssertionError(f"{field} was accepted")

    print(json.dumps({"text": text, "events": len(kinds)}))


if __name__ == "__main__":
    main()
