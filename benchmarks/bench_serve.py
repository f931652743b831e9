"""Load generator for any OpenAI-compatible server: N concurrent streaming chat clients.

    python benchmarks/bench_serve.py --size 1b --backend cpu_int4 --threads 2 --slots 16 \\
        --clients 1,4,16 --prompt-len 16 --new-tokens 128          # starts `glmcore serve` itself
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000/v1 --model NAME --clients 1,4,16

Each client sends `--requests` streamed chat requests one after another (a distinct prompt of about
--prompt-len tokens, max_tokens --new-tokens, greedy, stream_options.include_usage). Per concurrency it
prints aggregate generated tok/s (completion tokens reported by the server / wall time), time to first
token p50/p99 (request sent -> first content) and inter-token latency p50/p99 (between content chunks).
With --conversation, it measures prefix reuse instead: a first turn with a prompt of about --prompt-len
tokens, then a second turn (the reply sent back plus a short user message): the second turn's time to
first token should follow the new turn's length, not the history's.
Traffic goes only to loopback addresses; every loop is bounded in count and time (--timeout).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx
import numpy as np

WORDS = ("the of and to in is it that for on with as was at by be this from or an are not have one all "
         "they what there can we out other were your when up use how said each she which do their time if "
         "will way about many then them would write like so these her long make thing see him two has look").split()


def loopback_only(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        sys.exit(f"error: cannot resolve {host!r} ({e}); give a loopback URL such as http://127.0.0.1:8000/v1")
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        sys.exit(f"error: {url} is not a loopback address; this benchmark sends traffic to 127.0.0.1/::1 only")


def prompt_text(n_words: int, client: int, request: int) -> str:
    words = [f"client{client}", f"request{request}"] + [WORDS[(client * 7 + request * 3 + i) % len(WORDS)]
                                                       for i in range(max(0, n_words - 2))]
    return " ".join(words)


async def one_request(http: httpx.AsyncClient, url: str, model: str, content: str, new_tokens: int,
                      timeout: float, api_key: str | None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": new_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with http.stream("POST", f"{url}/chat/completions", json=body, headers=headers, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                d = c.get("delta") or {}
                if d.get("content") or d.get("tool_calls"):
                    stamps.append(time.perf_counter())
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"a request ran past --timeout {timeout} s")
    if not stamps or usage is None:
        raise RuntimeError("the stream had no content or no usage chunk (does the server honour include_usage?)")
    return {"ttft": stamps[0] - t0, "itl": np.diff(stamps).tolist(), "prompt": usage["prompt_tokens"],
            "new": usage["completion_tokens"]}


async def conversation(url, model, n_words, new_tokens, timeout, api_key) -> list[dict]:
    """Two turns of one conversation; each turn's TTFT, prompt tokens and cached tokens (as the server reports)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    messages = [{"role": "user", "content": prompt_text(n_words, 10**6, 0)}]  # not a prompt calibrate sent
    out = []
    async with httpx.AsyncClient(timeout=timeout) as http:
        for turn in range(2):
            body = {"model": model, "messages": messages, "max_tokens": new_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0, first, text, usage = time.perf_counter(), None, [], None
            async with http.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices") or []:
                        if (c.get("delta") or {}).get("content"):
                            first = first or time.perf_counter()
                            text.append(c["delta"]["content"])
            details = (usage or {}).get("prompt_tokens_details") or {}
            out.append({"ttft": (first or time.perf_counter()) - t0, "prompt": usage["prompt_tokens"],
                        "cached": details.get("cached_tokens", 0)})
            messages += [{"role": "assistant", "content": "".join(text)},
                         {"role": "user", "content": "and one more short question"}]
    return out


async def phase(url, model, clients, requests, n_words, new_tokens, timeout, api_key) -> dict:
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        async def client(i):
            return [await one_request(http, url, model, prompt_text(n_words, i, k), new_tokens, timeout, api_key)
                    for k in range(requests)]
        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(clients))),
                                         timeout * requests + 10)
        wall = time.perf_counter() - t0
    done = [r for rs in results for r in rs]
    ttft = np.array([r["ttft"] for r in done]) * 1e3
    itl = np.array([x for r in done for x in r["itl"]] or [0.0]) * 1e3
    generated = sum(r["new"] for r in done)
    return {"clients": clients, "requests": len(done), "prompt": np.mean([r["prompt"] for r in done]),
            "generated": generated, "wall": wall, "tps": generated / wall,
            "ttft50": np.percentile(ttft, 50), "ttft99": np.percentile(ttft, 99),
            "itl50": np.percentile(itl, 50), "itl99": np.percentile(itl, 99)}


