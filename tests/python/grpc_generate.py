"""A greedy `ferry.v1.Inference/Generate` call through Python stubs generated from the proto.

Run by tests/cluster_python.rs after it generated the stubs into STUBS with

    python3 -m grpc_tools.protoc -I proto --python_out=STUBS --grpc_python_out=STUBS \
        ferry/v1/inference.proto

    python3 tests/python/grpc_generate.py --stubs STUBS --addr 127.0.0.1:PORT \
        --prompt TEXT --max-tokens N

Prints the concatenated streamed text, exactly (UTF-8, no trailing newline).
"""

import argparse
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stubs", required=True)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    args = ap.parse_args()

    sys.path.insert(0, args.stubs)
    import grpc
    from ferry.v1 import inference_pb2, inference_pb2_grpc

    request = inference_pb2.GenerateRequest(
        text=args.prompt,
        sampling=inference_pb2.SamplingParams(temperature=0.0),
        stop=inference_pb2.StopConditions(max_tokens=args.max_tokens, ignore_eos=True),
    )
    pieces, last = [], None
    with grpc.insecure_channel(args.addr, options=[("grpc.enable_http_proxy", 0)]) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for msg in stub.Generate(request, timeout=60):
            pieces.append(msg.text)
            last = msg
    assert last is not None, "an empty stream"
    assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH, last
    assert last.usage.completion_tokens == args.max_tokens, last.usage
    sys.stdout.buffer.write("".join(pieces).encode("utf-8"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
