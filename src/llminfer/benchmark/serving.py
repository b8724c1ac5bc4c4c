"""Serving benchmark: a load generator for any OpenAI-compatible server (llminfer, vLLM, TGI, ...).

Requests are streamed (``stream: true``) so every token's arrival is timed on the client. Arrivals follow
a Poisson process at ``request_rate`` requests/s (``inf``: all at once), optionally capped at
``concurrency`` requests in flight. The client's timestamps become a trace in the engine's own schema
(``arrived`` → ``first_token`` → ``token``... → ``finished``), so TTFT / TPOT / ITL / E2E come from the
same polars expressions as offline benchmarks. TTFT is taken at the first chunk that carries text — a
chat stream's role-only first chunk does not count. Goodput counts the requests per second that met both
SLOs (``slo_ttft_ms``, ``slo_tpot_ms``).

A sweep (:func:`run_serving_sweep`) sends the same requests once per load point (several request rates, or
several concurrencies) and records the server (:func:`probe_server`: base URL, model, kind, version) and the
workload, so that :mod:`llminfer.benchmark.report` can put several servers' artifacts side by side.

The workload, the target and the load points are :mod:`llminfer.benchmark.serving_load`'s; the server probe
and the client's environment :mod:`llminfer.benchmark.serving_probe`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import polars as pl

from llminfer.benchmark import artifacts
from llminfer.benchmark.metrics import itl_ms, percentile_columns, request_metrics, trace_frame
from llminfer.benchmark.serving_load import LoadPoint, ServingConfig, ServingWorkload
from llminfer.benchmark.serving_probe import client_environment, probe_server


@attrs.define
class ServingResult:
    """Per-request client measurements and their summary."""

    requests: list[dict[str, Any]]
    summary: dict[str, Any]
    settings: dict[str, Any]
    environment: dict[str, Any]
    server: dict[str, Any] = attrs.field(factory=dict)  #: what :func:`probe_server` found

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
                "server": self.server, "summary": self.summary, "requests": self.requests}

    def save_artifacts(self, directory: str | Path = ".", json_out: str | Path | None = None,
                       csv_out: str | Path | None = None) -> dict[str, Path]:
        """``serving.json`` (everything) and ``serving.csv`` (one row per request)."""
        return artifacts.write(self.to_json_dict(), pl.DataFrame(self.requests), directory, "serving", json_out,
                               csv_out)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:8.1f}"

def _error_text(body: bytes, limit: int = 200) -> str:
    """A failed response's body for the error column: the OpenAI error object's ``message`` when the body is
    one (``{"error": {"message": ...}}``), else the text itself, cut to ``limit`` characters."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:limit]
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:limit]
    if isinstance(err, str):
        return err[:limit]
    return text[:limit]


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
                error = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
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


@attrs.define
class SweepProgress:
    """What a progress callback is told after each finished request (and once when a point starts)."""

    point_index: int  #: 0-based
    num_points: int
    point: LoadPoint
    done: int  #: requests finished at this point (failed ones included)
    total: int
    failed: int
    in_flight: int


ProgressFn = Callable[[SweepProgress], None]


@attrs.define
class ServingSweepResult:
    """A sweep: the server, the workload and one :class:`ServingResult` per load point.

    ``to_json_dict()`` is the ``serving.json`` artifact (schema version 2, ``schemas/serving.schema.json``)
    that ``llminfer bench-report`` combines across servers.
    """

    server: dict[str, Any]
    workload: dict[str, Any]
    settings: dict[str, Any]
    environment: dict[str, Any]
    points: list[ServingResult]
    created: str  #: ISO 8601 UTC, when the sweep started

    def table(self) -> pl.DataFrame:
        """One row per load point: ``request_rate`` (None: inf), ``concurrency`` and the point's summary."""
        return pl.DataFrame([{**p.settings["load"], **p.summary} for p in self.points], infer_schema_length=None)

    def to_json_dict(self) -> dict[str, Any]:
        return {"schema_version": 2, "kind": "serving", "created": self.created, "server": self.server,
                "workload": self.workload, "settings": self.settings, "environment": self.environment,
                "points": [{"load": p.settings["load"], "summary": p.summary, "requests": p.requests}
                           for p in self.points]}

    def print_summary(self) -> str:
        """Print (and return) the summary: the single point's figures, or a table of the sweep."""
        if len(self.points) == 1:
            return self.points[0].print_summary()
        from llminfer.benchmark.report import default_label, format_table, point_rows

        text = format_table(point_rows(self.to_json_dict(), default_label(self.server)))
        print(text)
        return text

    def save_artifacts(self, directory: str | Path = ".", json_out: str | Path | None = None,
                       csv_out: str | Path | None = None) -> dict[str, Path]:
        """``serving.json`` (everything, every request) and ``serving.csv`` (one row per load point)."""
        return artifacts.write(self.to_json_dict(), self.table(), directory, "serving", json_out, csv_out)

    def write(self, json_path: str | Path | None = None, csv_path: str | Path | None = None) -> dict[str, Path]:
        """Write only the files asked for: the JSON artifact and / or the per-load-point CSV.

        Raises:
            OSError: a folder cannot be created or a file written.
        """
        return artifacts.write_files(self.to_json_dict(), self.table(), json_path, csv_path)


def _workload_dict(cfg: ServingConfig, workload: ServingWorkload, reqs: list[tuple[str, int]]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:16]
    return {"endpoint": cfg.endpoint, "num_requests": len(reqs), "prompt_len": list(workload.prompt_len),
            "output_len": list(workload.output_len), "prompts_file": workload.prompts_file, "seed": workload.seed,
            "extra_body": cfg.extra_body, "fingerprint": digest,
            "prompt_words_total": sum(len(p.split()) for p, _ in reqs), "max_tokens_total": sum(n for _, n in reqs)}


