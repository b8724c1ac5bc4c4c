"""LoRA adapters through PEFT: hot load / switch / unload without reloading the base model, outputs equal
PEFT's own model, unloading restores the base output exactly, and the prefix cache never serves KV
computed under another adapter."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import make_engine, random_prompts
from llminfer import Backend, ConfigError, EngineError, InvalidRequestError
from llminfer.backends.compiled import COMPILE_BACKEND_ENV
from llminfer.cli import main
from llminfer.logging import reset_logging


@pytest.fixture(autouse=True)
def _reset_logging():
    """In-process CLI runs bind structlog to the captured stderr, closed after the test: reset it."""
    yield
    reset_logging()


peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install 'llminfer[peft]')")

NEW = 8


def _make_adapter(model_dir, dest, seed: int, targets=("q_proj", "v_proj", "up_proj", "down_proj")):
    """Random LoRA weights (B is non-zero: init_lora_weights=False), saved with PEFT."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=list(targets), lora_dropout=0.1,
                          init_lora_weights=False)
    peft.get_peft_model(base, cfg).save_pretrained(str(dest))
    return dest


@pytest.fixture(scope="module")
def adapters(qwen2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": _make_adapter(qwen2_dir, root / "a", 1), "b": _make_adapter(qwen2_dir, root / "b", 2)}


@pytest.fixture(scope="module")
def prompt():
    return random_prompts([21], 151_000, seed=5)[0]  # 5 full blocks of 4 tokens, then one more


def _peft_reference(model_dir, adapter_dir, prompt, n):
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_adapter_changes_output_matches_peft_and_unload_restores_base(qwen2_dir, adapters, prompt):
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW)
    with make_engine(qwen2_dir) as engine:
        base = list(engine.run(prompt, **kw).token_ids)
        model_id = id(engine.model)
        assert engine.load_adapter(str(adapters["a"]), "a") == "a"
        assert engine.active_adapter == "a" and engine.list_adapters() == {"a": str(adapters["a"])}
        with_a = list(engine.run(prompt, **kw).token_ids)
        engine.unload_adapter("a")
        after = list(engine.run(prompt, **kw).token_ids)
        assert id(engine.model) == model_id  # never reloaded
        assert engine.active_adapter is None and engine.list_adapters() == {}
    assert with_a != base
    assert with_a == _peft_reference(qwen2_dir, adapters["a"], prompt, NEW)
    assert after == base


def test_adapter_on_the_lm_head_with_the_argmax_screen(qwen2_dir, tmp_path, prompt):
    """Greedy rows with no logits to read take the head's argmax screen, which a LoRA adapter on ``lm_head``
    would bypass: with such an adapter loaded the rows take the wrapped head (PEFT keeps the wrapper after
    an unload, so the full head from then on), and the tokens equal those of an engine without the screen."""
    from llminfer.kernels.argmax_screen import attach_argmax_screen

    adapter = _make_adapter(qwen2_dir, tmp_path / "head", 3, targets=("lm_head",))
    kw = dict(max_new_tokens=NEW, ignore_eos=True, temperature=0.0)
    outputs = []
    for screen in (False, True):
        with make_engine(qwen2_dir, cpu_argmax_screen=False) as engine:
            if screen:
                assert attach_argmax_screen(engine.backend.output_head, min_elements=0, require_faster=False)
            outputs.append(list(engine.run(prompt, **kw).token_ids))
            screened = engine.backend.describe()["argmax_screen"]
            engine.load_adapter(str(adapter), "head")
            outputs.append(list(engine.run(prompt, **kw).token_ids))
            if screen:
                assert screened["rows"] > 0  # the base head was screened
                assert engine.backend.describe()["argmax_screen"]["rows"] == screened["rows"]  # not the adapter's
    assert outputs[0] == outputs[2] and outputs[1] == outputs[3]
    assert outputs[0] != outputs[1]


