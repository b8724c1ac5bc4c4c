"""CUDA-graph decode: bucketing and padding on CPU (the runner without capture, Triton kernels in the
interpreter), replay vs eager on a GPU (``gpu``, skipped without one)."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_engine, random_prompts
from llminfer import CacheConfig, EngineConfig, InferenceEngine
from llminfer.backends.cuda_graphs import DecodeGraphRunner, DecodeInputs, batch_buckets, pick_bucket

pytest.importorskip("triton")


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(3) == (1, 2, 4)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 24)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112)
    assert pick_bucket(5, batch_buckets(16)) == 8 and pick_bucket(17, batch_buckets(16)) is None
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_inputs_pad_to_the_bucket():
    inp = DecodeInputs(max_rows=4, width=3, device=torch.device("cpu"))
    inp.fill([11, 12], [5, 8], [[7, 2], [4, 9, 6]], block_size=4, bucket=4)
    assert inp.ids.tolist() == [11, 12, 0, 0] and inp.positions.tolist() == [5, 8, 0, 0]
    assert inp.slots.tolist() == [2 * 4 + 1, 6 * 4 + 0, -1, -1]  # padding rows write no KV
    assert inp.ctx_len.tolist() == [6, 9, 1, 1]
    assert inp.block_tables.tolist() == [[7, 2, 0], [4, 9, 6], [0, 0, 0], [0, 0, 0]]
    inp.fill([3], [1], [[5]], block_size=4, bucket=1)  # a smaller step overwrites what its bucket reads
    assert inp.ids.tolist() == [3, 0, 0, 0] and inp.slots[0].item() == 21 and inp.block_tables[0].tolist() == [5, 0, 0]


def _run(model_dir, prompts, *, graphs: bool, capture: bool, new_tokens: int):
    with make_engine(model_dir, max_batch_size=4, block_size=4, attention_backend="triton") as engine:
        runner = None
        if graphs:
            rt_len = engine.max_model_len
            runner = DecodeGraphRunner(engine.backend.model, engine.backend.cache, 4, rt_len, capture=capture)
            runner.capture_all()
            engine.backend.graphs = runner
        out = engine.run_batch_continuous(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        assert engine.cache_stats()["blocks_used"] == 0
    return [list(r.token_ids) for r in out], runner


def test_padded_static_buffer_decode_matches_hf_generate(model_dirs):
    """Three sequences decode in the 4-row bucket (one padding row) from the static buffers."""
    prompts = random_prompts([3, 6, 9], 151_000, seed=5)
    got, runner = _run(model_dirs["qwen2"], prompts, graphs=True, capture=False, new_tokens=3)
    assert runner.num_replays >= 2
    assert got == hf_greedy(model_dirs["qwen2"], prompts, 3)


def test_compiled_backend_replays_decode_from_the_same_static_buffers(model_dirs, monkeypatch):
    """``compile_cudagraphs`` with Triton attention: the compiled graph runs every pure-decode bucket from
    the eager backend's static buffers (no capture on CPU) and gives HF's greedy tokens."""
    from llminfer.backends.compiled import COMPILE_BACKEND_ENV

    monkeypatch.setenv(COMPILE_BACKEND_ENV, "eager")  # dynamo only: the buffer logic, not C++ codegen
    prompts = random_prompts([3, 6, 9], 151_000, seed=7)
    with make_engine(model_dirs["qwen2"], max_batch_size=4, block_size=4, attention_backend="triton",
                     backend="compiled") as engine:
        runner = engine.backend.attach_decode_graphs(4, engine.max_model_len, capture=False)
        out = engine.run_batch_continuous(prompts, max_new_tokens=3, min_new_tokens=3)
        stats = engine.info()["compile"]
        assert engine.cache_stats()["blocks_used"] == 0
    assert runner.num_replays >= 2 and runner.forward_fn == engine.backend._graph_forward
    assert stats["compiled_steps"] > 0 and not stats["fell_back_to_eager"]
    assert [list(r.token_ids) for r in out] == hf_greedy(model_dirs["qwen2"], prompts, 3)


def _run_cuda(model_dir, prompts, cuda_graphs: bool, new_tokens: int):
    cfg = EngineConfig(model_name=str(model_dir), dtype="float32", device="cuda", max_batch_size=8,
                       batch_timeout_ms=0, attention_backend="triton", cuda_graphs=cuda_graphs,
                       cache=CacheConfig(page_size_tokens=16, num_blocks=256))
    with InferenceEngine(cfg).load() as engine:
        out = engine.run_batch_continuous(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        graphs = engine.info()["cuda_graphs"]
    return [list(r.token_ids) for r in out], graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_matches_eager(model_dirs):
    prompts = random_prompts([3, 17, 40, 5, 64], 151_000, seed=6)
    eager, none = _run_cuda(model_dirs["llama"], prompts, False, 16)
    replayed, graphs = _run_cuda(model_dirs["llama"], prompts, True, 16)
    assert none is None and graphs["captured"] == len(graphs["buckets"]) and graphs["replayed_steps"] > 0
    assert replayed == eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_cuda_graph_replay_matches_eager(model_dirs):
    """``compile_cudagraphs`` with Triton attention captures the compiled graph per decode bucket."""
    prompts = random_prompts([3, 17, 40, 5], 151_000, seed=8)
    eager, _ = _run_cuda(model_dirs["llama"], prompts, False, 8)
    cfg = EngineConfig(model_name=str(model_dirs["llama"]), dtype="float32", device="cuda", max_batch_size=8,
                       batch_timeout_ms=0, attention_backend="triton", backend="compiled", compile_cudagraphs=True,
                       cache=CacheConfig(page_size_tokens=16, num_blocks=256))
    with InferenceEngine(cfg).load() as engine:
        out = engine.run_batch_continuous(prompts, max_new_tokens=8, min_new_tokens=8)
        graphs = engine.info()["cuda_graphs"]
    assert graphs["captured"] == len(graphs["buckets"]) and graphs["replayed_steps"] > 0
    assert [list(r.token_ids) for r in out] == eager
