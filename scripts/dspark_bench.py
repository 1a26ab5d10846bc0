#!/usr/bin/env python3
"""Issue 15's benchmark: plain vs DSpark speculative decoding through the real cluster.

For each arm (`plain`: `ferry up` without a drafter, `--speculative off`; `spec`: the same with
`--drafter DIR --speculative on`) this starts `ferry up --device DEVICE --model TARGET`, waits
until it answers, warms it up, then drives the router's OpenAI endpoint (`/v1/completions`,
streamed, token-id prompts from the held-out prompts file, `ignore_eos`) at every concurrency
level and temperature, closed loop (each of `c` clients sends its next request when the last one
ended), and stops the cluster (SIGTERM, then SIGKILL of its process group after a grace period)
before the next arm. Standard library only (the GPU machine has no network).

Per arm, temperature and concurrency it records: requests (ok / failed), output tokens, wall,
aggregate tok/s (output tokens / wall of the level), per-stream tok/s (mean over requests of
(tokens - 1) / (last chunk - first chunk): the decode rate a client sees after its first token),
TTFT p50/p99, ITL p50/p99 (gaps between streamed chunks, as `ferry bench` measures them; a
speculative round's tokens of one sequence arrive as one chunk since session 52, a burst of
near-zero gaps before it, so ITL is a gap between rounds there), TPOT (mean time per output token
after the first), tokens per chunk, prompt tokens served from the cache, and from the decode
worker's Prometheus counters (deltas over the level): speculative rounds, drafts verified,
drafts accepted, tau = (accepted + rounds) / rounds, drafts verified per round, the remote /
local prefill split, and where the engine's time went (steps and mean ms of plain decode steps,
speculative round steps and steps with prompt work, each split into the drafter pass, the
forward's launch, sampling / verification and the commit). Speed-ups spec / plain per level, the peak-aggregate ratio per temperature,
and the greedy identity (same text plain and spec per prompt) close the report.

Results: OUT/dspark_bench.json (rewritten after every level, so a killed run leaves what it had)
and OUT/dspark_bench.md. Run by scripts/dspark_bench.sh (which documents the environment).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import http.client
import json
import multiprocessing as mp
import os
import queue
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

T0 = time.monotonic()
CURRENT: list = []  # the cluster running now, for the signal handler


def on_signal(signum, _frame):
    """SIGTERM / SIGINT (the hook's `timeout`): take the running cluster down first, so that the
    requests in flight fail at once and no `ferry up` outlives the benchmark, then unwind."""
    for cl in CURRENT:
        cl.kill_now()
    raise SystemExit(128 + signum)


def log(msg: str) -> None:
    print(f"dspark-bench [{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def pct(v: list[float], p: float) -> float | None:
    """Nearest-rank percentile (ferry bench's)."""
    if not v:
        return None
    s = sorted(v)
    k = int(-(-p / 100.0 * len(s) // 1))  # ceil
    return s[min(max(k, 1), len(s)) - 1]


def mean(v: list[float]) -> float | None:
    return sum(v) / len(v) if v else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- prompts


class Prompts:
    """Held-out prompts (scripts/heldout_prompts.py: JSON lines with `ids`), handed out in
    order; the k-th use of a row drops its first k tokens so that no two requests of one arm
    share a prefix (ferry caches prefixes; a reused prompt would be a cache hit). Both arms get
    the same sequence of prompts."""

    def __init__(self, path: str, tokens: int, bos: int | None):
        self.rows = []
        with open(path) as fh:
            for line in fh:
                if line.strip():
                    self.rows.append(json.loads(line)["ids"])
        if not self.rows:
            raise SystemExit(f"dspark-bench: no prompts in {path}")
        self.tokens = min(tokens, min(len(r) for r in self.rows))
        self.bos = bos
        self.next = 0

    def reset(self) -> None:
        self.next = 0

    def take(self) -> tuple[int, list[int]]:
        k = self.next
        self.next += 1
        return k, self.ids_for(k)

    def ids_for(self, k: int) -> list[int]:
        """The prompt of serial `k` (what `take` gives the k-th time after a reset): row
        k mod rows. A serial past the last row reuses a prompt, which the cluster then serves
        from its prefix cache (the level's `reused_prompts` and `prompt_cached_share` say how
        much): the lease asks for as many prompts as a run's requests (PROMPT_COUNT)."""
        row = self.rows[k % len(self.rows)]
        return ([self.bos] if self.bos is not None else []) + row[: self.tokens]

    def reused(self, serials: list[int]) -> int:
        """How many of `serials` reuse a prompt (past the last row)."""
        return sum(1 for k in serials if k >= len(self.rows))


# ---------------------------------------------------------------- the cluster


# Arms with the drafter: `spec` verifies as `--verify-len` says (`goodput` by default: the
# confidence head against the engine's measured costs); `spec_fixed` is the same cluster with a fixed verify length
# (`--fixed-verify-len`), the comparison issue 15's item 3 asks for. It runs only at
# `--fixed-concurrency`, greedy, on half an arm's share of the budget. `spec_env` is the `spec`
# arm's cluster with `--env-arm`'s variables set (a switch read from the environment, e.g.
# `FERRY_GOODPUT_PROMPTS=1`), at the same levels and share as `spec_fixed`: a switch measured
# against its default in the same run, on the same trained pair.
SPEC_ARMS = ("spec", "spec_fixed", "spec_env")
# The arms that run greedy only, at `--fixed-concurrency`, on half a full arm's share.
SIDE_ARMS = ("spec_fixed", "spec_env")


def env_assignments(text: str) -> dict[str, str]:
    """`VAR=value VAR2=value2` as a dict (what `--env-arm` sets for the `spec_env` arm)."""
    out = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"dspark-bench: --env-arm wants VAR=value items, got {item!r}")
        out[name] = value
    return out


class Cluster:
    def __init__(self, args, arm: str, logdir: Path):
        self.args, self.arm = args, arm
        self.http_port, self.grpc_port = free_port(), free_port()
        while self.grpc_port == self.http_port:
            self.grpc_port = free_port()
        self.log_path = logdir / f"ferry_up_{arm}.log"
        self.proc: subprocess.Popen | None = None
        self.metrics: dict[str, str] = {}
        self.model_name = ""

    def argv(self) -> list[str]:
        a = self.args
        argv = [a.ferry, "up", "--device", a.device, "--model", a.target,
                "--http-addr", f"127.0.0.1:{self.http_port}", "--grpc-addr", f"127.0.0.1:{self.grpc_port}",
                "--prefill-workers", str(a.prefill_workers), "--decode-workers", "1",
                "--max-running", str(a.max_running), "--kv-blocks", str(a.kv_blocks),
                "--ready-timeout-s", str(int(a.ready_seconds))]
        if a.device != "cpu":
            argv += ["--gpu-mode", a.gpu_mode]
        if self.arm in SPEC_ARMS:
            verify_len = a.fixed_verify_len if self.arm == "spec_fixed" else a.verify_len
            argv += ["--drafter", a.drafter, "--speculative", "on", "--verify-len", verify_len,
                     "--max-verify-tokens", str(a.max_verify_tokens)]
        else:
            argv += ["--speculative", "off"]
        argv += a.up_args.split()
        return argv

    def start(self) -> None:
        argv = self.argv()
        log(f"{self.arm}: {' '.join(argv)}")
        self.logf = open(self.log_path, "w")
        env = dict(os.environ)
        if self.arm == "spec_env":
            env.update(env_assignments(self.args.env_arm))
            log(f"{self.arm}: environment {self.args.env_arm}")
        self.proc = subprocess.Popen(argv, stdout=self.logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env)

    def log_text(self) -> str:
        try:
            return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        lines = [l for l in self.log_text().splitlines() if l.strip()]
        return "\n".join(lines[-n:])

    def wait_up(self, deadline: float) -> None:
        """Until `ferry up` printed that it is up and a first completion came back."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferry up exited with {self.proc.returncode}")
            text = self.log_text()
            if "ferry is up" in text:
                for name, addr in re.findall(r"^\s+(\S+)\s+http://(\S+)/metrics\s*$", text, re.M):
                    self.metrics[name] = f"http://{addr}/metrics"
                break
            if time.monotonic() > deadline:
                raise RuntimeError("ferry up did not say it is up in time")
            time.sleep(0.5)
        while True:
            try:
                body = json.loads(http_get(f"http://127.0.0.1:{self.http_port}/v1/models", 10))
                self.model_name = body["data"][0]["id"]
                r = one_request("127.0.0.1", self.http_port,
                                {"prompt": "def main():", "max_tokens": 4, "temperature": 0}, 60)
                if r["error"] is None:
                    return
                err = r["error"]
            except Exception as e:  # noqa: BLE001 — retried until the deadline
                err = repr(e)
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferry up exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no completion from the cluster in time: {err}")
            time.sleep(1.0)

    def kill_now(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=self.args.stop_seconds)
            except subprocess.TimeoutExpired:
                log(f"{self.arm}: ferry up did not stop in {self.args.stop_seconds}s: killing its group")
            except ProcessLookupError:
                pass
        # Children of ferry up that outlived it (they stop when their stdin closes; belt and braces).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.logf.close()
        return self.proc.returncode

    def scrape(self) -> dict[str, float]:
        """The decode worker's counters (summed over label sets of one name), and the prefill
        workers' engine step counters summed over them under `prefill/`-prefixed names."""
        out: dict[str, float] = {}
        decode = next((u for n, u in self.metrics.items() if n.startswith("decode")), None)
        if decode is not None:
            parse_metrics(decode, "", out)
        for name, url in self.metrics.items():
            if name.startswith("prefill"):
                parse_metrics(url, "prefill/", out, only="ferry_engine_step")
        out["prefill/workers"] = float(sum(1 for n in self.metrics if n.startswith("prefill")))
        return out


def parse_metrics(url: str, prefix: str, out: dict[str, float], only: str = "") -> None:
    """Adds one process's counters to `out` (summed over label sets of one name; the
    `mode` of ferry_prefills_total and the `kind` / `phase` of the engine step series kept in
    the key), names starting with `only`, under `prefix`."""
    try:
        text = http_get(url, 10)
    except Exception:  # noqa: BLE001
        return
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m or not m.group(1).startswith(only):
            continue
        name = m.group(1)
        if m.group(2) and name == "ferry_prefills_total":
            mode = re.search(r'mode="([^"]*)"', m.group(2))
            name = f"{name}:{mode.group(1) if mode else '?'}"
        elif m.group(2) and name.startswith("ferry_engine_step"):
            for label in ("kind", "phase"):
                v = re.search(label + r'="([^"]*)"', m.group(2))
                if v:
                    name = f"{name}:{v.group(1)}"
        try:
            out[prefix + name] = out.get(prefix + name, 0.0) + float(m.group(3))
        except ValueError:
            pass


def http_get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


# ---------------------------------------------------------------- one request


def one_request(host: str, port: int, body: dict, timeout: float) -> dict:
    """One streamed completion: TTFT, chunk times, the usage's token counts, the text."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    payload = json.dumps(body).encode()
    res = {"ttft": None, "times": [], "tokens": 0, "cached": 0, "text": "", "finish": None,
           "error": None, "e2e": None}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    res["start"] = t0
    try:
        conn.request("POST", "/v1/completions", body=payload,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            res["error"] = f"HTTP {resp.status}: {resp.read()[:300].decode(errors='replace')}"
            return res
        parts = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            msg = json.loads(data)
            if "error" in msg and "choices" not in msg:
                res["error"] = json.dumps(msg["error"])[:300]
                break
            for ch in msg.get("choices") or []:
                if ch.get("text"):
                    if res["ttft"] is None:
                        res["ttft"] = now - t0
                    res["times"].append(now - t0)
                    parts.append(ch["text"])
                if ch.get("finish_reason"):
                    res["finish"] = ch["finish_reason"]
            u = msg.get("usage")
            if u:
                res["tokens"] = u.get("completion_tokens", 0)
                res["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        res["text"] = "".join(parts)
        res["e2e"] = time.perf_counter() - t0
        if res["ttft"] is None and res["error"] is None:
            res["error"] = "the stream ended without text"
    except Exception as e:  # noqa: BLE001 — recorded per request
        res["error"] = repr(e)[:300]
    finally:
        conn.close()
    return res


# ---------------------------------------------------------------- the load generator


def default_client_procs() -> int:
    """Load-generator processes: one Python process parses ~40-50k streamed chunks a second
    (the GIL; BENCHMARKS.md, session 52), below what the cluster serves at c >= 64 on a GPU."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def client_proc(port: int, timeout: float, deadline: float, threads: int, jobs, results,
                ready, go) -> None:
    """One load-generator process: `threads` closed-loop clients, each taking the next job
    (index, body) from the shared queue when its last request ended, until a None."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    def client() -> None:
        go.wait()
        while True:
            job = jobs.get()
            if job is None:
                return
            i, body = job
            # Past the deadline a job is skipped (None), not sent.
            r = None if time.monotonic() > deadline else one_request("127.0.0.1", port, body, timeout)
            results.put((i, r))

    ts = [threading.Thread(target=client, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    ready.release()
    for t in ts:
        t.join()


def drive(port: int, bodies: list[dict], c: int, procs: int, timeout: float,
          deadline: float) -> tuple[list, float, float]:
    """A closed loop of `c` clients spread over `procs` processes (forked), all taking jobs from
    one queue: the results in job order (None: skipped at the deadline, or lost with a client
    process that died), the start (perf_counter; CLOCK_MONOTONIC, the same clock in every
    process) and the wall. The processes start before the clock does and the clients wait until
    all are up."""
    procs = max(1, min(procs, c))
    ctx = mp.get_context("fork")
    jobs, results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Semaphore(0), ctx.Event()
    workers = [ctx.Process(target=client_proc, daemon=True,
                           args=(port, timeout, deadline, c // procs + (p < c % procs), jobs,
                                 results, ready, go))
               for p in range(procs)]
    for w in workers:
        w.start()
    # Queued after the forks: a queue's first put starts its feeder thread, and a process should
    # not fork while it has threads.
    for job in enumerate(bodies):
        jobs.put(job)
    for _ in range(c):
        jobs.put(None)
    for _ in workers:
        ready.acquire()
    t0 = time.perf_counter()
    go.set()
    out: list = [None] * len(bodies)
    try:
        left = len(bodies)
        while left:
            try:
                i, r = results.get(timeout=1)
            except queue.Empty:
                # A client process that died takes its requests with it: they stay None.
                if not any(w.is_alive() for w in workers):
                    break
                continue
            out[i] = r
            left -= 1
    finally:
        wall = time.perf_counter() - t0
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.kill()
    return out, t0, wall


def standin_stream(out_tokens: int) -> bytes:
    """What ferry's router sends for one plainly decoded, streamed completion of `out_tokens`
    tokens: one SSE chunk per token (a step's) shaped like its `text_completion` chunks, the usage
    chunk, `[DONE]`. The most chunks a request can bring, so the client's worst case."""
    head = '{"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1765000000,"model":"target","choices":['
    tok = 'data: ' + head + '{"index":0,"text":" tok","logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    last = 'data: ' + head + '{"index":0,"text":" tok","logprobs":null,"finish_reason":"length"}],"usage":null}\n\n'
    usage = ('data: ' + head + '],"usage":{"prompt_tokens":1025,"completion_tokens":%d,"total_tokens":%d}}\n\n'
             % (out_tokens, out_tokens + 1025))
    return (tok * (out_tokens - 1) + last + usage + "data: [DONE]\n\n").encode()


def standin_server(port: int, out_tokens: int, step_s: float, ready) -> None:
    """A stand-in for the router with no model behind it: each POST gets its stream one chunk
    per `step_s` tick, every stream's chunk written apart, as a decode step's tokens reach the
    router's streams. Several of these share the port (SO_REUSEPORT), so that they offer more
    than the load generator can take."""
    import asyncio

    lines = standin_stream(out_tokens).split(b"\n\n")
    chunk, tail = lines[0] + b"\n\n", b"\n\n".join(lines[out_tokens - 1:])

    async def main() -> None:
        active: list = []  # [writer, chunks left, done]

        async def handle(reader, writer) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(n)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Connection: close\r\n\r\n")
            done = asyncio.get_running_loop().create_future()
            active.append([writer, out_tokens - 1, done])
            await done
            writer.write(tail)
            await writer.drain()
            writer.close()

        async def ticker() -> None:
            while True:
                await asyncio.sleep(step_s)
                for a in active:
                    a[0].write(chunk)
                    a[1] -= 1
                    if a[1] == 0:
                        a[2].set_result(None)
                active[:] = [a for a in active if a[1] > 0]

        srv = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096, reuse_port=True)
        asyncio.get_running_loop().create_task(ticker())
        ready.release()
        await srv.serve_forever()

    asyncio.run(main())