def calibrate(url, model, prompt_len, api_key, timeout) -> int:
    """Words of content that make a chat prompt of about prompt_len tokens on this server's tokenizer."""
    n = max(1, prompt_len)
    for _ in range(3):
        r = asyncio.run(phase(url, model, 1, 1, n, 1, timeout, api_key))
        n = max(1, round(n * prompt_len / max(r["prompt"], 1)))
        if abs(r["prompt"] - prompt_len) <= max(2, prompt_len // 10):
            break
    return n


def start_server(a) -> tuple[subprocess.Popen, str, str]:
    from glmcore.synth import cached_model
    model = a.model_dir or str(cached_model(a.family, a.size))
    cmd = [sys.executable, "-m", "glmcore.cli", "serve", "--model", model, "--port", "0", "--slots", str(a.slots),
           "--token-budget", str(a.token_budget), "--max-queue", str(max(64, a.slots * 4))]
    for flag, value in (("--backend", a.backend), ("--threads", a.threads)):
        if value is not None:
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 1800          # a first load may quantize a large model
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            sys.exit(f"error: glmcore serve exited with {proc.returncode} before it started")
        m = re.search(r"(http://\S+/v1) \| model (\S+)", line)
        if m:
            print(f"# {line.strip()}")
            return proc, m.group(1), m.group(2)
    proc.kill()
    sys.exit("error: glmcore serve did not start in 30 minutes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="an OpenAI-compatible base URL on loopback (default: start glmcore serve)")
    ap.add_argument("--model", help="with --url: the model id to send (default: the first of /models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--model-dir", help="without --url: a checkpoint for glmcore serve (default: synthetic --size)")
    ap.add_argument("--family", default="chatglm3")
    ap.add_argument("--size", default="1b")
    ap.add_argument("--backend")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--clients", default="1,4,16", help="comma-separated concurrencies")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    ap.add_argument("--conversation", action="store_true", help="measure a second turn's TTFT instead")
    a = ap.parse_args(argv)
    if a.size == "tiny" and a.url is None and a.clients == "1,4,16":     # CI's smoke run: small and quick
        a.clients, a.new_tokens, a.requests = "1,4", min(a.new_tokens, 16), 1
    clients = [int(c) for c in a.clients.split(",")]
    if not clients or min(clients) < 1 or a.requests < 1 or a.new_tokens < 1 or a.prompt_len < 1:
        sys.exit("error: --clients, --requests, --new-tokens and --prompt-len must be positive")
    proc = None
    try:
        if a.url:
            url, model = a.url.rstrip("/"), a.model
            loopback_only(url)
            if model is None:
                headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
                model = httpx.get(f"{url}/models", headers=headers, timeout=30).json()["data"][0]["id"]
        else:
            proc, url, model = start_server(a)
        n_words = calibrate(url, model, a.prompt_len, a.api_key, a.timeout)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        if a.conversation:
            turns = asyncio.run(conversation(url, model, n_words, a.new_tokens, a.timeout, a.api_key))
            print(f"# {url} model {model}; load average {load:.2f} at start")
            for i, t in enumerate(turns, 1):
                print(f"turn {i}: prompt {t['prompt']} tok, {t['cached']} reused from the cache, "
                      f"{t['prompt'] - t['cached']} prefilled | time to first token {t['ttft'] * 1e3:.0f} ms")
            return 0
        print(f"# {url} model {model}; prompt ~{a.prompt_len} tok, {a.new_tokens} new tok, {a.requests} request(s) "
              f"per client, greedy; load average {load:.2f} at start")
        print("| clients | requests | prompt tok | generated tok | wall s | aggregate tok/s | TTFT p50 ms | "
              "TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n in clients:
            r = asyncio.run(phase(url, model, n, a.requests, n_words, a.new_tokens, a.timeout, a.api_key))
            print(f"| {n} | {r['requests']} | {r['prompt']:.0f} | {r['generated']} | {r['wall']:.2f} | {r['tps']:.1f} | "
                  f"{r['ttft50']:.0f} | {r['ttft99']:.0f} | {r['itl50']:.1f} | {r['itl99']:.1f} |", flush=True)
    except (httpx.HTTPError, RuntimeError, TimeoutError, asyncio.TimeoutError) as e:
        print(f"error: {type(e).__name__}: {e} (raise --timeout on a slow or busy machine)", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
