"""The official `openai` Python client against a ferry router started with API keys.

Run by tests/cluster_python.rs against a live cluster:

    python3 tests/python/openai_auth.py --base-url http://127.0.0.1:PORT/v1 --model tiny-k3 \
        --api-key RIGHT --wrong-key WRONG

With the right `api_key=` a completion and the model list succeed; with a wrong key the client raises `AuthenticationError` (HTTP 401) whose body is OpenAI-shaped with
code `invalid_api_key`. Prints {"text": ..., "status": 401, "code": ...} as one JSON line; any
failed check raises, so the process exits non-zero.
"""

import argparse
import json

from openai import AuthenticationError, OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--wrong-key", required=True)
    args = ap.parse_args()

    def client(key: str) -> OpenAI:
        return OpenAI(base_url=args.base_url, api_key=key, max_retries=0, timeout=60)

    good = client(args.api_key)
    done = good.completions.create(model=args.model, prompt="hello", max_tokens=4, temperature=0)
    text = done.choices[0].text
    assert done.usage.completion_tokens >= 1, done
    models = [m.id for m in good.models.list()]
    assert models == [args.model], models

    failures = []
    for key in [args.wrong_key]:
        try:
            client(key).completions.create(model=args.model, prompt="hello", max_tokens=4)
        except AuthenticationError as e:
            assert e.status_code == 401, e
            assert e.body["code"] == "invalid_api_key", e.body
            assert e.body["type"] == "authentication_error", e.body
            assert args.wrong_key not in e.message, e.message
            failures.append(e)
        else:
            raise AssertionError(f"key {key!r} was accepted")
    print(json.dumps({"text": text, "status": failures[0].status_code, "code": failures[0].body["code"]}))


if __name__ == "__main__":
    main()
