"""Tools through the official `openai` Python client against ferry's HTTP gateway.

Run by tests/cluster_python.rs against a live cluster:

    python3 tests/python/openai_tools.py --base-url http://127.0.0.1:PORT/v1 --model tiny-k3

- `tool_choice: "required"` (sampled, several seeds): the reply has `content: null`, one
  `tool_calls` entry of a listed function whose `arguments` parse and validate against that
  function's `parameters` (`jsonschema`), and `finish_reason: "tool_calls"`; streamed, the call
  arrives in `delta.tool_calls` and equals the whole reply's.
- `auto`: prose comes back as `content`, whole and streamed alike.
- A named `tool_choice` calls that function.
- The call goes back into the conversation (an assistant turn with `tool_calls`, then a `tool`
  turn with its result) and the next request is served.
- `tool_choice` naming a function not in `tools` is a 400 naming `tool_choice`; a malformed
  tool is a 400 naming `tools`.
- The Responses API (`client.responses.create`) with the same functions in its shape:
  `tool_choice: "required"` (sampled, several seeds) returns one `function_call` output item
  whose arguments validate against the schema; streamed, the events come in order
  (`output_item.added`, `function_call_arguments.delta` / `.done`, `output_item.done`,
  `response.completed`) with increasing sequence numbers and carry the whole reply's call; a
  named choice calls that function; the call and a `function_call_output` go back as input
  and the next response is served; a built-in tool type is a 400 naming `tools[0].type`.

Prints {"calls": N, "named": ..., "responses_calls": M} as one JSON line; a failed check
raises.
"""

import argparse
import json

import jsonschema
from openai import BadRequestError, OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "count_sheep",
            "description": "Counts a shepherd's flock.",
            "parameters": {
                "type": "object",
                "properties": {
                    "shepherd": {"type": "string", "maxLength": 10},
                    "field": {"enum": ["north", "south"]},
                },
                "required": ["shepherd", "field"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "weigh_gold",
            "parameters": {
                "type": "object",
                "properties": {"talents": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["talents"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(call) -> dict:
    assert call.type == "function", call
    assert call.id.startswith("call_"), call.id
    name = call.function.name
    assert name in SCHEMAS, name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "How many sheep hath Jacob?"}]
    common = dict(model=args.model, messages=messages, tools=TOOLS, max_tokens=120)

    calls = 0
    for seed in range(8):
        r = client.chat.completions.create(
            tool_choice="required", temperature=1.0, seed=seed, **common
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.content is None, choice.message
        assert len(choice.message.tool_calls) == 1, choice.message
        check_call(choice.message.tool_calls[0])
        calls += 1

    # Streamed: the same call (greedy), in delta.tool_calls, finish reason tool_calls.
    greedy = dict(tool_choice="required", temperature=0, **common)
    whole = client.chat.completions.create(**greedy).choices[0].message.tool_calls[0]
    deltas, finish, content = [], None, ""
    for chunk in client.chat.completions.create(stream=True, **greedy):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        deltas.extend(c.delta.tool_calls or [])
        content += c.delta.content or ""
        finish = c.finish_reason or finish
    assert finish == "tool_calls", finish
    assert content == "", content
    assert len(deltas) == 1 and deltas[0].index == 0, deltas
    assert deltas[0].function.name == whole.function.name, (deltas, whole)
    assert deltas[0].function.arguments == whole.function.arguments, (deltas, whole)

    # auto (the default with tools): this model answers in prose, which comes back as content,
    # whole and streamed alike (the held-back start is released once it cannot be a call).
    auto = dict(temperature=0, **{**common, "max_tokens": 12})
    prose = client.chat.completions.create(**auto).choices[0]
    assert prose.message.tool_calls is None, prose
    assert prose.finish_reason in ("stop", "length"), prose
    assert prose.message.content, prose
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **auto)
        if c.choices
    )
    assert streamed == prose.message.content, (streamed, prose.message.content)

    # A named choice calls that function.
    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "weigh_gold"}},
        temperature=1.0,
        seed=3,
        **common,
    ).choices[0].message.tool_calls[0]
    assert named.function.name == "weigh_gold", named
    named_args = check_call(named)

    # The call and its result go back into the conversation.
    follow = client.chat.completions.create(
        model=args.model,
        max_tokens=8,
        tools=TOOLS,
        messages=messages
        + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": named.id,
                        "type": "function",
                        "function": {"name": "weigh_gold", "arguments": named.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": named.id, "content": "Seven talents."},
        ],
        tool_choice="none",
    )
    assert follow.choices[0].message.content is not None, follow
    assert follow.choices[0].message.tool_calls is None, follow

    # 400s naming the field.
    for field, extra in [
        ("tool_choice", {"tools": TOOLS,
                         "tool_choice": {"type": "function", "function": {"name": "smite"}}}),
        ("tools", {"tools": [{"type": "function", "function": {"name": "has space"}}]}),
        ("tool_choice", {"tool_choice": "required"}),
    ]:
        try:
            client.chat.completions.create(model=args.model, messages=messages, **extra)
        except BadRequestError as e:
            assert e.status_code == 400 and e.param == field, (field, e.status_code, e.body)
        else:
            raise AssertionError(f"{extra} was accepted")

    responses_calls = check_responses(client, args.model)
    print(json.dumps({"calls": calls, "named": named_args, "responses_calls": responses_calls}))


