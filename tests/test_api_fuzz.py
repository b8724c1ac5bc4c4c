"""Schemathesis fuzzes the server's own OpenAPI document: valid and invalid bodies for every operation,
bounded in count; no response may be a 5xx, and every 4xx must be an OpenAI error object.

The server has a 40-token context so every generated request is cheap to serve (a chat prompt alone is
about 20 tokens, so the rest are 400s or short generations).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from llminfer import EngineConfig, InferenceEngine
from llminfer.api import create_app, serve_in_thread

MAX_EXAMPLES = 25  # per operation and mode (positive, negative): the run is bounded by count, not by time


@pytest.fixture(scope="module")
def fuzz_server():
    engine = InferenceEngine(EngineConfig(max_batch_size=16, batch_timeout_ms=1, max_model_len=40))
    with serve_in_thread(create_app(engine)) as url:
        yield url, engine


def _check(response, case) -> None:
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    # A HEAD response has the status and headers of the GET, and no body.
    if 400 <= response.status_code < 500 and case.path.startswith("/v1/") and case.method.upper() != "HEAD":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


@pytest.mark.slow  # ~8 s on an idle 2-core machine, 35-50 s while benchmarks share the CPU
def test_no_server_errors(fuzz_server):
    url, _ = fuzz_server
    # Schemathesis' own pytest plugin does not load under this pytest; its Hypothesis strategies are used
    # directly instead: every operation of the document, schema-conforming and schema-violating data.
    api_schema = schemathesis.openapi.from_url(url + "/schema/openapi.json")
    operations = [result.ok() for result in api_schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/healthz",
            "/metrics"} <= paths
    calls = 0

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def fuzz(case) -> None:
        nonlocal calls
        calls += 1
        _check(case.call(base_url=url, timeout=60), case)

    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                given(case=op.as_strategy(generation_mode=mode))(fuzz)()
            except Unsatisfiable:
                # Nothing to violate: a GET (or HEAD) with no parameters, or only a free-form string path parameter.
                assert mode is GenerationMode.NEGATIVE and op.method.upper() in ("GET", "HEAD")
    assert calls >= 100


def test_fuzzing_left_nothing_behind(fuzz_server):
    url, engine = fuzz_server
    assert httpx.get(url + "/healthz").status_code == 200
    engine.wait_drained()
    assert engine.scheduler_stats()["running"] == 0 and engine.cache_stats()["blocks_used"] == 0
