"""Speculative decoding (draft model and prompt lookup): greedy output identical to the target alone; sampling
preserves the target's distribution (chi-square); acceptance statistics."""

from __future__ import annotations

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import make_engine, random_prompts
from llminfer.backends.speculative import NgramIndex, _VerifyingBackend
from llminfer.models import build_random_model
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.sampler import SamplingState, warp

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


# ---------------------------------------------------------------------------- prompt lookup (n-gram drafts)
def test_ngram_index_proposes_continuation_of_longest_most_recent_match():
    idx = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 6]
    # suffix (6,): last occurred before the end at position 5 -> continuation starts at 6
    assert idx.propose(tokens, 3) == [7, 1, 6]
    tokens += [7]
    # suffix (1, 6, 7)? no; (6, 7) occurred ending at 7 (most recent, not 3) -> continuation from 7
    assert idx.propose(tokens, 2) == [1, 6]
    assert idx.propose([1, 2, 3], 4) == []  # a fresh index: no earlier occurrence of any suffix
    assert NgramIndex(2, 4).propose([3, 4, 9, 3], 4) == []  # only a 1-gram matches, below n_min


def _ngram_engine(model_dir, **kw):
    return make_engine(model_dir, block_size=4, max_batch_size=64, speculative_method="ngram",
                       speculative_num_assistant_tokens=4, speculative_prompt_lookup_min=1, **kw)


def test_ngram_greedy_identical_to_plain(qwen2_dir, plain_greedy):
    # Prompts that repeat themselves, so that lookups find matches and drafts get verified.
    prompts = PROMPTS + [p[:6] * 4 for p in PROMPTS[1:]]
    with make_engine(qwen2_dir, block_size=4) as engine:
        want = [r.token_ids for r in engine.run_batch_continuous(prompts, max_new_tokens=24, ignore_eos=True)]
    assert want[: len(PROMPTS)] == plain_greedy
    with _ngram_engine(qwen2_dir) as engine:
        results = engine.run_batch_continuous(prompts, max_new_tokens=24, ignore_eos=True)
        assert engine.backend.name == "eager+prompt-lookup"
        assert engine.cache_stats()["blocks_used"] == 0
        # Released with their requests' sampling state (finished ids reach the backend with the next step).
        assert engine.backend.indexes and set(engine.backend.indexes) <= set(engine.backend.states)
        engine.run(prompts[0], max_new_tokens=2)
        assert len(engine.backend.indexes) <= 1
    assert [r.token_ids for r in results] == want
    assert sum(r.stats.spec_proposed_tokens for r in results[len(PROMPTS):]) > 0


def test_an_assistant_of_another_vocabulary_is_refused_by_name(qwen2_dir, tmp_path):
    from llminfer.errors import ConfigError

    other = build_random_model(tmp_path / "other", architecture="qwen2", vocab_size=151_700, hidden_size=32,
                               num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    with pytest.raises(ConfigError, match=r"assistant model '.*other' has a vocabulary of \d+ tokens"):
        _spec_engine(qwen2_dir, other)


def test_ngram_config_errors(qwen2_dir):
    from llminfer import EngineConfig
    from llminfer.errors import ConfigError

    with pytest.raises(ConfigError, match="drop assistant_model_name"):
        EngineConfig(speculative_method="ngram", assistant_model_name=str(qwen2_dir)).validate()
    with pytest.raises(ConfigError, match="needs assistant_model_name"):
        EngineConfig(speculative_method="draft_model").validate()
    with pytest.raises(ConfigError, match="speculative_method must be one of"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(ConfigError, match="prompt_lookup_min must be <="):
        EngineConfig(speculative_method="ngram", speculative_prompt_lookup_min=5).validate()
    with pytest.raises(ConfigError, match="eager backend only"):
        make_engine(qwen2_dir, backend="compiled", speculative_method="ngram")


def test_point_mass_draft_verification_keeps_target_distribution():
    """Rejection sampling with a certain (n-gram) draft: accept d with p(d), else resample p without d;
    the first output token is distributed as p."""
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    p = logits[0].softmax(-1)
    state = SamplingState(params, "cpu")
    state.generator = torch.Generator().manual_seed(5)
    n = 4000
    firsts = collections.Counter()
    accepted = 0
    for _ in range(n):
        out, acc = _VerifyingBackend.verify(None, state, logits, [1], [None])
        firsts[out[0]] += 1
        accepted += acc
        assert len(out) == 1 + acc
    assert _chi_square_p(firsts, {i: float(p[i]) for i in range(5)}, n) > 0.01
    assert accepted / n == pytest.approx(float(p[1]), abs=0.03)


SUMMARY_TEXT = ("The lighthouse on the northern cape was built in 1871 from granite quarried on the island. Its lamp "
                "was first fuelled by whale oil, then by kerosene, and from 1923 by electricity. The keepers lived "
                "in a cottage at the foot of the tower with their families, and a school boat visited once a week. "
                "In 1968 the light was automated and the last keeper left the island. Today the cottage is a small "
                "museum that opens in the summer months.")


@pytest.mark.slow
def test_ngram_greedy_identical_on_trained_model(trained_model):
    """On trained weights the summary copies spans of the prompt: drafts are accepted, output unchanged."""
    kw = dict(dtype="float32", block_size=16)
    messages = [{"role": "user", "content": "Summarise this text in two sentences.\n\n" + SUMMARY_TEXT}]
    with make_engine(trained_model, **kw) as engine:
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        want = engine.run(ids, max_new_tokens=64)
    with make_engine(trained_model, speculative_method="ngram", **kw) as engine:
        got = engine.run(ids, max_new_tokens=64)
    assert got.token_ids == want.token_ids
    assert got.stats.spec_accepted_tokens > 0