async def _run_point(client: Any, cfg: ServingConfig, model: str, reqs: list[tuple[str, int]], seed: int,
                     point: LoadPoint, report: Callable[[int, int, int], None] | None) -> tuple:
    events: list[tuple] = []
    rng = random.Random(seed + 1)  # the same arrival pattern (scaled) at every rate
    sem = anyio.Semaphore(point.concurrency) if point.concurrency else None
    results: list[dict[str, Any]] = [{} for _ in reqs]
    counts = {"done": 0, "failed": 0, "in_flight": 0}

    async def fire(i: int, prompt: str, max_tokens: int) -> None:
        async with (sem if sem is not None else contextlib.nullcontext()):
            counts["in_flight"] += 1
            try:
                results[i] = await _one(client, cfg, model, prompt, max_tokens, f"req-{i}", events)
            finally:
                counts["in_flight"] -= 1
                counts["done"] += 1
                counts["failed"] += not results[i].get("ok")
                if report:
                    report(counts["done"], counts["failed"], counts["in_flight"])

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, (prompt, max_tokens) in enumerate(reqs):
            tg.start_soon(fire, i, prompt, max_tokens)
            if math.isfinite(point.request_rate) and point.request_rate > 0:
                await anyio.sleep(rng.expovariate(point.request_rate))
    return events, results, time.perf_counter() - t0


def _summarize(cfg: ServingConfig, events: list[tuple], results: list[dict[str, Any]],
               duration: float) -> dict[str, Any]:
    trace = trace_frame(events)
    per_req = request_metrics(trace)
    summary: dict[str, Any] = {"num_requests": len(results), "completed": per_req.height,
                               "failed": sum(1 for r in results if not r.get("ok")), "duration_s": duration}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        summary.update(percentile_columns(per_req, metric))
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
    return summary


async def run_serving_sweep(cfg: ServingConfig, workload: ServingWorkload, points: Sequence[LoadPoint],
                            progress: ProgressFn | None = None) -> ServingSweepResult:
    """Send the same workload once per load point, one point after the other, and measure each.

    ``cfg.request_rate`` / ``cfg.concurrency`` are ignored: the points say the load. ``progress`` (if
    given) is called when a point starts and after every finished request.

    Raises:
        httpx.HTTPError: the server cannot be reached to list its models (when ``cfg.model`` is None).
        ValueError: no points, the server lists no model, or a malformed prompts file.
    """
    import httpx

    if not points:
        raise ValueError("no load points to run")
    reqs = workload.requests()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    most = max((p.concurrency or len(reqs)) for p in points)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=most, max_keepalive_connections=most)
    results: list[ServingResult] = []
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        server = {"label": cfg.label, **await probe_server(client, cfg.base_url, cfg.model)}
        model = server["model"]
        for i in range(cfg.warmup_requests):
            prompt, max_tokens = reqs[i % len(reqs)]
            await _one(client, cfg, model, prompt, max_tokens, f"warmup-{i}", [])
        for index, point in enumerate(points):
            def report(done: int, failed: int, in_flight: int, index: int = index, point: LoadPoint = point) -> None:
                if progress is not None:
                    progress(SweepProgress(index, len(points), point, done, len(reqs), failed, in_flight))

            report(0, 0, 0)
            events, per_request, duration = await _run_point(client, cfg, model, reqs, workload.seed, point, report)
            summary = _summarize(cfg, events, per_request, duration)
            settings = {"base_url": cfg.base_url, "model": model, "endpoint": cfg.endpoint,
                        "num_requests": len(reqs), "request_rate": point.to_json()["request_rate"],
                        "concurrency": point.concurrency, "prompt_len": list(workload.prompt_len),
                        "output_len": list(workload.output_len), "prompts_file": workload.prompts_file,
                        "seed": workload.seed, "extra_body": cfg.extra_body, "load": point.to_json()}
            results.append(ServingResult(per_request, summary, settings, {}, server))
    env = client_environment()
    for r in results:
        r.environment = env
    sweep_settings = {"endpoint": cfg.endpoint, "slo_ttft_ms": cfg.slo_ttft_ms, "slo_tpot_ms": cfg.slo_tpot_ms,
                      "timeout_s": cfg.timeout_s, "warmup_requests": cfg.warmup_requests, "extra_body": cfg.extra_body,
                      "points": [p.to_json() for p in points]}
    return ServingSweepResult(server, _workload_dict(cfg, workload, reqs), sweep_settings, env, results, created)


async def run_serving_benchmark(cfg: ServingConfig, workload: ServingWorkload,
                                progress: ProgressFn | None = None) -> ServingResult:
    """Send the workload at ``cfg.request_rate`` / ``cfg.concurrency`` and measure it (one load point).

    Raises:
        httpx.HTTPError: the server cannot be reached to list its models (when ``cfg.model`` is None).
    """
    sweep = await run_serving_sweep(cfg, workload, [LoadPoint(cfg.request_rate, cfg.concurrency)], progress)
    return sweep.points[0]


def run_serving_benchmark_sync(cfg: ServingConfig, workload: ServingWorkload) -> ServingResult:
    """Synchronous wrapper of :func:`run_serving_benchmark` (runs its own event loop)."""
    return anyio.run(run_serving_benchmark, cfg, workload)


def run_serving_sweep_sync(cfg: ServingConfig, workload: ServingWorkload, points: Sequence[LoadPoint],
                           progress: ProgressFn | None = None) -> ServingSweepResult:
    """Synchronous wrapper of :func:`run_serving_sweep` (runs its own event loop)."""
    return anyio.run(run_serving_sweep, cfg, workload, list(points), progress)
