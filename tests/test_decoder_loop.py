"""llminfer's decoder loop (``backends.decoder_loop``) against transformers' own forward: the same logits, bit
for bit, on every step shape, for each family it runs; everything else goes through ``model(...)``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llminfer.backends import decoder_loop
from llminfer.backends.attention import METADATA_KWARG, PagedKVCache, build_metadata, register_paged_attention

BLOCK = 4
BLOCKS_PER_SEQ = 80  # 320 positions: past the RoPE table's first size (256), so it grows during the tests


def _model(family: str, **rope: object) -> torch.nn.Module:
    import transformers

    register_paged_attention()
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    config = config_cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        **rope)
    torch.manual_seed(7)
    model = model_cls._from_config(config, attn_implementation="llminfer_paged", torch_dtype=torch.float32)
    return model.eval()


def _cache(model: torch.nn.Module, sequences: int) -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.num_hidden_layers, sequences * BLOCKS_PER_SEQ, BLOCK, c.num_key_value_heads,
                        c.hidden_size // c.num_attention_heads, torch.float32, "cpu")


def _step(model, cache, tokens, starts, loop: bool, backend: str = "torch") -> torch.Tensor:
    """One packed step over ``tokens`` (per sequence) at ``starts``; every row's logits."""
    tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(tokens))]
    meta, position_ids = build_metadata(cache, starts, [len(t) for t in tokens], tables, torch.device("cpu"),
                                        backend)
    ids = torch.tensor([t for seq in tokens for t in seq])[None]
    keep = torch.arange(ids.shape[1])
    with torch.inference_mode():
        if loop:
            return decoder_loop.forward_logits(model, ids, position_ids, keep, meta,
                                               max(s + len(t) for s, t in zip(starts, tokens)) - 1)
        return model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep,
                     **{METADATA_KWARG: meta}).logits


def _prefill_then_step(model, tokens, starts, loop: bool, backend: str = "torch") -> torch.Tensor:
    """Fill each sequence's cache up to its start (one prefill through ``model(...)``), then run the step."""
    cache = _cache(model, len(tokens))
    gen = torch.Generator().manual_seed(sum(starts))
    prefix = [torch.randint(0, 97, (s,), generator=gen).tolist() for s in starts]
    if any(starts):
        fill = [(p, i) for i, p in enumerate(prefix) if p]
        tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for _, i in fill]
        meta, pos = build_metadata(cache, [0] * len(fill), [len(p) for p, _ in fill], tables,
                                   torch.device("cpu"), "torch")
        with torch.inference_mode():
            model(input_ids=torch.tensor([t for p, _ in fill for t in p])[None], position_ids=pos,
                  use_cache=False, **{METADATA_KWARG: meta})
    return _step(model, cache, tokens, starts, loop, backend)


MODELS = {family: _model(family) for family in ("llama", "qwen2", "mistral")}

step_shapes = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 12)), min_size=1, max_size=4)


@pytest.mark.parametrize("family", sorted(MODELS))
@settings(max_examples=12, deadline=None)
@given(shape=step_shapes, data=st.data())
def test_loop_logits_have_the_bits_of_the_model_forward(family, shape, data):
    model = MODELS[family]
    assert decoder_loop.uses_decoder_loop(model)
    starts = [s for s, _ in shape]
    tokens = [data.draw(st.lists(st.integers(0, 96), min_size=n, max_size=n)) for _, n in shape]
    assert torch.equal(_prefill_then_step(model, tokens, starts, loop=True),
                       _prefill_then_step(model, tokens, starts, loop=False))


def test_the_loop_can_tell_when_it_differs(monkeypatch):
    """The check above can fail: a loop that skips RoPE gives other logits."""
    model = MODELS["llama"]
    monkeypatch.setattr(decoder_loop, "_rotate_together", lambda q, k, cos, sin: (q, k))
    monkeypatch.setattr(decoder_loop, "_rotate_in_kernel", lambda q, k, cos, sin: (q, k))
    assert not torch.equal(_prefill_then_step(model, [[5, 6]], [9], loop=True),
                           _prefill_then_step(model, [[5, 6]], [9], loop=False))