def test_prefix_cache_is_partitioned_by_adapter(qwen2_dir, adapters, prompt):
    """One shared prompt under base, a, b, and the same name reloaded with other weights: a request only ever
    hits blocks computed under its own adapter, and every output equals the cold-cache output."""
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW)
    with make_engine(qwen2_dir, prefix_cache=False) as cold:
        cold.load_adapter(str(adapters["a"]), "a")
        cold.load_adapter(str(adapters["b"]), "b", activate=False)
        want = {"a": cold.run(prompt, **kw).token_ids}
        cold.set_adapter("b")
        want["b"] = cold.run(prompt, **kw).token_ids
        cold.set_adapter(None)
        want[None] = cold.run(prompt, **kw).token_ids
    assert len({want["a"], want["b"], want[None]}) == 3

    with make_engine(qwen2_dir) as engine:
        first = engine.run(prompt, **kw)  # base: computes and caches 5 blocks
        assert first.token_ids == want[None] and first.stats.cached_tokens == 0
        engine.load_adapter(str(adapters["a"]), "a")
        engine.load_adapter(str(adapters["b"]), "b", activate=False)
        for name in ("a", "b"):
            engine.set_adapter(name)
            r1 = engine.run(prompt, **kw)
            r2 = engine.run(prompt, **kw)
            assert r1.stats.cached_tokens == 0, f"adapter {name} hit KV of another adapter"
            assert r2.stats.cached_tokens > 0  # its own blocks are reused
            assert r1.token_ids == r2.token_ids == want[name]
        engine.set_adapter(None)
        back = engine.run(prompt, **kw)
        assert back.stats.cached_tokens > 0 and back.token_ids == want[None]
        # Same name, other weights: the old "a" blocks must be gone.
        engine.unload_adapter("a")
        engine.load_adapter(str(adapters["b"]), "a")
        again = engine.run(prompt, **kw)
        assert again.stats.cached_tokens == 0 and again.token_ids == want["b"]


def test_switch_refused_while_in_flight(qwen2_dir, adapters):
    with make_engine(qwen2_dir) as engine:
        engine.load_adapter(str(adapters["a"]), "a")
        stream = engine.stream([1, 2, 3, 4, 5], max_new_tokens=30, ignore_eos=True)
        next(stream)
        assert not engine.is_idle()
        with pytest.raises(EngineError, match="in flight"):
            engine.set_adapter(None)
        with pytest.raises(EngineError, match="in flight"):
            engine.unload_adapter("a")
        assert sum(1 for _ in stream) > 0  # the request finishes under its adapter
        assert engine.is_idle()
        engine.set_adapter(None)
        assert engine.active_adapter is None


def test_stale_request_and_bad_names_refused(qwen2_dir, adapters):
    with make_engine(qwen2_dir) as engine:
        engine.load_adapter(str(adapters["a"]), "a")
        request = engine.make_request([1, 2, 3], max_new_tokens=2)
        assert request.adapter_name == "a"
        engine.set_adapter(None)
        with pytest.raises(InvalidRequestError, match="active adapter"):
            engine.run_requests([request])
        with pytest.raises(InvalidRequestError, match="not the active adapter"):
            engine.make_request([1, 2, 3], adapter_name="a")
        with pytest.raises(ConfigError, match="already loaded"):
            engine.load_adapter(str(adapters["b"]), "a")
        with pytest.raises(ConfigError, match="letters"):
            engine.load_adapter(str(adapters["b"]), "bad.name")
        with pytest.raises(ConfigError, match="no adapter named"):
            engine.set_adapter("zzz")


def test_adapter_under_compiled_backend(monkeypatch, qwen2_dir, adapters, prompt):
    """PEFT-wrapped layers keep the paged-attention path under torch.compile (aot_eager here)."""
    monkeypatch.setenv(COMPILE_BACKEND_ENV, "aot_eager")
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW)
    with make_engine(qwen2_dir) as eager:
        eager.load_adapter(str(adapters["a"]), "a")
        want = eager.run(prompt, **kw).token_ids
    with make_engine(qwen2_dir, backend=Backend.COMPILED) as engine:
        engine.load_adapter(str(adapters["a"]), "a")
        got = engine.run(prompt, **kw).token_ids
        assert engine.backend.stats()["compiled_steps"] > 0 and not engine.backend.stats()["fell_back_to_eager"]
    assert got == want


