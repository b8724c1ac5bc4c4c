"""``dtype="auto"`` on CPU settled by measurement (llminfer.models.dtype_probe), cached, flag rule as fallback."""

from __future__ import annotations

import pytest
import torch

from llminfer import EngineConfig, InferenceEngine
from llminfer import runtime as rt_mod
from llminfer.models import dtype_probe as dp


def test_pick_keeps_the_flag_choice_within_the_tie_margin():
    figs = {"bfloat16": {"cost_ms": 101.0}, "float32": {"cost_ms": 100.0}}
    assert dp.pick(figs, "bfloat16") == "bfloat16"
    figs["bfloat16"]["cost_ms"] = 110.0
    assert dp.pick(figs, "bfloat16") == "float32"
    assert dp.pick({"bfloat16": {"cost_ms": 5.0}, "float32": {"cost_ms": 9.0}}, "bfloat16") == "bfloat16"


def test_cache_round_trip_and_a_broken_file(tmp_path):
    path = tmp_path / "c.json"
    assert dp.cached_choice("k", path) is None
    good = {"choice": "float32", "figures": {"float32": {"prefill_ms": 1, "decode_step_ms": 0.5}}}
    dp.store_choice("k", good, path)
    dp.store_choice("j", {**good, "choice": "bfloat16"}, path)
    assert dp.cached_choice("k", path) == good
    path.write_text("not json")
    assert dp.cached_choice("k", path) is None
    record = {"choice": "bfloat16", "figures": {"bfloat16": {"prefill_ms": 1.0, "decode_step_ms": 0.1}}}
    dp.store_choice("k", record, path)  # a broken file is replaced
    assert dp.cached_choice("k", path) == record


def _store_many(path: str, prefix: str) -> None:
    from pathlib import Path

    for i in range(20):
        dp.store_choice(f"{prefix}{i}", {"choice": "float32", "figures": {}}, Path(path))


def test_concurrent_stores_keep_every_key(tmp_path):
    """Processes and threads storing at once each read, add and replace the file under one lock: no key is lost
    to another's write (without the lock, the later writer drops what the earlier one added since it read)."""
    import multiprocessing
    import threading

    path = tmp_path / "c.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_store_many, args=(str(path), f"p{n}-")) for n in range(2)]
    threads = [threading.Thread(target=_store_many, args=(str(path), f"t{n}-")) for n in range(2)]
    for worker in (*procs, *threads):
        worker.start()
    for worker in (*procs, *threads):
        worker.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs)
    import json

    assert set(json.loads(path.read_text())) == {f"{w}{n}-{i}" for w in "pt" for n in range(2) for i in range(20)}


@pytest.mark.parametrize("record", ["float32", {"choice": "float32"}, {"choice": 3, "figures": {}},
                                    {"choice": "float32", "figures": {"float32": {"prefill_ms": 1.0}}},
                                    {"choice": "float32", "figures": {"float32": "fast"}}])
def test_a_record_of_another_shape_is_measured_again(tmp_path, record):
    path = tmp_path / "c.json"
    dp.store_choice("k", record, path)
    assert dp.cached_choice("k", path) is None


def test_measure_alternates_candidates_and_keeps_each_ones_best():
    calls = []
    times = {torch.bfloat16: iter([(50, 5, 5), (10, 2, 2), (12, 1, 1)]),
             torch.float32: iter([(50, 5, 5), (20, 1, 0.5), (9, 3, 2)])}

    def timer(model, dt, attn, dev):
        calls.append(dt)
        return next(times[dt])

    models, figs = dp.measure_dtypes([torch.bfloat16, torch.float32], lambda dt: (f"m{dt}", "torch"),
                                     torch.device("cpu"), rounds=2, timer=timer)
    assert calls == [torch.bfloat16, torch.float32] * 3  # warm-up round, then 2 alternating rounds
    assert figs["bfloat16"] == {"prefill_ms": 10, "decode_step_ms": 1, "greedy_step_ms": 1,
                                "cost_ms": 10 + dp.DECODE_WEIGHT * 1}
    assert figs["float32"]["prefill_ms"] == 9 and figs["float32"]["decode_step_ms"] == 1
    assert figs["float32"]["greedy_step_ms"] == 0.5  # each time is the best of the rounds on its own
    share = dp.GREEDY_SHARE
    assert figs["float32"]["cost_ms"] == pytest.approx(9 + dp.DECODE_WEIGHT * (share * 0.5 + (1 - share) * 1), abs=0.1)
    assert models[torch.float32] == ("mtorch.float32", "torch")


