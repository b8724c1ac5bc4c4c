"""Load on loopback: 300 streaming requests from 64 concurrent clients, a fifth of them hanging up at a
random point. No 5xx, every other request ends with the right finish reason and usage, and afterwards
nothing is running and every KV block is free."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_until
from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread

NUM_REQUESTS = 300
CONCURRENCY = 64
TIME_LIMIT_S = 240.0


@pytest.fixture(scope="module")
def served():
    engine = InferenceEngine(EngineConfig(max_batch_size=32, batch_timeout_ms=2))
    app = create_app(engine)
    with serve_in_thread(app) as url:
        yield url, app, engine


def _job(i: int) -> dict:
    rng = random.Random(i)
    max_tokens = rng.randint(8, 24)
    chat = rng.random() < 0.5
    body: dict = {"model": "llminfer/tiny-qwen2", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "tea", "code"]) for _ in range(rng.randint(1, 30)))
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    hang_up_after = None
    if i % 5 == 0:
        # A hang-up job asks for far more tokens than it reads: the server notices the hang-up long before
        # it could finish, so every one of them must be counted as aborted.
        hang_up_after = rng.randint(1, 8)
        max_tokens = body["max_tokens"] = 1000
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body, "chat": chat,
            "max_tokens": max_tokens, "hang_up_after": hang_up_after}


async def _one(client: httpx.AsyncClient, job: dict) -> dict:
    events: list = []
    async with client.stream("POST", job["path"], json=job["body"]) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": (await r.aread()).decode()}
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if job["hang_up_after"] is not None and len(events) >= job["hang_up_after"]:
                break  # leaving the block closes the connection mid-stream
    return {"status": r.status_code, "events": events}


async def _run_all(url: str) -> list[dict]:
    jobs = [_job(i) for i in range(NUM_REQUESTS)]
    results: list = [None] * len(jobs)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(jobs)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await _one(client, jobs[i])

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CONCURRENCY))), TIME_LIMIT_S)
    return [dict(r, job=j) for r, j in zip(results, jobs)]


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


def test_load_with_disconnects(served):
    url, app, engine = served
    t0 = time.perf_counter()
    results = asyncio.run(_run_all(url))
    elapsed = time.perf_counter() - t0
    assert all(r["status"] < 500 for r in results), [r for r in results if r["status"] >= 500][:3]
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    completed = [r for r in results if r["job"]["hang_up_after"] is None]
    assert len(completed) == NUM_REQUESTS - NUM_REQUESTS // 5
    for r in completed:
        events, job = r["events"], r["job"]
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert not any("error" in c for c in chunks)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes.count("length") == 1 and finishes[-1] == "length"
        assert finishes.count(None) == len(finishes) - 1
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == job["max_tokens"]
        if job["chat"]:
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # Afterwards: nothing running, nothing queued, every KV block free.
    state = app.state["llminfer"]
    engine.wait_drained()
    assert engine.scheduler_stats()["running"] == 0
    assert engine.cache_stats()["blocks_used"] == 0
    assert wait_until(lambda: state.in_flight == 0, timeout_s=10)  # the server's own admission count
    assert _metric(url, "llminfer_num_requests_running") == 0
    assert _metric(url, "llminfer_num_requests_waiting") == 0
    assert _metric(url, "llminfer_kv_blocks_used") == 0
    assert _metric(url, "llminfer_kv_cache_usage_perc") == 0
    aborted = _metric(url, "llminfer_request_success_total", finished_reason="abort")
    finished = _metric(url, "llminfer_request_success_total", finished_reason="length")
    assert aborted == NUM_REQUESTS // 5
    assert finished == NUM_REQUESTS - NUM_REQUESTS // 5
    assert httpx.get(url + "/healthz").status_code == 200
    print(f"\n{NUM_REQUESTS} streams, {CONCURRENCY} clients: {elapsed:.1f} s, {int(aborted)} aborted by hang-ups")
