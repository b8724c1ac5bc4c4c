"""Metrics as polars expressions over stage traces.

A trace is a frame with one row per event: ``request_id``, ``stage``, ``event``, ``t_ns`` (monotonic
nanoseconds), ``n_tokens``. :func:`request_metrics` reduces it to one row per request; every column is
a polars expression over the events of that request:

* ``ttft_ms``: arrival → first generated token delivered by the sink (never a role-only or empty chunk);
* ``e2e_ms``: arrival → final delta;
* ``tpot_ms``: ``(e2e - ttft) / (output_tokens - 1)`` (mean time per output token after the first);
* ``queue_ms``: queued at the scheduler → first scheduled;
* ``prefill_ms``: first scheduled → prompt computed (first token sampled);
* ``decode_ms``: prompt computed → finished;
* ``output_tokens``: tokens actually delivered (not requested), ``prompt_tokens``, ``cached_tokens``.

:func:`itl_ms` gives inter-token latencies (gaps between consecutive token deliveries of a request) and
:func:`summarize` the aggregate figures: percentiles, output / total token throughput over the wall
interval the requests span, request throughput, prefix-cache hit rates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import polars as pl

from llminfer.trace import STEP, TraceEvent

SCHEMA = {"request_id": pl.Utf8, "stage": pl.Utf8, "event": pl.Utf8, "t_ns": pl.Int64, "n_tokens": pl.Int64}
PERCENTILES = (0.5, 0.95, 0.99)


def trace_frame(events: Iterable[TraceEvent | Sequence[Any]]) -> pl.DataFrame:
    """Events (``Tracer.snapshot()``) → a polars frame with the trace schema."""
    rows = [tuple(e) for e in events]
    return pl.DataFrame(rows, schema=SCHEMA, orient="row")


def _first(event: str, stage: str | None = None) -> pl.Expr:
    cond = pl.col("event") == event
    if stage is not None:
        cond = cond & (pl.col("stage") == stage)
    return pl.col("t_ns").filter(cond).min()


def _tokens(event: str, stage: str) -> pl.Expr:
    return pl.col("n_tokens").filter((pl.col("event") == event) & (pl.col("stage") == stage))


def request_metrics(trace: pl.DataFrame) -> pl.DataFrame:
    """One row per request that finished, with the metrics listed in the module docstring (ms)."""
    ms = 1e6
    per_req = (
        trace.filter(pl.col("request_id") != STEP)
        .group_by("request_id")
        .agg(
            arrival=_first("arrived"),
            queued=_first("queued"),
            first_scheduled=_first("first_scheduled"),
            prefill_done=_first("prefill_done"),
            first_token=_first("first_token", "sink"),
            end=pl.col("t_ns").filter((pl.col("event") == "finished") & (pl.col("stage") == "sink")).max(),
            output_tokens=_tokens("first_token", "sink").sum() + _tokens("token", "sink").sum(),
            prompt_tokens=_tokens("queued", "scheduler").first(),
            cached_tokens=_tokens("first_scheduled", "scheduler").first(),
        )
        .filter(pl.col("end").is_not_null())
    )
    start = pl.coalesce("arrival", "queued")
    return per_req.with_columns(
        ttft_ms=(pl.col("first_token") - start) / ms,
        e2e_ms=(pl.col("end") - start) / ms,
        queue_ms=(pl.col("first_scheduled") - pl.col("queued")) / ms,
        prefill_ms=(pl.col("prefill_done") - pl.col("first_scheduled")) / ms,
        decode_ms=(pl.col("end") - pl.col("prefill_done")) / ms,
    ).with_columns(
        tpot_ms=pl.when(pl.col("output_tokens") > 1)
        .then((pl.col("e2e_ms") - pl.col("ttft_ms")) / (pl.col("output_tokens") - 1))
        .otherwise(None),
    ).sort("arrival", nulls_last=True)


def itl_ms(trace: pl.DataFrame) -> pl.Series:
    """Inter-token latencies (ms): gaps between consecutive token deliveries of the same request."""
    tokens = (
        trace.filter((pl.col("stage") == "sink") & pl.col("event").is_in(["first_token", "token"]))
        .sort("request_id", "t_ns")
        .with_columns(gap=pl.col("t_ns").diff().over("request_id"))
    )
    return (tokens["gap"].drop_nulls() / 1e6).alias("itl_ms")


def percentile_columns(frame: pl.DataFrame, column: str, prefix: str | None = None) -> dict[str, float | None]:
    """``{prefix_p50, prefix_p95, prefix_p99, prefix_mean}`` of a metric column (None when empty)."""
    prefix = prefix or column
    col = frame[column].drop_nulls()
    out: dict[str, float | None] = {}
    for q in PERCENTILES:
        out[f"{prefix}_p{int(q * 100)}"] = float(col.quantile(q, interpolation="linear")) if len(col) else None
    out[f"{prefix}_mean"] = float(col.mean()) if len(col) else None  # type: ignore[arg-type]
    return out


def summarize(trace: pl.DataFrame) -> dict[str, Any]:
    """Aggregate figures of a trace: latency percentiles (ms), throughput (tokens/s, requests/s) over
    the span from the first arrival to the last finish, and prefix-cache hit rates."""
    per_req = request_metrics(trace)
    out: dict[str, Any] = {"num_requests": per_req.height}
    if per_req.height == 0:
        return out
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms"):
        out.update(percentile_columns(per_req, metric))
    itl = itl_ms(trace)
    out.update(percentile_columns(pl.DataFrame({"itl_ms": itl}), "itl_ms"))
    start = per_req.select(pl.coalesce("arrival", "queued").min()).item()
    span_s = (per_req["end"].max() - start) / 1e9
    generated = int(per_req["output_tokens"].sum())
    prompt = int(per_req["prompt_tokens"].fill_null(0).sum())
    cached = int(per_req["cached_tokens"].fill_null(0).sum())
    out.update(
        span_s=span_s,
        output_tokens=generated,
        prompt_tokens=prompt,
        output_tokens_per_s=generated / span_s if span_s > 0 else None,
        total_tokens_per_s=(generated + prompt) / span_s if span_s > 0 else None,
        requests_per_s=per_req.height / span_s if span_s > 0 else None,
        prefix_cache_hit_rate=float((per_req["cached_tokens"].fill_null(0) > 0).mean()),
        prefix_cache_token_hit_rate=cached / prompt if prompt else 0.0,
    )
    return out