@pytest.fixture
def half_flags(monkeypatch, tmp_path):
    """The flag rule picks bfloat16 (as on a CPU with native bf16); the cache lives in tmp_path."""
    real = rt_mod.resolve_dtype

    def resolve(cfg, model_config, device, native_half=None, checkpoint=None):
        if cfg.dtype != "auto":
            return real(cfg, model_config, device)
        return torch.bfloat16, "auto: bfloat16 checkpoint, and this CPU computes bfloat16 natively (test)"

    monkeypatch.setattr(rt_mod, "resolve_dtype", resolve)
    monkeypatch.setattr(dp, "cache_path", lambda: tmp_path / "dtype_choice.json")
    monkeypatch.delenv(dp.ENV, raising=False)
    return tmp_path / "dtype_choice.json"


def test_auto_measures_keeps_the_faster_and_caches_it(qwen2_dir, half_flags, monkeypatch):
    seen = []

    def fake_time(model, dtype, attn, device, clock=None, argmax_screen=False):
        seen.append(dtype)
        assert argmax_screen  # the engine attaches a screen (cpu_argmax_screen), so the greedy steps use it
        assert next(model.parameters()).dtype == dtype  # each candidate is timed in its own dtype
        return (1.0, 0.1, 0.1) if dtype == torch.float32 else (2.0, 0.3, 0.3)

    monkeypatch.setattr(dp, "time_model", fake_time)
    cfg = EngineConfig(model_name=str(qwen2_dir), device="cpu")
    with InferenceEngine(cfg) as engine:
        info = engine.info()
        assert info["dtype"] == "float32" and "by measured" in info["dtype_reason"]
        assert info["dtype_probe"]["flag_choice"] == "bfloat16" and info["dtype_probe"]["source"] == "measured"
        assert next(engine.model.parameters()).dtype == torch.float32
        assert engine.run("hello", max_new_tokens=3, ignore_eos=True).stats.completion_tokens == 3
    assert set(seen) == {torch.float32, torch.bfloat16}
    seen.clear()
    with InferenceEngine(cfg) as engine:  # the second load reads the cache: nothing is timed
        info = engine.info()
        assert info["dtype"] == "float32" and info["dtype_probe"]["source"] == "cached measurement"
    assert seen == []


def test_the_flag_rule_stands_when_measuring_fails_or_is_off(qwen2_dir, half_flags, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no timer here")

    monkeypatch.setattr(dp, "time_model", broken)
    with InferenceEngine(EngineConfig(model_name=str(qwen2_dir), device="cpu")) as engine:
        info = engine.info()
        assert info["dtype"] == "bfloat16" and info["dtype_probe"] == {"error": "no timer here"}
    monkeypatch.setenv(dp.ENV, "0")
    with InferenceEngine(EngineConfig(model_name=str(qwen2_dir), device="cpu")) as engine:
        info = engine.info()
        assert info["dtype"] == "bfloat16" and "dtype_probe" not in info
    with InferenceEngine(EngineConfig(model_name=str(qwen2_dir), device="cpu", dtype="float32")) as engine:
        assert "dtype_probe" not in engine.info()  # a dtype that is set is never measured


@pytest.mark.parametrize("screened", [True, False])
def test_time_model_runs_the_greedy_steps_through_the_argmax_screen_when_one_is_attached(qwen2_dir, monkeypatch,
                                                                                        screened):
    import contextlib

    from llminfer.kernels import prepack

    entered = []

    @contextlib.contextmanager
    def spy(head, rows):
        entered.append((head, list(rows)))
        yield

    monkeypatch.setattr(prepack, "argmax_only", spy)
    monkeypatch.setattr(dp, "_attach_screen", lambda head: screened)
    ticks = iter(range(10**6))  # ms
    # the engine's own screen off: the head is not measured before time_model sees it
    cfg = EngineConfig(model_name=str(qwen2_dir), device="cpu", dtype="float32", cpu_argmax_screen=False)
    with InferenceEngine(cfg) as engine:
        model = engine.model
        prefill, decode, greedy = dp.time_model(model, torch.float32, engine.runtime.attention_backend,
                                                torch.device("cpu"), clock=lambda: next(ticks) * 1e-3,
                                                argmax_screen=True)
        assert [prefill, decode, greedy] == pytest.approx([1.0] * 3)  # one tick per interval on the injected clock
        assert entered == ([(model.get_output_embeddings(), [0])] if screened else [])
        head = model.get_output_embeddings()  # a later round keeps the screen measured at the first
        head.argmax_screen_probe_ms, head.argmax_screen = {}, (object() if screened else None)
        monkeypatch.setattr(dp, "_attach_screen", lambda head: pytest.fail("the screen is measured once"))
        dp.time_model(model, torch.float32, engine.runtime.attention_backend, torch.device("cpu"),
                      clock=lambda: next(ticks) * 1e-3, argmax_screen=True)
        assert len(entered) == (2 if screened else 0)
