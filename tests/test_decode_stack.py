"""All decoder layers of an all-decode step in one op (``backends.decode_stack``, ``csrc/decode_layers.cpp``): the
bits of the Python loop and of ``model(...)``, and the Python loop wherever a module, buffer, hook or forward
the stack took is no longer the one in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decoder_loop import _prefill_then_step
from test_fused_projections import _quantized

from llminfer.backends import decoder_loop
from llminfer.backends.decode_stack import DecodeStack
from llminfer.kernels.build import skinny_linear_available

pytestmark = pytest.mark.skipif(not skinny_linear_available(), reason="llminfer's CPU kernel does not build here")


def _decode(model: torch.nn.Module, tokens: list[int], starts: list[int], stack: bool) -> torch.Tensor:
    """One all-decode step (one token per sequence at ``starts``) through the decoder loop, with the stack on or
    off; every row's logits."""
    plan = decoder_loop._plan_for(model)
    assert plan is not None
    plan.stack_on = stack
    try:
        return _prefill_then_step(model, [[t] for t in tokens], starts, loop=True, backend="cpu")
    finally:
        plan.stack_on = True


def _count_stack_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, *a, _f=DecodeStack.__call__: calls.append(1) or _f(self, *a))
    return calls


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def _model(family: str, mode: str) -> torch.nn.Module:
    if (family, mode) not in _MODELS:
        with pytest.MonkeyPatch.context() as patch:
            _MODELS[family, mode] = _quantized(family, mode, patch)
    return _MODELS[family, mode]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
@pytest.mark.parametrize("mode", ["int8-wo", "int4-wo"])
@settings(max_examples=6, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 96)), min_size=1, max_size=5))  # start 0: a prefill
def test_the_stack_has_the_bits_of_the_python_loop_and_the_model_forward(mode, family, rows):
    model = _model(family, mode)
    starts, tokens = [s for s, _ in rows], [t for _, t in rows]
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        calls = _count_stack_calls(patch)
        stacked = _decode(model, tokens, starts, stack=True)
    assert calls == [1]  # the op ran, once for all layers
    assert torch.equal(stacked, _decode(model, tokens, starts, stack=False))
    assert torch.equal(stacked, _prefill_then_step(model, [[t] for t in tokens], starts, loop=False, backend="cpu"))


def test_a_prefill_or_an_unquantized_model_takes_the_python_loop(monkeypatch):
    calls = _count_stack_calls(monkeypatch)
    model = _model("llama", "int8-wo")
    _prefill_then_step(model, [[4, 5], [9]], [30, 12], loop=True, backend="cpu")  # a prefill row
    _prefill_then_step(model, [[4], [9]], [30, 12], loop=True, backend="torch")  # another attention backend
    from test_decoder_loop import _kernel_models

    _prefill_then_step(_kernel_models()["llama"], [[4], [9]], [30, 12], loop=True, backend="cpu")  # fp32: no q8
    assert not calls
    _prefill_then_step(model, [[4], [9]], [30, 12], loop=True, backend="cpu")
    assert calls == [1]


@pytest.mark.parametrize("change", ["hook", "wrapper", "buffer", "instance_forward", "norm_hook", "class_forward",
                                    "scaling", "epsilon"])