def test_modules_swapped_after_the_first_step_are_used():
    """A LoRA wrapper put in place later (engine.load_adapter) replaces modules; the loop looks them up."""
    model = _model("qwen2")
    _prefill_then_step(model, [[1, 2]], [3], loop=True)  # the plan exists from here on
    head, norm = model.lm_head, model.model.layers[1].post_attention_layernorm

    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2

    model.lm_head, model.model.layers[1].post_attention_layernorm = Doubled(head), Doubled(norm)
    looped = _prefill_then_step(model, [[1, 2]], [3], loop=True)
    assert torch.equal(looped, _prefill_then_step(model, [[1, 2]], [3], loop=False))
    model.lm_head, model.model.layers[1].post_attention_layernorm = head, norm
    assert not torch.equal(looped, _prefill_then_step(model, [[1, 2]], [3], loop=True))


def test_a_hook_on_a_layer_makes_the_step_run_through_the_model_forward():
    model = _model("llama")
    seen = []
    handle = model.model.layers[0].register_forward_hook(lambda *_: seen.append(1))
    try:
        assert torch.equal(_prefill_then_step(model, [[4, 5, 6]], [2], loop=True),
                           _prefill_then_step(model, [[4, 5, 6]], [2], loop=False))
        assert len(seen) == 4  # two prefills and two steps, each through model(...)
    finally:
        handle.remove()


@pytest.mark.parametrize(("family", "rope"), [
    ("qwen3", {}),  # q/k norms: another layer
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
])
def test_other_models_run_through_the_model_forward(family, rope):
    model = _model(family, **rope)
    assert not decoder_loop.uses_decoder_loop(model)
    assert torch.equal(_prefill_then_step(model, [[1, 2, 3]], [5], loop=True),
                       _prefill_then_step(model, [[1, 2, 3]], [5], loop=False))


def test_a_model_loaded_with_another_attention_is_not_looped():
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4))
    assert not decoder_loop.uses_decoder_loop(model.eval())


def test_the_switch_turns_the_loop_off_and_back_on():
    model = _model("llama")
    assert decoder_loop.use_decoder_loop(model, False) is True
    assert not decoder_loop.uses_decoder_loop(model)
    assert decoder_loop.use_decoder_loop(model, True) is False
    assert decoder_loop.uses_decoder_loop(model)


def test_the_fp32_shortcuts_are_taken_and_a_replaced_rotation_is_called_as_it_is():
    """The hypothesis test above covers the loop's own RoPE and fp32 norm calls only if the plan takes them."""
    plan = decoder_loop._plan_for(MODELS["qwen2"])
    assert plan.plain_rotate
    assert not decoder_loop._same_rotation(lambda q, k, cos, sin: (q * cos, k * cos))
    calls = []
    rms_norm = torch.nn.functional.rms_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return rms_norm(*args, **kwargs)

    torch.nn.functional.rms_norm = counted
    try:
        _step(MODELS["qwen2"], _cache(MODELS["qwen2"], 1), [[3]], [0], loop=True)
    finally:
        torch.nn.functional.rms_norm = rms_norm
    assert len(calls) == 2 * 2 + 1  # two per layer and the final one: torch's rms_norm, not transformers' module


@pytest.mark.parametrize(("family", "looped"), [("llama", True), ("qwen2", True), ("gpt2", False)])
def test_engines_report_the_loop_and_match_hf_greedy(model_dirs, family, looped):
    """End to end on the CPU kernels (the engine swaps its linears for llminfer's): the loop where the family
    is known, ``model(...)`` elsewhere, HF ``generate()``'s greedy tokens either way."""
    from helpers import hf_greedy, make_engine, random_prompts

    prompts = random_prompts([5, 17, 9], 90, seed=3)
    engine = make_engine(model_dirs[family])
    try:
        assert engine.info()["decoder_loop"] is looped
        got = [list(r.token_ids) for r in engine.run_batch_continuous(prompts, max_new_tokens=12, ignore_eos=True)]
    finally:
        engine.close()
    assert got == hf_greedy(model_dirs[family], prompts, 12)