def client_ceiling(c: int, n: int, out_tokens: int, procs: list[int], step_s: float = 1e-3) -> dict:
    """The load generator's own ceiling: `n` streamed requests of `out_tokens` chunks at `c`
    clients against stand-in servers that offer each stream a chunk every `step_s` (256k tok/s
    at c = 256, more than ferry serves), once per process count in `procs`: tok/s each. A level
    whose aggregate nears it measured the client, not ferry."""
    ctx = mp.get_context("fork")
    port, ready, servers = free_port(), ctx.Semaphore(0), max(procs)
    srvs = [ctx.Process(target=standin_server, args=(port, out_tokens, step_s, ready), daemon=True)
            for _ in range(servers)]
    for p in srvs:
        p.start()
    try:
        if not all(ready.acquire(timeout=10) for _ in srvs):
            return {"error": "the stand-in server did not start"}
        res = {"concurrency": c, "requests": n, "output_tokens": out_tokens, "step_ms": step_s * 1e3,
               "standin_processes": servers, "offered_tok_s": round(c / step_s), "tok_s": {}}
        body = {"prompt": [1] * 1025, "max_tokens": out_tokens}
        for p in procs:
            got, _, wall = drive(port, [body] * n, c, p, 60, time.monotonic() + 600)
            ok = [r for r in got if r is not None and r["error"] is None]
            res["tok_s"][str(min(p, c))] = round(sum(r["tokens"] for r in ok) / wall, 1) if wall > 0 else None
            if len(ok) < n:
                res.setdefault("errors", []).extend(r["error"] for r in got if r and r["error"])
        return res
    finally:
        for p in srvs:
            p.kill()
            p.join(5)