def check_responses(client: OpenAI, model: str) -> int:
    """Function tools on `/v1/responses`; returns the sampled required calls checked."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    question = "How many sheep hath Jacob?"
    common = dict(model=model, input=question, tools=tools, max_output_tokens=120)

    calls = 0
    for seed in range(4):
        r = client.responses.create(
            tool_choice="required", temperature=1.0, extra_body={"seed": seed}, **common
        )
        assert r.status == "completed", (seed, r)
        assert len(r.output) == 1, r.output
        item = r.output[0]
        assert item.type == "function_call" and item.status == "completed", item
        assert item.id.startswith("fc_") and item.call_id.startswith("call_"), item
        assert item.name in SCHEMAS, item
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
        calls += 1

    # Streamed (greedy): the call's events in order, equal to the whole reply's call.
    greedy = dict(tool_choice="required", temperature=0, **common)
    whole = client.responses.create(**greedy).output[0]
    events = list(client.responses.create(stream=True, **greedy))
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ], kinds
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(events))), seq
    added, delta, done, item_done, completed = events[2:]
    assert added.item.type == "function_call" and added.item.status == "in_progress", added
    assert added.item.name == whole.name, (added, whole)
    assert delta.item_id == added.item.id and delta.output_index == 0, delta
    assert delta.delta == whole.arguments, (delta, whole)
    assert done.arguments == whole.arguments, (done, whole)
    assert item_done.item.arguments == whole.arguments and item_done.item.status == "completed"
    assert completed.response.output[0].call_id == item_done.item.call_id, completed

    # A named choice calls that function.
    named = client.responses.create(
        tool_choice={"type": "function", "name": "weigh_gold"},
        temperature=1.0,
        extra_body={"seed": 3},
        **common,
    ).output[0]
    assert named.type == "function_call" and named.name == "weigh_gold", named
    jsonschema.validate(json.loads(named.arguments), SCHEMAS["weigh_gold"])

    # The call (as the previous response returned it) and its output go back as input.
    follow = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": question},
            named.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": named.call_id, "output": "Seven."},
        ],
        tools=tools,
        tool_choice="none",
        max_output_tokens=8,
    )
    assert follow.output[0].type == "message", follow.output
    assert follow.output_text, follow

    try:
        client.responses.create(model=model, input=question, tools=[{"type": "web_search"}])
    except BadRequestError as e:
        assert e.status_code == 400 and e.param == "tools[0].type", (e.status_code, e.body)
    else:
        raise AssertionError("a web_search tool was accepted")
    return calls


if __name__ == "__main__":
    main()
