"""Serving benchmark: a load generator for any OpenAI-compatible server (llminfer, vLLM, TGI, ...).

Requests are streamed (``stream: true``) so every token's arrival is timed on the client. Arrivals follow
a Poisson process at ``request_rate`` requests/s (``inf``: all at once), optionally capped at
``concurrency`` requests in flight. The client's timestamps become a trace in the engine's own schema
(``arrived`` → ``first_token`` → ``token``... → ``finished``), so TTFT / TPOT / ITL / E2E come from the
same polars expressions as offline benchmarks. TTFT is taken at the first chunk that carries text — a
chat stream's role-only first chunk does not count. Goodput counts the requests per second that met both
SLOs (``slo_ttft_ms``, ``slo_tpot_ms``).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import polars as pl

from llminfer.benchmark import artifacts
from llminfer.benchmark.environment import environment
from llminfer.benchmark.metrics import percentile_columns, request_metrics, trace_frame

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "number group problem fact model token cache block batch queue server stream layer kernel page").split()


@attrs.define
class ServingWorkload:
    """What to send: random prompts (``prompt_len`` words, ``output_len`` tokens, uniform ranges) or a JSONL
    file of ``{"prompt": ..., "max_tokens": ...}`` lines."""

    num_requests: int = 100
    prompt_len: tuple[int, int] = (16, 128)
    output_len: tuple[int, int] = (16, 128)
    prompts_file: str | None = None
    seed: int = 0

    def requests(self) -> list[tuple[str, int]]:
        """``(prompt, max_tokens)`` pairs.

        Raises:
            ValueError: an empty or malformed prompts file.
        """
        rng = random.Random(self.seed)
        if self.prompts_file:
            rows = []
            for n, line in enumerate(Path(self.prompts_file).read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    rows.append((str(obj["prompt"]), int(obj.get("max_tokens", rng.randint(*self.output_len)))))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{self.prompts_file}:{n}: expected {{\"prompt\": ..., \"max_tokens\": ...}} "
                                     f"({exc})") from None
            if not rows:
                raise ValueError(f"{self.prompts_file} holds no prompts")
            return [rows[i % len(rows)] for i in range(self.num_requests)]
        return [(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*self.prompt_len))),
                 rng.randint(*self.output_len)) for _ in range(self.num_requests)]


@attrs.define
class ServingConfig:
    """Where and how to send the load.

    Attributes:
        base_url: the server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is appended).
        model: the model name to send (None: the first of ``GET /v1/models``).
        request_rate: mean arrivals per second (Poisson); ``inf`` sends everything at once.
        concurrency: most requests in flight (None: unlimited).
        endpoint: ``"completions"`` or ``"chat"``.
        extra_body: extra JSON fields for every request (e.g. ``{"ignore_eos": true}`` for vLLM).
        slo_ttft_ms, slo_tpot_ms: service-level objectives for goodput.
        timeout_s: per-request timeout (s).
    """

    base_url: str
    model: str | None = None
    request_rate: float = math.inf
    concurrency: int | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    extra_body: dict[str, Any] = attrs.field(factory=dict)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 200.0
    timeout_s: float = 600.0


@attrs.define
class ServingResult:
    """Per-request client measurements and their summary."""

    requests: list[dict[str, Any]]
    summary: dict[str, Any]
    settings: dict[str, Any]
    environment: dict[str, Any]

    def print_summary(self) -> str:
        s = self.summary
        lines = [
            f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s",
            f"throughput: {s['output_tokens_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s, "
            f"goodput {s['goodput_requests_per_s']:.2f} req/s",
        ]
        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            vals = [s.get(f"{m}_p{q}") for q in (50, 95, 99)]
            lines.append(f"{m:8s} p50 {_f(vals[0])}  p95 {_f(vals[1])}  p99 {_f(vals[2])}")
        text = "\n".join(lines)
        print(text)
        return text

    def to_json_dict(self) -> dict[str, Any]:
        return {"schema_version": 1, "kind": "serving", "settings": self.settings, "environment": self.environment,
                "summary": self.summary, "requests": self.requests}

    def save_artifacts(self, directory: str | Path = ".", json_out: str | Path | None = None,
                       csv_out: str | Path | None = None) -> dict[str, Path]:
        """``serving.json`` (everything) and ``serving.csv`` (one row per request)."""
        return artifacts.write(self.to_json_dict(), pl.DataFrame(self.requests), directory, "serving", json_out,
                               csv_out)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:8.1f}"


async def _one(client: Any, cfg: ServingConfig, model: str, prompt: str, max_tokens: int, rid: str,
               events: list[tuple]) -> dict[str, Any]:
    if cfg.endpoint == "chat":
        url = "/v1/chat/completions"
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    else:
        url = "/v1/completions"
        body = {"model": model, "prompt": prompt}
    body.update(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **cfg.extra_body)
    start = time.perf_counter_ns()
    events.append((rid, "tokenize", "arrived", start, 0))
    chunks = 0
    usage_tokens = None
    first = last = None
    error = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        error = str(obj["error"])[:200]
                        break
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens")
                    for choice in obj.get("choices") or ():
                        text = choice.get("text") if cfg.endpoint != "chat" else (choice.get("delta") or {}).get("content")
                        if text:  # a role-only or empty chunk is not a token
                            now = time.perf_counter_ns()
                            events.append((rid, "sink", "first_token" if first is None else "token", now, 1))
                            first = first or now
                            last = now
                            chunks += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
        error = f"{type(exc).__name__}: {exc}"[:200]
    end = time.perf_counter_ns()
    output = usage_tokens if usage_tokens is not None else chunks
    if error is None and last is not None:
        if output > chunks:  # several tokens per chunk: count them on the last chunk
            events.append((rid, "sink", "token", last, output - chunks))
        events.append((rid, "sink", "finished", end, 0))
    return {"request_id": rid, "ok": error is None, "error": error, "prompt_words": len(prompt.split()),
            "max_tokens": max_tokens, "output_tokens": output, "chunks": chunks,
            "ttft_ms": None if first is None else (first - start) / 1e6, "e2e_ms": (end - start) / 1e6}


async def run_serving_benchmark(cfg: ServingConfig, workload: ServingWorkload) -> ServingResult:
    """Send the workload and measure it.

    Raises:
        httpx.HTTPError: the server cannot be reached to list its models (when ``cfg.model`` is None).
    """
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency or 1000, max_keepalive_connections=cfg.concurrency or 1000)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        model = cfg.model
        if model is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        reqs = workload.requests()
        events: list[tuple] = []
        rng = random.Random(workload.seed + 1)
        sem = anyio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        results: list[dict[str, Any]] = [{} for _ in reqs]

        async def fire(i: int, prompt: str, max_tokens: int) -> None:
            if sem is None:
                results[i] = await _one(client, cfg, model, prompt, max_tokens, f"req-{i}", events)
                return
            async with sem:
                results[i] = await _one(client, cfg, model, prompt, max_tokens, f"req-{i}", events)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, (prompt, max_tokens) in enumerate(reqs):
                tg.start_soon(fire, i, prompt, max_tokens)
                if math.isfinite(cfg.request_rate) and cfg.request_rate > 0:
                    await anyio.sleep(rng.expovariate(cfg.request_rate))
        duration = time.perf_counter() - t0

    trace = trace_frame(events)
    per_req = request_metrics(trace)
    summary: dict[str, Any] = {"num_requests": len(reqs), "completed": per_req.height,
                               "failed": sum(1 for r in results if not r.get("ok")), "duration_s": duration}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        summary.update(percentile_columns(per_req, metric))
    from llminfer.benchmark.metrics import itl_ms

    summary.update(percentile_columns(pl.DataFrame({"itl_ms": itl_ms(trace)}), "itl_ms"))
    out_tokens = int(per_req["output_tokens"].sum()) if per_req.height else 0
    good = per_req.filter((pl.col("ttft_ms") <= cfg.slo_ttft_ms)
                          & (pl.col("tpot_ms").fill_null(0.0) <= cfg.slo_tpot_ms)).height if per_req.height else 0
    summary.update(output_tokens=out_tokens, output_tokens_per_s=out_tokens / duration,
                   requests_per_s=per_req.height / duration, goodput_requests_per_s=good / duration,
                   slo_ttft_ms=cfg.slo_ttft_ms, slo_tpot_ms=cfg.slo_tpot_ms)
    tpot = dict(zip(per_req["request_id"].to_list(), per_req["tpot_ms"].to_list())) if per_req.height else {}
    for r in results:
        r["tpot_ms"] = tpot.get(r.get("request_id"))
    settings = {"base_url": cfg.base_url, "model": model, "endpoint": cfg.endpoint, "num_requests": len(reqs),
                "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate,
                "concurrency": cfg.concurrency, "prompt_len": list(workload.prompt_len),
                "output_len": list(workload.output_len), "prompts_file": workload.prompts_file,
                "seed": workload.seed, "extra_body": cfg.extra_body}
    return ServingResult(results, summary, settings, environment())


def run_serving_benchmark_sync(cfg: ServingConfig, workload: ServingWorkload) -> ServingResult:
    """Synchronous wrapper of :func:`run_serving_benchmark` (runs its own event loop)."""
    return anyio.run(run_serving_benchmark, cfg, workload)