@pytest.mark.skipif(not __import__("llminfer.kernels.build", fromlist=["x"]).skinny_linear_available(),
                    reason="llminfer's CPU kernel does not build here")
@pytest.mark.parametrize("family", sorted(MODELS))
@settings(max_examples=8, deadline=None)
@given(shape=step_shapes, data=st.data())
def test_a_model_on_llminfers_kernels_keeps_the_bits_of_its_forward(family, shape, data):
    """After the kernel swap (SkinnyLinear, KernelRMSNorm), the loop calls the norms' op directly, each residual
    sum together with the next norm (``add_rms_norm``), and RoPE as one op (``rotary_qk``): the same bits."""
    model = _kernel_models()[family]
    plan = decoder_loop._plan_for(model)
    assert plan is not None and plan.plain_rotate
    starts = [s for s, _ in shape]
    tokens = [data.draw(st.lists(st.integers(0, 96), min_size=n, max_size=n)) for _, n in shape]
    calls = []
    ops = torch.ops.llminfer_cpu
    with pytest.MonkeyPatch.context() as patch:
        for name in ("add_rms_norm", "rotary_qk"):
            patch.setattr(ops, name, lambda *a, _f=getattr(ops, name), _n=name: calls.append(_n) or _f(*a))
        looped = _prefill_then_step(model, tokens, starts, loop=True)
    assert torch.equal(looped, _prefill_then_step(model, tokens, starts, loop=False))
    layers = model.config.num_hidden_layers
    assert calls.count("rotary_qk") == layers and calls.count("add_rms_norm") == 2 * layers  # the ops ran


_KERNEL_MODELS: dict[str, torch.nn.Module] = {}


def _kernel_models() -> dict[str, torch.nn.Module]:
    from llminfer.kernels.layers import KernelRMSNorm
    from llminfer.models.kernel_swap import enable_cpu_kernels

    if not _KERNEL_MODELS:
        for family in MODELS:
            model = _model(family)
            enable_cpu_kernels(model)
            assert type(model.model.norm) is KernelRMSNorm and decoder_loop.uses_decoder_loop(model)
            _KERNEL_MODELS[family] = model
    return _KERNEL_MODELS


@pytest.mark.skipif(not __import__("llminfer.kernels.build", fromlist=["x"]).skinny_linear_available(),
                    reason="llminfer's CPU kernel does not build here")
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
@pytest.mark.parametrize("mode", ["int8-wo", "int4-wo"])
def test_quantized_layers_on_the_q8_path_are_called_directly_with_the_bits_of_their_forward(mode, family,
                                                                                           monkeypatch):
    """int8-wo / int4-wo layers on the q8 kernel path: the loop calls their op without the module call (and the
    MLP's parts without the MLP's), with the bits of ``model(...)``; a forward replaced on an instance is
    called."""
    from llminfer.models.kernel_swap import enable_cpu_kernels
    from llminfer.models.weight_only import Int4WeightOnlyLinear, Int8GroupWeightOnlyLinear, quantize_model

    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT8_PATH", "q8")
    monkeypatch.setenv("LLMINFER_CPU_KERNEL_INT4_PATH", "q8")
    model = _model(family)
    quantize_model(model, mode, compute_dtype=torch.float32)
    enable_cpu_kernels(model)
    layer0 = model.model.layers[0]
    assert layer0.self_attn.q_proj.kernel_path == "q8" and decoder_loop.uses_decoder_loop(model)
    assert all(decoder_loop._plan_for(model).plain_mlp)
    assert (layer0.self_attn.q_proj.bias is not None) == (family == "qwen2")
    calls = []
    for cls in (Int8GroupWeightOnlyLinear, Int4WeightOnlyLinear):  # a module call shows here
        monkeypatch.setattr(cls, "forward", lambda self, *a, _f=cls.forward, **k: calls.append(1) or _f(self, *a, **k))
    for tokens, starts in (([[5, 6, 7]], [0]), ([[1], [2, 3]], [40, 7])):
        assert torch.equal(_prefill_then_step(model, tokens, starts, loop=True),
                           _prefill_then_step(model, tokens, starts, loop=False))
    looped = len(calls)
    calls.clear()
    _step(model, _cache(model, 1), [[3]], [0], loop=True)
    assert not calls and looped > 0  # the loop's direct op calls go past forward
    monkeypatch.undo()  # the classes' own forward again
    mlp_calls = []
    mlp_forward = type(layer0.mlp).forward
    monkeypatch.setattr(type(layer0.mlp), "forward", lambda self, x: mlp_calls.append(1) or mlp_forward(self, x) / 2)
    looped = _prefill_then_step(model, [[5, 6, 7]], [0], loop=True)
    looped_calls = len(mlp_calls)
    assert torch.equal(looped, _prefill_then_step(model, [[5, 6, 7]], [0], loop=False))
    assert looped_calls == len(mlp_calls) - looped_calls > 0  # a forward patched onto the class later is called
    monkeypatch.undo()
    proj = layer0.self_attn.o_proj
    monkeypatch.setattr(proj, "forward", lambda x, _f=proj.forward: calls.append(1) or _f(x))
    _step(model, _cache(model, 1), [[3]], [0], loop=True)
    assert calls == [1]  # an instance's own forward is honoured