# ---------------------------------------------------------------- one level


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cluster_cpu_s(pgid: int | None) -> dict[str, float]:
    """CPU seconds used so far by each process of the cluster (`ferry up`'s process group), summed
    by role: `router`, `decode`, `prefill` (the subcommand in its argv) or `up` (the supervisor).
    Empty where /proc is not readable. A process that exits mid-level takes its seconds along."""
    out: dict[str, float] = {}
    if pgid is None:
        return out
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # Fields after the parenthesised command name (which may hold spaces): state, ppid,
        # pgrp, ..., utime and stime are the 12th and 13th.
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) < 13 or int(rest[2]) != pgid:
            continue
        role = argv[1].decode(errors="replace") if len(argv) > 1 else "?"
        role = role if role in ("router", "decode", "prefill") else "up"
        out[role] = out.get(role, 0.0) + (int(rest[11]) + int(rest[12])) / CLK_TCK
    return out


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, over all cores (/proc/stat's first
    line; idle and iowait count as not busy). (0, 0) where it is not readable."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0
    return (sum(f) - f[3] - f[4]) / CLK_TCK, sum(f) / CLK_TCK


def children_cpu_s() -> float:
    """CPU seconds of this process's reaped children: the load generator's client processes once
    `drive` joined them (`ferry up`, still running, is not reaped until its arm ends)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_level(cl: Cluster, prompts: Prompts, c: int, n: int, temp: float, out_tokens: int,
              deadline: float, args, texts: dict, serials: list[int] | None = None) -> dict:
    """One closed-loop level: n requests by c clients (the next prompts, or the prompts of
    `serials` when given)."""
    jobs = []
    for i in range(n):
        if serials is not None:
            k = serials[i]
            ids = prompts.ids_for(k)
        else:
            k, ids = prompts.take()
        body = {"model": cl.model_name, "prompt": ids, "max_tokens": out_tokens,
                "temperature": temp, "ignore_eos": True}
        if temp > 0:
            # Seeded for run-to-run repeatable plain texts; a seeded sampled request decodes
            # plainly unless it asks to speculate (docs/spec_decode.md), so it asks. On the plain
            # arm (no drafter) that is plain decoding.
            body["seed"] = 1000 + k
            body["speculative"] = True
        jobs.append((k, body))
    before = cl.scrape()
    pgid = cl.proc.pid if cl.proc is not None else None
    cpu0, mach0, kids0 = cluster_cpu_s(pgid), machine_cpu_s(), children_cpu_s()
    got, t0, wall = drive(cl.http_port, [body for _, body in jobs], c, args.client_procs,
                          args.request_seconds, deadline)
    results = [(k, r) for (k, _), r in zip(jobs, got)]
    skipped = sum(1 for r in got if r is None)
    cpu1, mach1, kids1 = cluster_cpu_s(pgid), machine_cpu_s(), children_cpu_s()
    after = cl.scrape()
    ok = [(k, r) for k, r in results if r is not None and r["error"] is None]
    failed = [r["error"] for _, r in results if r is not None and r["error"] is not None]
    ttft = [r["ttft"] * 1e3 for _, r in ok]
    itl = [(b - a) * 1e3 for _, r in ok for a, b in zip(r["times"], r["times"][1:])]
    streams, tpot = [], []
    for _, r in ok:
        span = r["times"][-1] - r["times"][0]
        if r["tokens"] > 1 and span > 0:
            streams.append((r["tokens"] - 1) / span)
            tpot.append(span / (r["tokens"] - 1) * 1e3)
    tokens = sum(r["tokens"] for _, r in ok)
    chunks = sum(len(r["times"]) for _, r in ok)
    # The steady rate: tokens until the last request started (until then all c were in flight;
    # after it the level drains, and speculative requests, ending at different times, drain
    # longer), each request's tokens spread over its chunks. None for a single wave.
    last_start = max((r["start"] for _, r in ok), default=t0)
    steady_tokens = sum(r["tokens"] * sum(1 for x in r["times"] if r["start"] + x <= last_start)
                        / len(r["times"]) for _, r in ok if r["times"])
    steady_s = last_start - t0
    if temp == 0:
        for k, r in ok:
            texts[k] = hashlib.sha256(r["text"].encode()).hexdigest()[:16]
    d = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in set(after) | set(before)}
    rounds = d.get("ferry_spec_decode_num_drafts_total", 0.0)
    drafted = d.get("ferry_spec_decode_num_draft_tokens_total", 0.0)
    accepted = d.get("ferry_spec_decode_num_accepted_tokens_total", 0.0)
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    cached = sum(r["cached"] for _, r in ok)
    level = {
        "concurrency": c, "requests": n, "ok": len(ok), "failed": len(failed),
        "skipped_deadline": skipped, "errors": failed[:3],
        "output_tokens": tokens, "wall_s": r3(wall),
        "aggregate_tok_s": r3(tokens / wall if wall > 0 else None),
        "steady_tok_s": r3(steady_tokens / steady_s if n > c and steady_s > 0 else None),
        "per_stream_tok_s": r3(mean(streams)), "per_stream_tok_s_p50": r3(pct(streams, 50)),
        "ttft_ms_p50": r3(pct(ttft, 50)), "ttft_ms_p99": r3(pct(ttft, 99)),
        "itl_ms_p50": r3(pct(itl, 50)), "itl_ms_p99": r3(pct(itl, 99)),
        "tpot_ms_mean": r3(mean(tpot)),
        # Where a client's time went: the share of c × wall spent inside requests (near 1: the
        # clients kept c in flight; below it, the load generator was the limit), and the mean time
        # from a request's last token chunk to the end of its stream (usage chunk, [DONE]).
        "in_request_share": r3(sum(r["e2e"] for _, r in ok) / (c * wall) if wall > 0 else None),
        "tail_ms_mean": r3(mean([(r["e2e"] - r["times"][-1]) * 1e3 for _, r in ok if r["times"]])),
        "tokens_per_chunk": r3(tokens / chunks if chunks else None),
        "short_outputs": sum(1 for _, r in ok if r["tokens"] < out_tokens),
        "cached_prompt_tokens": cached,
        # The share of the level's prompt tokens served from the prefix cache: near 0 the level
        # prefilled its prompts, as the reference shape asks; near 1 it measured decoding alone
        # (before session 54 the lease's 256 prompts were reused and the warm-up cached them all).
        "prompt_cached_share": r3(cached / (len(ok) * prompts.tokens)
                                  if ok and prompts.tokens else None),
        "reused_prompts": prompts.reused([k for k, _ in jobs]),
        "spec_rounds": int(rounds), "spec_drafted_tokens": int(drafted),
        "spec_accepted_tokens": int(accepted),
        "tau": r3((accepted + rounds) / rounds if rounds else None),
        "drafts_verified_per_round": r3(drafted / rounds if rounds else None),
        "acceptance_rate": r3(accepted / drafted if drafted else None),
        "tokens_from_rounds_share": r3((accepted + rounds) / tokens if tokens and rounds else None),
        "prefills": {m.split(":", 1)[1]: int(v) for m, v in d.items()
                     if m.startswith("ferry_prefills_total:") and v},
        "engine_steps": step_breakdown(d),
        # How busy each side's engine was over the level's wall time (a share near 1 is the
        # bottleneck): the decode worker's steps, and the prefill workers' steps per worker.
        "decode_busy_share": r3(busy_s(d, "") / wall if wall > 0 else None),
        "prefill_engine_steps": step_breakdown(d, "prefill/"),
        "prefill_busy_share": r3(busy_s(d, "prefill/") / wall / max(after.get("prefill/workers", 1.0), 1.0)
                                 if wall > 0 else None),
        # Where the host's CPU went over the level, in cores busy on average: each role of the
        # cluster, the load generator's client processes, and the whole machine's busy share
        # (near 1: the host, not the GPU, may have set the rate; docs/spec_decode.md).
        "cpu_cores": {role: r3((cpu1.get(role, 0.0) - cpu0.get(role, 0.0)) / wall)
                      for role in sorted(set(cpu0) | set(cpu1))} if wall > 0 else {},
        "client_cpu_cores": r3((kids1 - kids0) / wall if wall > 0 else None),
        "machine_busy_share": r3((mach1[0] - mach0[0]) / (mach1[1] - mach0[1])
                                 if mach1[1] > mach0[1] else None),
        "serials": [k for k, _ in jobs],
    }
    return level


PHASES = ("plan", "launch", "sample", "commit")


def busy_s(d: dict[str, float], prefix: str) -> float:
    """Seconds the engine spent in steps of any kind, from its step counters."""
    return sum(v for k, v in d.items()
               if k.startswith(prefix + "ferry_engine_step_microseconds_total:")) / 1e6


def step_breakdown(d: dict[str, float], prefix: str = "") -> dict:
    """Where the decode worker's engine spent the level's time, from its step counters: per kind
    (decode: plain decode-only steps; spec_round: decode-only steps that verified drafts;
    prompt: steps with prompt work), the steps and the mean ms per step in all and by phase
    (plan: the drafter pass; launch: inputs and the forward's launches; sample: sampling or
    verification, the wait for the device included; commit: tables, tokens, drafter context)."""
    out: dict = {}
    for kind in ("decode", "spec_round", "prompt"):
        n = d.get(f"{prefix}ferry_engine_steps_total:{kind}", 0.0)
        us = {p: d.get(f"{prefix}ferry_engine_step_microseconds_total:{kind}:{p}", 0.0)
              for p in PHASES}
        ms = (lambda x: round(x / n / 1e3, 4)) if n else (lambda x: None)
        per = (lambda x: round(x / n, 2)) if n else (lambda x: None)
        out[kind] = {"steps": int(n), "mean_ms": ms(sum(us.values())),
                     **{f"{p}_ms": ms(v) for p, v in us.items()},
                     # How full the steps were (counters since session 21; absent before).
                     "sequences_per_step": per(d.get(f"{prefix}ferry_engine_step_sequences_total:{kind}", 0.0)),
                     "decode_rows_per_step": per(d.get(f"{prefix}ferry_engine_step_decode_rows_total:{kind}", 0.0))}
    return out


def probe_batch_identity(cl: Cluster, prompts: Prompts, a: dict, tkey: str, deadline: float,
                         args, report: dict) -> None:
    """Plain decoding against itself: the first `--identity-probe` greedy prompts of the
    largest concurrency level that ran, again one at a time. A bf16 forward's rows depend on
    the batch's shape (GEMV vs GEMM, split-K), so near-ties can flip; how often that parts the
    plain texts is the floor for the plain-vs-speculative identity at that level."""
    levels = [l for l in a["results"].get(tkey, []) if l.get("ok") and l.get("serials")]
    if not levels:
        return
    big = max(levels, key=lambda l: l["concurrency"])
    serials = [k for k in big["serials"] if str(k) in a["greedy_texts"] or k in a["greedy_texts"]]
    serials = serials[: args.identity_probe]
    texts: dict = {}
    run_level(cl, prompts, 1, len(serials), 0.0, args.output_tokens, deadline, args, texts, serials)
    same = sum(1 for k in serials if k in texts and texts[k] == a["greedy_texts"].get(k))
    report["plain_batch_identity"] = {"concurrency": big["concurrency"], "compared": len(texts),
                                      "identical": same}
    log(f"plain: greedy texts at c={big['concurrency']} vs alone: {same} of {len(texts)} identical")


# ---------------------------------------------------------------- report


def compare(report: dict, base: str, arm: str) -> dict:
    """`arm` against `base` per temperature: ratios per level and the peak aggregates."""
    arms = report["arms"]
    plain, spec = arms.get(base, {}), arms.get(arm, {})
    out = {}
    for tkey in report["settings"]["temperature_keys"]:
        p_levels = {l["concurrency"]: l for l in plain.get("results", {}).get(tkey, [])}
        s_levels = {l["concurrency"]: l for l in spec.get("results", {}).get(tkey, [])}
        rows = []
        for c in sorted(set(p_levels) & set(s_levels)):
            p, s = p_levels[c], s_levels[c]
            ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
            rows.append({"concurrency": c,
                         "aggregate": ratio(s.get("aggregate_tok_s"), p.get("aggregate_tok_s")),
                         "steady": ratio(s.get("steady_tok_s"), p.get("steady_tok_s")),
                         "per_stream": ratio(s.get("per_stream_tok_s"), p.get("per_stream_tok_s")),
                         "ttft_p50": ratio(s.get("ttft_ms_p50"), p.get("ttft_ms_p50")),
                         "comparable": p["ok"] == p["requests"] == s["ok"] == s["requests"]})
        pk = lambda lv: max((l.get("aggregate_tok_s") or 0 for l in lv.values()), default=0)  # noqa: E731
        pp, sp = pk(p_levels), pk(s_levels)
        argmax = lambda lv, v: next((c for c, l in lv.items() if (l.get("aggregate_tok_s") or 0) == v and v), None)  # noqa: E731
        if rows or pp or sp:
            out[tkey] = {"per_level": rows,
                         "plain_peak_aggregate_tok_s": pp or None, "plain_peak_at": argmax(p_levels, pp),
                         "spec_peak_aggregate_tok_s": sp or None, "spec_peak_at": argmax(s_levels, sp),
                         "peak_aggregate_ratio": round(sp / pp, 3) if pp and sp else None}
    return out


def speedups(report: dict) -> None:
    arms = report["arms"]
    report["speedup"] = compare(report, "plain", "spec")
    if "spec_fixed" in arms:
        # Both against plain; the confidence-scheduled arm against the fixed one.
        report["speedup_fixed"] = compare(report, "plain", "spec_fixed")
        report["confidence_vs_fixed"] = compare(report, "spec_fixed", "spec")
    if "spec_env" in arms:
        report["speedup_env"] = compare(report, "plain", "spec_env")
        report["env_vs_spec"] = compare(report, "spec", "spec_env")
    plain, spec = arms.get("plain", {}), arms.get("spec", {})
    pt, st = plain.get("greedy_texts", {}), spec.get("greedy_texts", {})
    common = set(pt) & set(st)
    per_level = []
    tkey = report["settings"]["temperature_keys"][0] if report["settings"]["temperature_keys"] else None
    for lv in spec.get("results", {}).get(tkey, []) if tkey == "0" else []:
        ks = [k for k in lv.get("serials", []) if k in common]
        if ks:
            per_level.append({"concurrency": lv["concurrency"], "compared": len(ks),
                              "identical": sum(1 for k in ks if pt[k] == st[k])})
    report["greedy_identity"] = {"compared": len(common),
                                 "identical": sum(1 for k in common if pt[k] == st[k]),
                                 "per_level": per_level}


def fmt(x, nd=1) -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def side_by_side(report: dict, title: str, base: tuple, other: tuple, ratios: str) -> list[str]:
    """A Markdown table of two speculating arms at the greedy levels both ran: plain's aggregate for
    reference, both arms' aggregates, their ratio (`report[ratios]`), τ and drafts per round.
    `base` and `other` are (arm, label)."""
    (b, bl), (o, ol) = base, other
    tkey = report["settings"]["temperature_keys"][0]
    by = lambda arm: {l["concurrency"]: l for l in report["arms"].get(arm, {}).get("results", {}).get(tkey, [])}  # noqa: E731
    pl, bs, os_ = by("plain"), by(b), by(o)
    ratio = {r["concurrency"]: r for r in report.get(ratios, {}).get(tkey, {}).get("per_level", [])}
    L = [title, "",
         f"| c | plain agg tok/s | {bl} agg tok/s | {ol} agg tok/s | **{ol} / {bl}** |"
         f" {bl} τ | {ol} τ | {bl} drafts / round | {ol} drafts / round |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(set(bs) & set(os_)):
        p, x, y = pl.get(c, {}), bs.get(c, {}), os_.get(c, {})
        L.append(f"| {c} | {fmt(p.get('aggregate_tok_s'))} | {fmt(x.get('aggregate_tok_s'))} | "
                 f"{fmt(y.get('aggregate_tok_s'))} | **{fmt(ratio.get(c, {}).get('aggregate'), 2)}** | "
                 f"{fmt(x.get('tau'), 2)} | {fmt(y.get('tau'), 2)} | "
                 f"{fmt(x.get('drafts_verified_per_round'), 2)} | {fmt(y.get('drafts_verified_per_round'), 2)} |")
    return L + [""]


def markdown(report: dict) -> str:
    s = report["settings"]
    L = [f"## DSpark: speculative vs plain decoding through the cluster ({report['date']})", "",
         f"{report['device_name']} · `{s['ferry']} up --device {s['device']}"
         + (f" --gpu-mode {s['gpu_mode']}" if s["device"] != "cpu" else "")
         + f" --prefill-workers {s['prefill_workers']} --decode-workers 1 --max-running {s['max_running']}"
         f" --kv-blocks {s['kv_blocks']}` · target `{s['target']}`, drafter `{s['drafter']}`"
         f" (spec arm: `--speculative on --verify-len {s['verify_len']} --max-verify-tokens"
         f" {s['max_verify_tokens']}`; plain arm: `--speculative off`, no drafter) · held-out prompts"
         f" `{s['prompts']}`: {s['prompt_tokens']} tokens (+ BOS), {s['output_tokens']} output tokens"
         f" (`ignore_eos`), closed loop, `/v1/completions` streamed · JSON: `dspark_bench.json`", ""]
    cc = report.get("client_ceiling") or {}
    if cc.get("tok_s"):
        L.append(f"- **The load generator's own ceiling** ({s.get('client_procs')} client processes): "
                 + ", ".join(f"{fmt(v)} tok/s with {p} process{'es' if p != '1' else ''}"
                             for p, v in cc["tok_s"].items())
                 + f" at c = {cc['concurrency']} against stand-in servers with no model, which offer"
                 f" each stream a chunk every {fmt(cc.get('step_ms'), 1)} ms ({fmt(cc.get('offered_tok_s'))}"
                 " tok/s in all); a level whose aggregate nears it measured the client, not ferry.")
    elif cc.get("error"):
        L.append(f"- The load generator's ceiling was not measured: {cc['error']}")
    for arm, a in report["arms"].items():
        if a.get("error"):
            L.append(f"- **{arm} arm failed**: {a['error']}")
    L.append("")
    for tkey in s["temperature_keys"]:
        L += [f"### {'greedy' if float(tkey) == 0 else 'T = ' + tkey}", "",
              "| c | requests | plain agg tok/s | spec agg tok/s | **agg ×** | plain per-stream tok/s |"
              " spec per-stream tok/s | **per-stream ×** | TTFT p50 / p99 ms plain | spec |"
              " ITL p50 / p99 ms plain | spec | TPOT ms plain | spec | τ | drafts / round |"
              " clients in a request plain / spec | prompts from cache plain / spec |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        pl = {l["concurrency"]: l for l in report["arms"].get("plain", {}).get("results", {}).get(tkey, [])}
        sl = {l["concurrency"]: l for l in report["arms"].get("spec", {}).get("results", {}).get(tkey, [])}
        sp = {r["concurrency"]: r for r in report.get("speedup", {}).get(tkey, {}).get("per_level", [])}
        for c in sorted(set(pl) | set(sl)):
            p, q, r = pl.get(c, {}), sl.get(c, {}), sp.get(c, {})
            req = "/".join(f"{x.get('ok', '–')}" for x in (p, q)) + f" of {(p or q).get('requests')}"
            L.append(
                f"| {c} | {req} | {fmt(p.get('aggregate_tok_s'))} | {fmt(q.get('aggregate_tok_s'))} | "
                f"**{fmt(r.get('aggregate'), 2)}** | {fmt(p.get('per_stream_tok_s'))} | "
                f"{fmt(q.get('per_stream_tok_s'))} | **{fmt(r.get('per_stream'), 2)}** | "
                f"{fmt(p.get('ttft_ms_p50'))} / {fmt(p.get('ttft_ms_p99'))} | "
                f"{fmt(q.get('ttft_ms_p50'))} / {fmt(q.get('ttft_ms_p99'))} | "
                f"{fmt(p.get('itl_ms_p50'), 2)} / {fmt(p.get('itl_ms_p99'), 2)} | "
                f"{fmt(q.get('itl_ms_p50'), 2)} / {fmt(q.get('itl_ms_p99'), 2)} | "
                f"{fmt(p.get('tpot_ms_mean'), 2)} | {fmt(q.get('tpot_ms_mean'), 2)} | "
                f"{fmt(q.get('tau'), 2)} | {fmt(q.get('drafts_verified_per_round'), 2)} | "
                f"{fmt(p.get('in_request_share'), 2)} / {fmt(q.get('in_request_share'), 2)} | "
                f"{fmt(p.get('prompt_cached_share'), 2)} / {fmt(q.get('prompt_cached_share'), 2)} |")
        pk = report.get("speedup", {}).get(tkey, {})
        L += ["", f"Peak aggregate: plain {fmt(pk.get('plain_peak_aggregate_tok_s'))} tok/s (c = "
              f"{pk.get('plain_peak_at')}), spec {fmt(pk.get('spec_peak_aggregate_tok_s'))} tok/s (c = "
              f"{pk.get('spec_peak_at')}): **{fmt(pk.get('peak_aggregate_ratio'), 2)}×**.",
              "Steady (until the last request started, all c in flight) spec / plain: "
              + ", ".join(f"c = {c} {fmt(r.get('steady'), 2)}×" for c, r in sorted(sp.items())) + ".", ""]
    L += ["### Where the decode worker's steps went (engine step counters, mean ms per step)", "",
          "Phases: plan (the drafter pass), launch (inputs and the forward's launches), sample "
          "(sampling or verification; on a GPU the wait for the forward), commit (tables, tokens, "
          "drafter context). Busy: the share of the level's wall time the decode worker's engine "
          "(and each prefill worker's, on average) spent in steps; near 1 is the bottleneck. CPU "
          "cores: CPU seconds over the level's wall time of the router, the decode worker (all its "
          "threads) and the load generator's client processes; machine CPU busy: the whole host's "
          f"share of its {s.get('host_cpus')} cores (near 1, the host CPU may have set the rate).", "",
          "| arm | T | c | decode steps | decode ms (plan / launch / sample / commit) | seqs / decode step |"
          " round steps | round ms (plan / launch / sample / commit) | seqs / round | rows / round |"
          " prompt steps | prompt ms | decode busy | prefill busy | CPU cores router / decode / clients |"
          " machine CPU busy |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def split(k: dict) -> str:
        if not k.get("steps"):
            return "–"
        return (f"{fmt(k.get('mean_ms'), 3)} ("
                + " / ".join(fmt(k.get(f"{p}_ms"), 3) for p in PHASES) + ")")

    for arm, a in report["arms"].items():
        for tkey, levels in a.get("results", {}).items():
            for l in levels:
                e = l.get("engine_steps") or {}
                if not e:
                    continue
                d, r, p = (e.get(k, {}) for k in ("decode", "spec_round", "prompt"))
                cores = l.get("cpu_cores") or {}
                L.append(f"| {arm} | {tkey} | {l['concurrency']} | {d.get('steps')} | {split(d)} | "
                         f"{fmt(d.get('sequences_per_step'), 1)} | {r.get('steps')} | {split(r)} | "
                         f"{fmt(r.get('sequences_per_step'), 1)} | {fmt(r.get('decode_rows_per_step'), 1)} | "
                         f"{p.get('steps')} | {fmt(p.get('mean_ms'), 3)} | "
                         f"{fmt(l.get('decode_busy_share'), 2)} | {fmt(l.get('prefill_busy_share'), 2)} | "
                         f"{fmt(cores.get('router'), 1)} / {fmt(cores.get('decode'), 1)} / "
                         f"{fmt(l.get('client_cpu_cores'), 1)} | {fmt(l.get('machine_busy_share'), 2)} |")
    L.append("")
    if "spec_fixed" in report["arms"]:
        L += side_by_side(report, f"### Verify length: `{s['verify_len']}` against fixed "
                          f"(`{s['fixed_verify_len']}`), greedy",
                          ("spec_fixed", "fixed"), ("spec", "confidence"), "confidence_vs_fixed")
    if "spec_env" in report["arms"]:
        L += side_by_side(report, f"### The `spec` arm with `{s.get('env_arm')}` against it, greedy",
                          ("spec", "spec"), ("spec_env", "spec_env"), "env_vs_spec")
    g = report.get("greedy_identity", {})
    by = ", ".join(f"{x['identical']}/{x['compared']} at c = {x['concurrency']}" for x in g.get("per_level", []))
    L += [f"Greedy identity: {g.get('identical')} of {g.get('compared')} greedy requests gave the same"
          " text plain and speculative" + (f" ({by})" if by else "") + "."]
    pb = report.get("plain_batch_identity")
    if pb:
        L += [f"Plain against itself: {pb['identical']} of {pb['compared']} greedy prompts of the c = "
              f"{pb['concurrency']} level gave the same text again alone (batch-shape numerics: the floor"
              " for the identity above)."]
    L += ["",
          "Per-stream tok/s: (output tokens − 1) / (last chunk − first chunk), mean over requests;"
          " aggregate: output tokens / wall of the level; TPOT: (last chunk − first chunk) / (output"
          " tokens − 1), mean over requests; ITL: gaps between streamed chunks, over all requests (the"
          " router streams a sequence's tokens of one step as one chunk, so under speculation a gap is"
          " a round's); τ = (accepted + rounds) / rounds and drafts /"
          " round = drafted / rounds from the decode worker's `ferry_spec_decode_*` counters over"
          " the level; clients in a request: the time clients spent inside requests over c × wall"
          f" (the clients run on {s.get('client_procs')} processes; below ~0.9 the load generator,"
          " not ferry, set the level's rate); prompts from cache: the share of the level's prompt"
          " tokens the cluster served from its prefix cache (near 0: every prompt was prefilled, as"
          " the reference shape asks; near 1: the level measured decoding alone).", ""]
    return "\n".join(L)


def device_name(device: str) -> str:
    if device == "cpu":
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    return f"CPU ({line.split(':', 1)[1].strip()}, {os.cpu_count()} cores)"
        except OSError:
            pass
        return "CPU"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        if out:
            return f"{out[0]} ({device})"
    except Exception:  # noqa: BLE001
        pass
    return device


# ---------------------------------------------------------------- main


def parse_requests(spec: str, levels: list[int]) -> dict[int, int]:
    """`auto` (max(16, 2c): two requests per client, and at least 16 so that a low level is not
    four prompts' luck), a number (at least c), or c:n,c:n."""
    if spec == "auto":
        return {c: max(16, 2 * c) for c in levels}
    if ":" in spec:
        m = {int(a): int(b) for a, b in (x.split(":") for x in spec.split(","))}
        return {c: max(c, m.get(c, c)) for c in levels}
    return {c: max(c, int(spec)) for c in levels}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ferry")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--prompts")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="results directory ($RUN/bench)")
    p.add_argument("--client-procs", type=int, default=default_client_procs(),
                   help="load-generator processes the clients are spread over (one Python process "
                        "parses ~40-50k chunks a second)")
    p.add_argument("--ceiling-only", action="store_true",
                   help="only measure the load generator's ceiling at the largest level (with 1 and "
                        "--client-procs processes) against a stand-in server, print it as JSON")
    p.add_argument("--arms", default="plain,spec")
    p.add_argument("--concurrency", default="1,4,16,64,128")
    p.add_argument("--requests", default="auto")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=400)
    p.add_argument("--max-running", type=int, default=128)
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--gpu-mode", default="fast")
    p.add_argument("--verify-len", default="goodput")
    p.add_argument("--max-verify-tokens", type=int, default=1024)
    p.add_argument("--fixed-verify-len", default="fixed:4", help="the spec_fixed arm's --verify-len")
    p.add_argument("--identity-probe", type=int, default=16,
                   help="plain arm: re-run this many greedy prompts of its largest level one at a "
                        "time and compare the texts (batch-shape numerics; 0: off)")
    p.add_argument("--fixed-concurrency", default="1,16,64",
                   help="the spec_fixed and spec_env arms' levels (greedy only)")
    p.add_argument("--env-arm", default="",
                   help="the spec_env arm's environment: VAR=value ... on top of this one's")
    p.add_argument("--up-args", default="", help="more `ferry up` flags, both arms")
    p.add_argument("--seconds", type=float, default=480, help="budget of the whole run")
    p.add_argument("--ready-seconds", type=float, default=240)
    p.add_argument("--stop-seconds", type=float, default=30)
    p.add_argument("--request-seconds", type=float, default=180)
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="warm-up: one request, then each concurrency level once with this many output tokens (0: none)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    fixed_levels = [int(x) for x in args.fixed_concurrency.split(",") if x.strip()]
    arms = [a for a in args.arms.split(",") if a]
    # The ceiling at the largest level any arm runs, two requests a client.
    cmax = max(levels + (fixed_levels if set(arms) & set(SIDE_ARMS) else []), default=1)
    procs = sorted({1, max(1, args.client_procs)})
    if args.ceiling_only:
        print(json.dumps(client_ceiling(cmax, 2 * cmax, args.output_tokens, procs), indent=1))
        return 0
    missing = [f"--{k}" for k in ("ferry", "target", "drafter", "prompts", "out") if not getattr(args, k)]
    if missing:
        raise SystemExit(f"dspark-bench: {', '.join(missing)} required")

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    nreq = parse_requests(args.requests, levels)
    temps = [float(x) for x in args.temperatures.split(",") if x.strip()]
    tkeys = [f"{t:g}" for t in temps]
    unknown = [a for a in arms if a not in ("plain",) + SPEC_ARMS]
    if unknown:
        raise SystemExit(f"dspark-bench: unknown arm(s) {unknown}: plain, spec, spec_fixed, spec_env")
    if "spec_env" in arms and not env_assignments(args.env_arm):
        raise SystemExit("dspark-bench: the spec_env arm needs --env-arm VAR=value ...")
    for c in fixed_levels:
        nreq.setdefault(c, parse_requests(args.requests, [c])[c])
    # A spec_fixed or spec_env arm weighs half: its levels and temperatures are fewer.
    weight = {a: (0.5 if a in SIDE_ARMS else 1.0) for a in arms}

    cfg = json.loads((Path(args.target) / "config.json").read_text())
    ctx = int(cfg.get("max_position_embeddings", 4096))
    bos = cfg.get("bos_token_id")
    # The prompt (+ BOS) and the output must fit the model's context.
    prompt_tokens = min(args.prompt_tokens, ctx - args.output_tokens - 1 - (bos is not None))
    if prompt_tokens < 1:
        raise SystemExit(f"dspark-bench: {args.output_tokens} output tokens leave no room in a {ctx}-token context")
    prompts = Prompts(args.prompts, prompt_tokens, bos)

    report = {
        "benchmark": "dspark_bench", "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": device_name(args.device),
        "settings": {
            "ferry": args.ferry, "device": args.device, "target": args.target, "drafter": args.drafter,
            "prompts": args.prompts, "prompt_rows": len(prompts.rows), "context_length": ctx,
            "prompt_tokens": prompts.tokens, "bos_prepended": bos is not None,
            "output_tokens": args.output_tokens, "ignore_eos": True,
            "concurrency": levels, "requests_per_level": {str(c): n for c, n in nreq.items()},
            "temperatures": temps, "temperature_keys": tkeys, "seeded_sampling": "seed = 1000 + prompt serial, with speculative: true",
            "gpu_mode": args.gpu_mode if args.device != "cpu" else None,
            "prefill_workers": args.prefill_workers, "decode_workers": 1,
            "max_running": args.max_running, "kv_blocks": args.kv_blocks,
            "verify_len": args.verify_len, "max_verify_tokens": args.max_verify_tokens,
            "fixed_verify_len": args.fixed_verify_len, "env_arm": args.env_arm,
            "up_args": args.up_args, "budget_s": args.seconds, "warmup_tokens": args.warmup_tokens,
            "endpoint": "/v1/completions (stream, token-id prompts)", "load": "closed loop, c clients",
            "client_procs": args.client_procs, "host_cpus": os.cpu_count(),
        },
        "arms": {},
    }
    # What the load generator alone sustains here (seconds): the limit of the measurement.
    report["client_ceiling"] = client_ceiling(cmax, 2 * cmax, args.output_tokens, procs)
    log(f"load generator ceiling at c={cmax}: {report['client_ceiling'].get('tok_s')} tok/s by processes")
    try:
        report["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                              text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        report["git_commit"] = None
    for f in ("train_report.json",):
        for who, d in (("target", args.target), ("drafter", args.drafter)):
            try:
                r = json.loads((Path(d) / f).read_text())
                if who == "drafter":
                    a = r.get("test_after", {})
                    report["drafter_offline"] = {k: a.get(k) for k in
                                                 ("acceptance_length_fixed_B", "confidence_0.3_acceptance_length")}
                else:
                    report["target_params"] = r.get("parameters")
            except Exception:  # noqa: BLE001
                pass

    def save() -> None:
        speedups(report)
        (out / "dspark_bench.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "dspark_bench.md").write_text(markdown(report))

    end = T0 + args.seconds
    for ai, arm in enumerate(arms):
        # Each arm gets its share of what is left, so a slow first arm cannot eat the others'.
        left = sum(weight[x] for x in arms[ai:])
        arm_deadline = time.monotonic() + (end - time.monotonic()) * weight[arm] / left
        side = arm in SIDE_ARMS
        arm_levels = fixed_levels if side else levels
        arm_temps = list(zip(temps, tkeys))[:1] if side else list(zip(temps, tkeys))
        a = report["arms"][arm] = {"results": {k: [] for k in tkeys}, "error": None, "greedy_texts": {}}
        cl = Cluster(args, arm, out / "logs")
        CURRENT[:] = [cl]
        prompts.reset()
        t_arm = time.monotonic()
        try:
            cl.start()
            a["command"] = " ".join(cl.argv())
            cl.wait_up(min(arm_deadline, time.monotonic() + args.ready_seconds))
            a["ready_s"] = round(time.monotonic() - t_arm, 1)
            log(f"{arm}: up in {a['ready_s']}s (model {cl.model_name!r}, metrics {cl.metrics})")
            if args.warmup_tokens > 0:
                t = time.monotonic()
                for c in arm_levels:
                    run_level(cl, prompts, c, c, 0.0, args.warmup_tokens, arm_deadline, args, {})
                a["warmup_s"] = round(time.monotonic() - t, 1)
                log(f"{arm}: warm-up {a['warmup_s']}s")
            for t, tkey in arm_temps:
                for c in arm_levels:
                    if time.monotonic() > arm_deadline - 2:
                        log(f"{arm}: T={tkey} c={c}: skipped (arm budget spent)")
                        a["results"][tkey].append({"concurrency": c, "requests": nreq[c], "ok": 0,
                                                   "failed": 0, "skipped_deadline": nreq[c]})
                        continue
                    lv = run_level(cl, prompts, c, nreq[c], t, args.output_tokens, arm_deadline, args,
                                   a["greedy_texts"])
                    a["results"][tkey].append(lv)
                    log(f"{arm}: T={tkey} c={c}: {lv['ok']}/{lv['requests']} ok, agg {lv['aggregate_tok_s']} tok/s, "
                        f"per-stream {lv['per_stream_tok_s']}, TTFT p50 {lv['ttft_ms_p50']} ms, "
                        f"ITL p50 {lv['itl_ms_p50']} ms, tau {lv['tau']}, drafts/round {lv['drafts_verified_per_round']}, "
                        f"in request {lv['in_request_share']}, tail {lv['tail_ms_mean']} ms, "
                        f"CPU cores {lv['cpu_cores']} + clients {lv['client_cpu_cores']}, "
                        f"machine busy {lv['machine_busy_share']}, prompts from cache "
                        f"{lv['prompt_cached_share']} ({lv['reused_prompts']} reused)"
                        + (f", errors {lv['errors']}" if lv["errors"] else ""))
                    save()
            if arm == "plain" and args.identity_probe > 0 and temps and temps[0] == 0.0:
                probe_batch_identity(cl, prompts, a, tkeys[0], arm_deadline, args, report)
                save()
        except Exception as e:  # noqa: BLE001 — a failed arm is recorded, the next one still runs
            a["error"] = f"{type(e).__name__}: {e}"
            a["log_tail"] = cl.log_tail()
            log(f"{arm}: FAILED: {a['error']}\n{a['log_tail']}")
        except BaseException as e:  # the signal handler's SystemExit: record, stop, unwind
            a["error"] = f"interrupted ({type(e).__name__} {e})"
            raise
        finally:
            rc = cl.stop()
            a["ferry_up_exit"] = rc
            a["arm_s"] = round(time.monotonic() - t_arm, 1)
            log(f"{arm}: stopped (exit {rc}) after {a['arm_s']}s")
            save()
    report["total_s"] = round(time.monotonic() - T0, 1)
    save()
    for tkey, sp in report["speedup"].items():
        log(f"T={tkey}: per level {[(r['concurrency'], r['aggregate'], r['per_stream']) for r in sp['per_level']]}, "
            f"peak aggregate ratio {sp['peak_aggregate_ratio']}")
    log(f"greedy identity {report['greedy_identity']}; wrote {out / 'dspark_bench.json'} and .md")
    return 0 if all(not a.get("error") for a in report["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
