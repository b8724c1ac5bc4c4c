"""Speculative decoding: greedy output identical to the target alone; sampling preserves the target's
distribution (chi-square); acceptance statistics."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import make_engine, random_prompts
from llminfer.models import build_random_model
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.sampler import warp

PROMPTS = random_prompts([3, 11, 26, 40], 150_000, seed=61)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("draft") / "d", architecture="qwen2", hidden_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=9)


def _spec_engine(target, draft, **kw):
    return make_engine(target, block_size=4, max_batch_size=64, assistant_model_name=str(draft),
                       speculative_num_assistant_tokens=4, speculative_confidence_threshold=0.0, **kw)


@pytest.fixture(scope="module")
def plain_greedy(qwen2_dir):
    with make_engine(qwen2_dir, block_size=4) as engine:
        return [r.token_ids for r in engine.run_batch_continuous(PROMPTS, max_new_tokens=24, ignore_eos=True)]


@pytest.mark.parametrize("which", ["self", "small"])
def test_greedy_identical_to_target(qwen2_dir, draft_dir, plain_greedy, which):
    draft = qwen2_dir if which == "self" else draft_dir
    with _spec_engine(qwen2_dir, draft) as engine:
        results = engine.run_batch_continuous(PROMPTS, max_new_tokens=24, ignore_eos=True)
        steps = engine.backend.num_steps
        assert engine.cache_stats()["blocks_used"] == 0
    assert [r.token_ids for r in results] == plain_greedy
    rates = [r.stats.spec_acceptance_rate for r in results]
    assert all(r.stats.spec_proposed_tokens > 0 for r in results)
    if which == "self":
        assert rates == [1.0] * len(PROMPTS)  # the target drafting for itself is always right
        assert steps < 24  # several tokens per step
    else:
        assert all(0.0 <= x <= 1.0 for x in rates)


def test_requests_needing_history_fall_back_to_plain_decoding(qwen2_dir):
    with _spec_engine(qwen2_dir, qwen2_dir) as engine:
        r = engine.run(PROMPTS[1], max_new_tokens=10, repetition_penalty=1.3, ignore_eos=True)
    with make_engine(qwen2_dir, block_size=4) as engine:
        want = engine.run(PROMPTS[1], max_new_tokens=10, repetition_penalty=1.3, ignore_eos=True)
    assert r.token_ids == want.token_ids and r.stats.spec_proposed_tokens == 0


def _chi_square_p(observed: dict, expected: dict, n: int) -> float:
    cells = [k for k in expected if expected[k] * n >= 5]
    stat = sum((observed.get(k, 0) - expected[k] * n) ** 2 / (expected[k] * n) for k in cells)
    rest_obs = n - sum(observed.get(k, 0) for k in cells)
    rest_exp = n * (1 - sum(expected[k] for k in cells))
    df = len(cells) - 1
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _target_joint(model_dir, prompt, params) -> dict:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    joint = {}
    with torch.inference_mode():
        p1 = warp(model(torch.tensor([prompt])).logits[0, -1:].float(), [params]).softmax(-1)[0]
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = warp(model(torch.tensor([prompt + [t1]])).logits[0, -1:].float(), [params]).softmax(-1)[0]
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("which", ["self", "small"])
def test_sampling_preserves_target_distribution(qwen2_dir, draft_dir, which):
    """Joint distribution of the first two tokens (the second one goes through draft + verification)."""
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.05, top_k=4)  # a few likely tokens: a small effective vocabulary
    expected = _target_joint(qwen2_dir, prompt, params)
    n = 2000  # chi-square over ~16 cells: 2,000 samples still catch a wrong verification rule
    draft = qwen2_dir if which == "self" else draft_dir
    with _spec_engine(qwen2_dir, draft) as engine:
        reqs = [engine.make_request(prompt, max_new_tokens=3, ignore_eos=True, temperature=0.05, top_k=4, seed=s)
                for s in range(n)]
        results = engine.run_requests(reqs)
    proposed = sum(r.stats.spec_proposed_tokens for r in results)
    assert proposed >= n  # every request went through speculation for its second token
    observed = collections.Counter((r.token_ids[0], r.token_ids[1]) for r in results)
    assert _chi_square_p(observed, expected, n) > 0.01