def test_an_mlp_forward_patched_onto_its_class_before_the_first_step_is_called(monkeypatch):
    """The inlined MLP is transformers' own: a forward patched onto the class (not an instance) before the loop
    first sees the model runs, as ``model(...)`` runs it."""
    import transformers

    model = _model("llama")
    forward = transformers.models.llama.modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaMLP, "forward",
                        lambda self, x: forward(self, x) * 0.5)
    assert not any(decoder_loop._plan_for(model).plain_mlp)
    assert torch.equal(_prefill_then_step(model, [[4, 5, 6]], [2], loop=True),
                       _prefill_then_step(model, [[4, 5, 6]], [2], loop=False))


@pytest.mark.skipif(not __import__("llminfer.kernels.build", fromlist=["x"]).skinny_linear_available(),
                    reason="llminfer's CPU kernel does not build here")
def test_an_all_decode_step_calls_the_decode_attention_directly_unless_a_wrapper_is_registered(monkeypatch):
    """An all-decode fp32 step on the kernels goes to ``cpu_decode_attention`` from the loop, past the registered
    function, with the model forward's bits; a step with a prefill, or a function registered in its place, does
    not."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from llminfer.backends.attention import ATTN_IMPLEMENTATION

    model = _kernel_models()["llama"]
    direct, registered = [], []
    monkeypatch.setattr(decoder_loop, "cpu_decode_attention",
                        lambda *a, _f=decoder_loop.cpu_decode_attention: direct.append(_f(*a)) or direct[-1])
    from llminfer.backends import attention

    looped = _prefill_then_step(model, [[4], [9]], [30, 12], loop=True, backend="cpu")
    with monkeypatch.context() as general:  # the reference takes the registered function's general path
        general.setattr(attention, "cpu_decode_attention", lambda *a: None)
        assert torch.equal(looped, _prefill_then_step(model, [[4], [9]], [30, 12], loop=False, backend="cpu"))
    layers = model.config.num_hidden_layers
    assert len(direct) == layers and all(out is not None for out in direct)
    direct.clear()
    _prefill_then_step(model, [[4, 5], [9]], [30, 12], loop=True, backend="cpu")
    assert len(direct) == layers and all(out is None for out in direct)  # a prefill: the general path
    direct.clear()
    original = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, ATTN_IMPLEMENTATION,
                        lambda *a, **k: registered.append(1) or original(*a, **k))
    _prefill_then_step(model, [[4], [9]], [30, 12], loop=True, backend="cpu")
    assert not direct and len(registered) == 2 * layers  # the wrapper, for the prefill and the step
