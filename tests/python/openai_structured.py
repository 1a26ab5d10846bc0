"""Structured output through the official `openai` Python client against ferry's HTTP gateway.

Run by tests/cluster_python.rs against a live cluster:

    python3 tests/python/openai_structured.py --base-url http://127.0.0.1:PORT/v1 --model tiny-k3

- `response_format: json_schema`: 20 chat completions sampled at temperature 1 each parse and
  validate against the schema (the `jsonschema` package) and finish with "stop"; greedy, the
  streamed deltas add up to the whole response's JSON; `/v1/completions` and `/v1/responses`
  (`text.format`) constrain their output the same way.
- `response_format: json_object`: the output parses as a JSON object (with a `logit_bias` that
  keeps the tiny model brief, which the grammar overrides where it must).
- An invalid schema is a 400 whose `param` names `response_format.json_schema.schema`.

Prints {"schema_ok": N, "object": ...} as one JSON line; a failed check raises, so the process
exits non-zero.
"""

import argparse
import json
import urllib.request

import jsonschema
from openai import BadRequestError, OpenAI

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tribe": {"enum": ["Judah", "Levi", "Dan", "Benjamin"]},
        "sons": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "tribe", "sons"],
    "additionalProperties": False,
}


def token_id(base_url: str, model: str, text: str) -> int:
    """The one token id of `text`, from ferry's `/tokenize` (vLLM's extension)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    body = json.dumps({"model": model, "prompt": text, "add_special_tokens": False}).encode()
    req = urllib.request.Request(root + "/tokenize", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        tokens = json.load(r)["tokens"]
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Who begat whom? Answer in JSON."}]
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }

    # 20 sampled requests at T = 1: every one is valid JSON under the schema.
    outputs = set()
    for seed in range(20):
        r = client.chat.completions.create(
            model=args.model,
            messages=messages,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
            response_format=fmt,
        )
        choice = r.choices[0]
        text = choice.message.content
        assert choice.finish_reason == "stop", (seed, choice.finish_reason, text)
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        outputs.add(text)
    assert len(outputs) > 1, f"T=1 gave one output for 20 seeds: {outputs}"

    # Greedy, streamed: the deltas add up to the whole response.
    greedy = dict(model=args.model, messages=messages, temperature=0, max_tokens=200,
                  response_format=fmt)
    whole = client.chat.completions.create(**greedy).choices[0].message.content
    jsonschema.validate(json.loads(whole), SCHEMA)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **greedy)
        if c.choices
    )
    assert streamed == whole, (streamed, whole)

    # /v1/completions takes response_format too (as vLLM does).
    c = client.completions.create(
        model=args.model,
        prompt="And the sons of Jacob were",
        max_tokens=200,
        temperature=1.0,
        seed=7,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)

    # /v1/responses: text.format.
    resp = client.responses.create(
        model=args.model,
        input="Who begat whom?",
        max_output_tokens=200,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                         "strict": True}},
    )
    assert resp.status == "completed", resp
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert resp.text.format.type == "json_schema", resp.text

    # json_object: any JSON object. The tiny model, trained on the King James Bible, would
    # write verses into a key forever; `logit_bias` (`"` +100, `}` +50) keeps it brief, and
    # the grammar still decides what may come: the output starts with `{` although `"` and
    # `}` outweigh every other token, and it is a JSON object.
    bias = {str(token_id(args.base_url, args.model, '"')): 100,
            str(token_id(args.base_url, args.model, "}")): 50}
    obj = client.chat.completions.create(
        model=args.model,
        messages=messages,
        temperature=0,
        max_tokens=300,
        logit_bias=bias,
        response_format={"type": "json_object"},
    ).choices[0]
    assert obj.finish_reason == "stop", obj
    assert obj.message.content.startswith("{"), obj.message.content
    parsed = json.loads(obj.message.content)
    assert isinstance(parsed, dict), parsed

    # An invalid schema is a 400 naming the field.
    bad = {"type": "json_schema",
           "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": 5,
                                                      "maximum": 1}}}
    try:
        client.chat.completions.create(model=args.model, messages=messages, response_format=bad)
    except BadRequestError as e:
        assert e.status_code == 400, e
        assert e.param == "response_format.json_schema.schema", e.body
    else:
        raise AssertionError("an unsatisfiable schema was accepted")

    print(json.dumps({"schema_ok": len(outputs), "object": parsed}))


if __name__ == "__main__":
    main()
