"""/metrics: vLLM-named Prometheus metrics fed by the engine's step statistics, on a live loopback server.

Counters must move for finished, aborted (client gone mid-stream) and refused requests alike, histograms get
samples, KV usage goes back to 0; the text parses with prometheus_client's parser and passes
``promtool check metrics``; every metric the shipped Grafana dashboard queries exists.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_until
from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread
from llminfer.api.metrics import StepHistogram
from llminfer.config import Backend

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "llminfer_dashboard.json"
COMPLETIONS = "/v1/completions"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = ("promtool is not installed: no PyPI package ships it; Debian's `prometheus` package does "
               "(apt-get install prometheus)")


class Scrape:
    """One parsed /metrics response."""

    def __init__(self, url: str) -> None:
        r = httpx.get(url + "/metrics", timeout=30)
        # Prometheus' text format, the charset once (a scraper's parser reads the header)
        assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        self.text = r.text
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def __call__(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    @property
    def sample_names(self) -> set[str]:
        return {s.name for s in self.samples}


@pytest.fixture(scope="module")
def server():
    # One running request at a time and no queue: a second request while one streams gets a 429.
    engine = InferenceEngine(EngineConfig(max_batch_size=1, batch_timeout_ms=0, max_model_len=256))
    app = create_app(engine, served_model_name="tiny", max_queue_size=0)
    with serve_in_thread(app) as url:
        yield url, engine


def _stream_then_hang_up(url: str, min_chunks: int, while_open=None, **body) -> int:
    """Stream a completion, read ``min_chunks`` chunks with text, call ``while_open()``, then close the
    connection mid-stream. Returns the number of text chunks read."""
    seen = 0
    with httpx.Client(base_url=url, timeout=60) as c, c.stream(
            "POST", COMPLETIONS, json={"model": "tiny", "stream": True, "ignore_eos": True, **body}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped line iterator would close the connection at once
        while seen < min_chunks:
            line = next(lines)
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                seen += 1
        if while_open is not None:
            while_open()
    return seen


def test_counters_move_for_finished_aborted_and_refused(server):
    url, engine = server
    before = Scrape(url)
    prompt_ids = [11, 12, 13, 14, 15]

    # Finished: 3 tokens, finish reason length.
    r = httpx.post(url + COMPLETIONS, json={"model": "tiny", "prompt": prompt_ids, "max_tokens": 3,
                                            "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    done = Scrape(url)
    assert done("llminfer_request_success_total", finished_reason="length") == \
        before("llminfer_request_success_total", finished_reason="length") + 1
    assert done("llminfer_prompt_tokens_total") == before("llminfer_prompt_tokens_total") + len(prompt_ids)
    assert done("llminfer_generation_tokens_total") == before("llminfer_generation_tokens_total") + 3
    assert done("llminfer_prefix_cache_queries_total") >= before("llminfer_prefix_cache_queries_total") + 5
    for hist, n in (("time_to_first_token_seconds", 1), ("inter_token_latency_seconds", 2),
                    ("time_per_output_token_seconds", 2), ("request_time_per_output_token_seconds", 1),
                    ("e2e_request_latency_seconds", 1), ("request_queue_time_seconds", 1),
                    ("request_prefill_time_seconds", 1), ("request_decode_time_seconds", 1),
                    ("request_prompt_tokens", 1), ("request_generation_tokens", 1)):
        name = f"llminfer_{hist}_count"
        assert done(name) == before(name) + n, name
        assert done(f"llminfer_{hist}_bucket", le="+Inf") == done(name), name
    assert done("llminfer_request_generation_tokens_sum") == before("llminfer_request_generation_tokens_sum") + 3

    # Aborted mid-stream: its tokens count as they were generated; while it runs, KV usage is above 0 and a
    # second request is refused with a 429 (max_batch_size 1, queue 0).
    during: dict[str, object] = {}

    def while_open() -> None:
        during["scrape"] = Scrape(url)
        during["429"] = httpx.post(url + COMPLETIONS, json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                                   timeout=60).status_code

    seen = _stream_then_hang_up(url, 2, while_open, prompt="Hello there", max_tokens=200)
    engine.wait_drained()
    assert wait_until(lambda: Scrape(url)("llminfer_request_success_total", finished_reason="abort")
                      == done("llminfer_request_success_total", finished_reason="abort") + 1, timeout_s=10)
    after = Scrape(url)
    mid = during["scrape"]
    assert during["429"] == 429
    assert mid("llminfer_num_requests_running") == 1
    assert 0 < mid("llminfer_kv_cache_usage_perc") <= 1
    assert mid("llminfer_kv_blocks_used") > 0
    assert after("llminfer_generation_tokens_total") >= done("llminfer_generation_tokens_total") + seen
    assert after("llminfer_time_to_first_token_seconds_count") == done("llminfer_time_to_first_token_seconds_count") + 1
    # An aborted request's latency says nothing about the server: no e2e sample.
    assert after("llminfer_e2e_request_latency_seconds_count") == done("llminfer_e2e_request_latency_seconds_count")
    assert after("llminfer_requests_rejected_total", reason="rate_limit_exceeded") == \
        done("llminfer_requests_rejected_total", reason="rate_limit_exceeded") + 1

    # Refused with a 400 before admission: counted as rejected, the engine never saw it.
    r = httpx.post(url + COMPLETIONS, json={"model": "tiny", "prompt": "Hi", "temperature": -1}, timeout=30)
    assert r.status_code == 400
    final = Scrape(url)
    assert final("llminfer_requests_rejected_total") == after("llminfer_requests_rejected_total") + 1
    assert final("llminfer_request_success_total") == after("llminfer_request_success_total")

    # Everything finished: nothing running or waiting, every KV block free.
    assert final("llminfer_num_requests_running") == 0 and final("llminfer_num_requests_waiting") == 0
    assert final("llminfer_kv_cache_usage_perc") == 0 and final("llminfer_kv_blocks_used") == 0
    assert final("llminfer_kv_blocks_capacity") == engine.cache_stats()["blocks_total"]


def test_exposition_follows_the_naming_rules(server):
    url, _ = server
    scrape = Scrape(url)
    kinds = {name: f.type for name, f in scrape.families.items()}
    assert all(name.startswith("llminfer_") for name in kinds)
    assert kinds["llminfer_kv_cache_usage_perc"] == "gauge"
    assert kinds["llminfer_num_requests_running"] == kinds["llminfer_num_requests_waiting"] == "gauge"
    for counter in ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                    "prefix_cache_queries", "prefix_cache_hits", "requests_rejected"):
        assert kinds[f"llminfer_{counter}"] == "counter", counter
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert kinds[f"llminfer_{hist}"] == "histogram", hist
    for name, kind in kinds.items():
        if kind != "counter":
            assert not name.endswith("_total"), name


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_accepts_metrics_and_dashboard_queries(server, tmp_path):
    url, _ = server
    httpx.post(url + COMPLETIONS, json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, timeout=60)
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=Scrape(url).text, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    # Every dashboard query is valid PromQL (checked as recording rules, Grafana's variables filled in).
    rules = [{"record": f"llminfer:dashboard_{i}", "expr": _fill(expr)} for i, expr in enumerate(_dashboard_exprs())]
    path = tmp_path / "rules.json"  # JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dash["panels"] for t in panel.get("targets", [])]


def _fill(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$model_name", ".*")


def test_dashboard_queries_only_metrics_the_server_exposes(server):
    url, _ = server
    exposed = Scrape(url).sample_names
    exprs = _dashboard_exprs()
    dash = json.loads(DASHBOARD.read_text())
    exprs.append(dash["templating"]["list"][1]["query"]["query"])
    used = {name for e in exprs for name in re.findall(r"\bllminfer_[A-Za-z0-9_]+", e)}
    missing = sorted(used - exposed)
    assert not missing, f"the dashboard queries metrics /metrics does not expose: {missing}"
    families = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    key = {"llminfer_kv_cache_usage_perc", "llminfer_num_requests_running", "llminfer_num_requests_waiting",
           "llminfer_time_to_first_token_seconds", "llminfer_inter_token_latency_seconds",
           "llminfer_e2e_request_latency_seconds", "llminfer_request_queue_time_seconds",
           "llminfer_num_preemptions", "llminfer_prefix_cache_hits", "llminfer_prefix_cache_queries",
           "llminfer_prompt_tokens", "llminfer_generation_tokens", "llminfer_request_success",
           "llminfer_requests_rejected"}
    assert key <= families, sorted(key - families)


class BrokenLogger:
    calls = 0

    def record(self, stats) -> None:
        self.calls += 1
        raise RuntimeError("simulated stat logger bug")


def test_vllm_backend_feeds_the_same_metrics(fake_vllm):
    engine = InferenceEngine(EngineConfig(backend=Backend.VLLM, batch_timeout_ms=0))
    broken = BrokenLogger()
    engine.stat_loggers.append(broken)  # before the server's own: a failing logger must not stop the others
    with serve_in_thread(create_app(engine, served_model_name="tiny")) as url:
        prompt = [21, 22, 23, 24, 25, 26]
        r = httpx.post(url + COMPLETIONS, json={"model": "tiny", "prompt": prompt, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        done = Scrape(url)
        assert done("llminfer_request_success_total", finished_reason="length") == 1
        assert done("llminfer_prompt_tokens_total") == len(prompt)
        assert done("llminfer_generation_tokens_total") == 4
        assert done("llminfer_prefix_cache_queries_total") == len(prompt)
        assert done("llminfer_prefix_cache_hits_total") == 4  # FakeVLLM reports 4 cached tokens
        assert done("llminfer_prefix_cache_hit_rate") == pytest.approx(4 / len(prompt))
        assert done("llminfer_time_to_first_token_seconds_count") == 1
        assert done("llminfer_inter_token_latency_seconds_count") == 3
        assert done("llminfer_e2e_request_latency_seconds_count") == 1
        assert done("llminfer_request_queue_time_seconds_count") == 0  # not in vLLM's public output
        seen = _stream_then_hang_up(url, 3, prompt="Hello", max_tokens=2000)
        engine.wait_drained()
        assert wait_until(lambda: Scrape(url)("llminfer_request_success_total", finished_reason="abort") == 1,
                          timeout_s=10)
        after = Scrape(url)
        assert after("llminfer_generation_tokens_total") >= 4 + seen
        assert after("llminfer_num_requests_running") == 0
        assert "llminfer_kv_cache_usage_perc" not in after.sample_names  # vLLM's pool is its own
    assert broken.calls == 1 and broken not in engine.stat_loggers  # logged once, then dropped


def test_step_histogram_counts_and_inclusive_bounds():
    h = StepHistogram(("x_seconds", "y_seconds"), "doc", (0.1, 1.0), ("model_name",), ("m",))
    h.observe(0.1, 3)  # on a bound: counted in that bucket (le is inclusive)
    h.observe(0.5)
    h.observe(5.0, 2)
    families = list(h.collect())
    assert [f.name for f in families] == ["x_seconds", "y_seconds"]
    samples = {(s.name, s.labels.get("le")): s.value for s in families[0].samples}
    assert samples[("x_seconds_bucket", "0.1")] == 3
    assert samples[("x_seconds_bucket", "1.0")] == 4
    assert samples[("x_seconds_bucket", "+Inf")] == 6
    assert samples[("x_seconds_count", None)] == 6
    assert samples[("x_seconds_sum", None)] == pytest.approx(0.3 + 0.5 + 10.0)


def test_scheduler_iteration_stats_count_tokens_preemptions_and_prefix_hits():
    """Engine signals without a model: a pool sized to force a preemption (as in test_prefix_cache)."""
    from llminfer.core.scheduler import Scheduler, SchedulerLimits
    from llminfer.kv.manager import KVCacheManager
    from llminfer.protocols.messages import StepOutput, TokenizedRequest
    from llminfer.sampling.params import SamplingParams

    kv = KVCacheManager(num_blocks=12, block_size=2)
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_batched_tokens=64, max_model_len=1000,
                                      watermark=0.0), kv)
    for rid, first in (("a", 10), ("b", 40)):
        sched.add_request(TokenizedRequest(rid, tuple(range(first, first + 8)), SamplingParams(max_new_tokens=12), 1))
    totals = {"prompt": 0, "generated": 0, "ttft": 0, "itl": 0, "preempted": 0, "queries": 0, "hits": 0}
    for _ in range(200):
        plan, _ = sched.schedule()
        sampled = {s.request_id: 7 for s in plan.sequences if s.sample}
        sched.update_from_output(plan, StepOutput(plan.step_id, sampled, 0, 0))
        it = sched.take_iteration_stats()
        totals["prompt"] += it.num_prompt_tokens
        totals["generated"] += it.num_generation_tokens
        totals["ttft"] += len(it.time_to_first_tokens_s)
        totals["itl"] += sum(it.inter_token_ns.values())
        totals["preempted"] += it.num_preemptions
        totals["queries"] += it.prefix_cache_queries
        totals["hits"] += it.prefix_cache_hits
        if not sched.has_unfinished():
            break
    assert totals["preempted"] == sched.num_preemptions > 0
    assert totals["prompt"] == 16 and totals["ttft"] == 2  # each prompt once, whatever the preemptions
    assert totals["generated"] == 24 and totals["itl"] == 22  # one token per step per request
    assert totals["queries"] == kv.query_tokens and totals["hits"] == kv.hit_tokens > 0
    assert sched.take_iteration_stats().num_generation_tokens == 0  # taken: a fresh record
