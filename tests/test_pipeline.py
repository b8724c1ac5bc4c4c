"""Programmatic composition: a pipeline assembled from public stages with user stages in it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import anyio
import pytest

from helpers import make_engine
from llminfer import Pipeline
from llminfer.models import builtin_model_path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load_example():
    spec = importlib.util.spec_from_file_location("custom_pipeline", EXAMPLES / "custom_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_pipeline"] = module
    spec.loader.exec_module(module)
    return module


def test_user_stages_filter_and_record(tmp_path):
    ex = _load_example()
    engine = make_engine(builtin_model_path(), max_batch_size=4)
    plain = {p: engine.run(p, max_new_tokens=10).generated_text for p in ("Hello there", "Paged")}
    out = tmp_path / "deltas.jsonl"
    pipeline = engine.build_pipeline(after_detokenize=[ex.RedactStage(), ex.JsonlRecorder(out)])

    async def go():
        async with pipeline:
            return await ex.generate_all(pipeline, list(plain), 10)

    texts = anyio.run(go)
    for prompt, text in plain.items():
        redacted = "".join("*" if ch in "aeiouAEIOU" else ch for ch in text)
        assert texts[prompt] == redacted
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(len(r["token_ids"]) for r in rows) == 20
    assert sum(1 for r in rows if r["finish_reason"]) == 2
    assert engine.cache_stats()["blocks_used"] == 0


def test_example_script_runs(tmp_path):
    ex = _load_example()
    texts = ex.main(str(tmp_path / "out.jsonl"), 4)
    assert len(texts) == 2


def test_pipeline_rejects_bad_assembly():
    engine = make_engine(builtin_model_path())
    stages = engine.default_stages()
    with pytest.raises(ValueError, match="SchedulerStage"):
        Pipeline([stages["tokenize"], stages["sink"]], step=stages["step"])
    with pytest.raises(ValueError, match="sink"):
        Pipeline([stages["tokenize"], stages["scheduler"], stages["detokenize"]], step=stages["step"])


def test_broken_user_stage_fails_requests_instead_of_hanging():
    engine = make_engine(builtin_model_path())

    class Broken:
        name = "broken"

        async def run(self, inbox, outbox):
            async with outbox:
                async for _ in inbox:
                    raise RuntimeError("boom")

    ex = _load_example()
    pipeline = engine.build_pipeline(after_detokenize=[Broken()])

    async def go():
        with anyio.fail_after(10):
            async with pipeline:
                await ex.generate_all(pipeline, ["x"], 4)

    anyio.run(go)  # the request ends (with an error delta) rather than hanging
