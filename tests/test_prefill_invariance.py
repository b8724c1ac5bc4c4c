"""A prompt row's result does not depend on how the prompt reached the cache: prefilled whole, in chunks of any
size, or after a prefix-cache hit, with ``attention_backend="cpu"`` (each prefill row on the decode kernel over its
own causal context) it has the same bits, and so has a decode step at the same position."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decoder_loop import BLOCKS_PER_SEQ, _cache, _model
from test_fused_projections import _quantized

from helpers import make_engine
from llminfer.backends.attention import METADATA_KWARG, build_metadata
from llminfer.config import QuantConfig
from llminfer.kernels.build import skinny_linear_available

pytestmark = pytest.mark.skipif(not skinny_linear_available(), reason="llminfer's CPU kernel does not build here")

_MODELS: dict[str, torch.nn.Module] = {}


def _cpu_model(mode: str) -> torch.nn.Module:
    """The decoder-loop tests' small Llama: on llminfer's fp32 kernels, or int8-wo on the q8 products."""
    from llminfer.models.kernel_swap import enable_cpu_kernels

    if mode not in _MODELS:
        if mode == "float32":
            model = _model("llama")
            enable_cpu_kernels(model)
        else:
            with pytest.MonkeyPatch.context() as patch:
                model = _quantized("llama", mode, patch)
        _MODELS[mode] = model
    return _MODELS[mode]


def _prefill_rows(model: torch.nn.Module, tokens: list[int], chunks: list[int], backend: str) -> torch.Tensor:
    """Prefill ``tokens`` into a fresh cache as consecutive steps of ``chunks`` tokens; every row's last hidden
    state, ``[len(tokens), hidden]`` float32 (the decoder's output: the LM head's own row invariance is
    :mod:`test_cpu_kernels`'s)."""
    cache = _cache(model, 1)
    table = [list(range(BLOCKS_PER_SEQ))]
    rows, start = [], 0
    for n in chunks:
        meta, pos = build_metadata(cache, [start], [n], table, torch.device("cpu"), backend)
        with torch.inference_mode():
            out = model.model(input_ids=torch.tensor(tokens[start : start + n])[None], position_ids=pos,
                              use_cache=False, **{METADATA_KWARG: meta})
        rows.append(out.last_hidden_state[0])
        start += n
    return torch.cat(rows)


def _split(length: int, cuts: list[int]) -> list[int]:
    bounds = sorted({0, length, *(c for c in cuts if 0 < c < length)})
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("mode", ["float32", "int8-wo", "int4-wo"])
@settings(max_examples=10, deadline=None)
@given(length=st.integers(2, 200), cuts=st.lists(st.integers(1, 199), min_size=1, max_size=4), seed=st.integers(0, 9))
def test_a_prompt_row_has_the_same_bits_however_the_prompt_was_chunked(mode, length, cuts, seed):
    model = _cpu_model(mode)
    tokens = torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    whole = _prefill_rows(model, tokens, [length], "cpu")
    chunks = _split(length, cuts)
    assert torch.equal(_prefill_rows(model, tokens, chunks, "cpu"), whole)
    # one token at a time: every row a decode step
    assert torch.equal(_prefill_rows(model, tokens[: min(length, 40)], [1] * min(length, 40), "cpu"), whole[:40])


def test_the_check_can_fail_on_the_torch_path():
    """On the torch path (SDPA for a chunk alone, the masked path over a cached context) the same prompt split
    two ways gives other bits: what the kernel path removes."""
    model = _cpu_model("float32")
    tokens = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    assert not torch.equal(_prefill_rows(model, tokens, [150], "torch"), _prefill_rows(model, tokens, [37, 113], "torch"))


@pytest.mark.slow
def test_a_prefix_cache_hit_repeats_the_trained_models_greedy_tokens_and_logprobs(trained_model):
    """SmolLM2 int8-wo: the same prompt three times (the second and third are prefix-cache hits) gives the same
    tokens and logprobs, bit for bit; before the prefill rows ran on the decode kernel, the greedy text of such a
    repeat diverged at token 11."""
    prompt = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
              "movable metal type with an oil-based ink and a wooden press, and within fifty years")
    with make_engine(trained_model, block_size=16, quant=QuantConfig(mode="int8-wo")) as engine:
        runs = [engine.run(prompt, max_new_tokens=40, min_new_tokens=40, logprobs=0) for _ in range(3)]
        stats = engine.cache_stats()
    assert stats["cached_tokens"] > 0
    assert runs[1].token_ids == runs[0].token_ids and runs[2].token_ids == runs[0].token_ids
    assert [e.logprob for e in runs[1].logprobs] == [e.logprob for e in runs[0].logprobs]