def test_a_change_after_the_stack_was_built_sends_the_step_to_the_python_loop(change, monkeypatch):
    """What the stack took is checked at every step: each change below is seen by the next step, which then has
    the bits of ``model(...)`` with the change (a hook runs, a wrapper's output counts). A replaced buffer
    keeps the layer on the path: the stack is built again around it."""
    model = _quantized("llama", "int8-wo", monkeypatch)
    layer = model.model.layers[1]
    before = _decode(model, [3], [5], stack=True)
    plan = decoder_loop._plan_for(model)
    first = plan.stack
    assert first is not None
    seen: list[int] = []
    down = layer.mlp.down_proj
    if change == "hook":
        layer.self_attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(1) or o * 2)
    elif change == "wrapper":
        class Doubled(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                seen.append(1)
                return down(x) * 2

        layer.mlp.down_proj = Doubled()
    elif change == "buffer":
        down.minimum = down.minimum + 0.5
    elif change == "scaling":
        layer.self_attn.scaling *= 0.5
    elif change == "epsilon":
        layer.input_layernorm.variance_epsilon = 0.5
    elif change == "instance_forward":
        down.forward = lambda x, _f=down.forward: seen.append(1) or _f(x) * 2
    elif change == "norm_hook":
        layer.post_attention_layernorm.register_forward_pre_hook(lambda m, args: seen.append(1) or (args[0] * 2,))
    else:
        mlp_cls = type(layer.mlp)
        monkeypatch.setattr(mlp_cls, "forward", lambda self, x, _f=mlp_cls.forward: seen.append(1) or _f(self, x) * 2)
    calls = _count_stack_calls(monkeypatch)
    looped = _decode(model, [3], [5], stack=True)
    assert not torch.equal(looped, before)
    if change in ("buffer", "scaling", "epsilon"):
        assert calls == [1] and plan.stack is not None and plan.stack is not first
    else:
        assert not calls and seen and plan.stack is None
    assert torch.equal(looped, _prefill_then_step(model, [[3]], [5], loop=False, backend="cpu"))
    assert torch.equal(looped, _decode(model, [3], [5], stack=False))


def test_the_stack_is_built_again_once_its_layers_are_back_on_the_path(monkeypatch):
    model = _quantized("llama", "int4-wo", monkeypatch)
    mlp = model.model.layers[0].mlp
    down = mlp.down_proj
    mlp.down_proj = torch.nn.Sequential(down)  # a wrapper in place from the first step on
    _decode(model, [3], [5], stack=True)
    plan = decoder_loop._plan_for(model)
    assert plan.stack is None and plan.stack_retry_in == decoder_loop.STACK_RETRY_STEPS
    mlp.down_proj = down
    calls = _count_stack_calls(monkeypatch)
    plan.stack_retry_in = 1  # the retry's countdown, not all its steps
    _decode(model, [3], [5], stack=True)
    assert not calls and plan.stack is None
    _decode(model, [3], [5], stack=True)
    assert calls == [1] and plan.stack is not None


def test_the_switch_turns_the_stack_off(monkeypatch):
    monkeypatch.setenv("LLMINFER_DECODE_STACK", "0")
    model = _quantized("llama", "int8-wo", monkeypatch)
    calls = _count_stack_calls(monkeypatch)
    _prefill_then_step(model, [[4], [9]], [30, 12], loop=True, backend="cpu")
    assert not calls and decoder_loop._plan_for(model).stack is None


@pytest.mark.parametrize("mode", ["int8-wo", "int4-wo"])
def test_the_engine_gives_the_same_tokens_with_the_stack_on_and_off(mode, monkeypatch):
    """The built-in model (Qwen2: q/k/v biases) with continuous batching: the same greedy tokens, the stack taken
    for its decode steps when on, and every block back in the pool. (The q8 path is set: where it is chosen by
    measurement, a CPU may choose the other.)"""
    from helpers import make_engine
    from llminfer.config import QuantConfig, QuantMode
    from llminfer.models import builtin_model_path

    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT8_PATH", "q8")
    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT4_PATH", "q8")
    engine = make_engine(builtin_model_path(), max_batch_size=4, quant=QuantConfig(mode=QuantMode(mode)))
    try:
        plan = decoder_loop._plan_for(engine.backend.model)
        assert plan is not None
        prompts = ["Hello there", "The paged cache", "One two three", "x"]
        outputs = {}
        for on in (True, False):
            plan.stack_on = on
            plan.stack = None
            results = engine.run_requests([engine.make_request(p, max_new_tokens=12 + 4 * i, ignore_eos=True)
                                           for i, p in enumerate(prompts)])
            outputs[on] = [r.token_ids for r in results]
            assert (plan.stack is not None) == on
        assert engine.info()["decode_stack_steps"] >= 12
        assert outputs[True] == outputs[False]
        assert engine.cache_stats()["blocks_used"] == 0
    finally:
        engine.close()


def test_a_model_whose_steps_ran_the_loop_and_the_stack_is_freed_when_dropped(monkeypatch):
    """The loop's plan (the stack included) is kept per model in a weak-keyed map: nothing in it may hold the
    model, or every model an engine ever ran would stay in memory."""
    import gc
    import weakref

    model = _quantized("llama", "int8-wo", monkeypatch)
    _decode(model, [3], [5], stack=True)
    assert decoder_loop._plan_for(model).stack is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