def test_cli_adapter(qwen2_dir, adapters, capsys):
    args = ["run", "hello there", "--model", str(qwen2_dir), "--device", "cpu", "--dtype", "float32",
            "--max-new-tokens", "6", "--ignore-eos", "--json"]
    main(args)
    base = capsys.readouterr().out
    main([*args, "--adapter", str(adapters["a"]), "--adapter-name", "mine"])
    tuned = capsys.readouterr().out
    assert base != tuned and '"token_ids"' in tuned


def test_adapter_load_is_quiet(qwen2_dir, adapters, capfd):
    """No transformers progress bar or load report (it lists the base weights as MISSING from the adapter's
    checkpoint, which reads as if they were re-initialized), and no bitsandbytes import warning."""
    with make_engine(qwen2_dir) as engine:
        capfd.readouterr()
        engine.load_adapter(str(adapters["a"]), "quiet")
        out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "MISSING" not in out + err and "Loading weights" not in err
    assert "gemm_4bit_forward" not in out + err


def test_missing_adapter_is_a_load_error(qwen2_dir, tmp_path):
    from llminfer import ModelLoadError

    with make_engine(qwen2_dir) as engine, pytest.raises(ModelLoadError, match="adapter folder .* does not exist"):
        engine.load_adapter(str(tmp_path / "nope"), "x")


def test_adapter_operations_run_on_the_model_thread(qwen2_dir, adapters, monkeypatch):
    """load/set/unload change the model the steps run, so they run on the engine's model thread (the one
    that loaded the model and runs every step), not on the caller's."""
    import threading

    from llminfer.adapters import AdapterManager

    seen: dict[str, int] = {}
    for op in ("load", "set", "unload"):
        original = getattr(AdapterManager, op)

        def recording(self, *args, _op=op, _original=original, **kwargs):
            seen[_op] = threading.get_ident()
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(AdapterManager, op, recording)
    with make_engine(qwen2_dir, max_batch_size=2) as engine:
        assert engine.model_thread is not None
        model_thread = engine.model_thread.call(threading.get_ident)
        engine.load_adapter(str(adapters["a"]), adapter_name="a", activate=False)
        engine.set_adapter("a")
        engine.set_adapter(None)
        engine.unload_adapter("a")
    assert model_thread != threading.get_ident()
    assert seen == dict.fromkeys(("load", "set", "unload"), model_thread)


def test_switch_refused_between_admission_and_submission(qwen2_dir, adapters, prompt):
    """A request whose adapter stamp was checked but which has not reached the pipeline yet is in flight:
    an adapter change in that window is refused (it used to pass the idle check, and the request then ran
    under the new adapter while keyed, in the prefix cache, under its old one)."""
    import threading

    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW)
    with make_engine(qwen2_dir) as engine:
        base = list(engine.run(prompt, **kw).token_ids)
        engine.load_adapter(str(adapters["a"]), "a", activate=False)
        admitted, go = threading.Event(), threading.Event()
        require_portal = engine._require_portal

        def paused_portal():
            admitted.set()
            go.wait(30)
            return require_portal()

        engine._require_portal = paused_portal
        result: dict[str, list[int]] = {}
        runner = threading.Thread(target=lambda: result.update(ids=list(engine.run(prompt, **kw).token_ids)))
        runner.start()
        try:
            assert admitted.wait(30)
            assert not engine.is_idle()
            with pytest.raises(EngineError, match="in flight"):
                engine.set_adapter("a")
        finally:
            go.set()
            runner.join(60)
            del engine._require_portal
        assert result["ids"] == base and engine.active_adapter is None
