"""Decoding controls: property tests against the transformers logits processors, and behaviour on the
built-in model."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from helpers import make_engine
from llminfer import InvalidRequestError, SamplingParams
from llminfer.models import builtin_model_path
from llminfer.sampling.sampler import SamplingState, draw, generator_seed, inverse_cdf_draw, warp

VOCAB = 24
logits_st = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=VOCAB, max_size=VOCAB)
history_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30)


def _state(params, history, bad=()):
    return SamplingState(params, "cpu", history, bad_words_ids=bad)


def _same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(ours)
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=1e-6, atol=1e-6)


@settings(max_examples=200, deadline=None)
@given(logits=logits_st, history=history_st, penalty=st.floats(0.2, 3.0))
def test_repetition_penalty_matches_hf(logits, history, penalty):
    x = torch.tensor(logits)
    ours = x.clone()
    _state(SamplingParams(repetition_penalty=penalty), history).process(ours)
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), x[None].clone())[0]
    _same(ours, theirs)


@settings(max_examples=200, deadline=None)
@given(logits=logits_st, history=st.lists(st.integers(0, 5), min_size=1, max_size=40), n=st.integers(1, 4))
def test_no_repeat_ngram_matches_hf(logits, history, n):
    x = torch.tensor(logits)
    ours = x.clone()
    _state(SamplingParams(no_repeat_ngram_size=n), history).process(ours)
    theirs = NoRepeatNGramLogitsProcessor(n)(torch.tensor([history]), x[None].clone())[0]
    _same(ours, theirs)


@settings(max_examples=200, deadline=None)
@given(logits=logits_st, history=st.lists(st.integers(0, 5), min_size=1, max_size=20),
       bad=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4,
                    unique=True))
def test_bad_words_match_hf(logits, history, bad):
    x = torch.tensor(logits)
    ours = x.clone()
    _state(SamplingParams(), history, bad=bad).process(ours)
    theirs = NoBadWordsLogitsProcessor([list(b) for b in bad])(torch.tensor([history]), x[None].clone())[0]
    _same(ours, theirs)


@settings(max_examples=300, deadline=None)
@given(logits=logits_st, temperature=st.floats(0.1, 2.0), top_k=st.integers(0, VOCAB + 3),
       top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.5))
def test_warpers_match_hf(logits, temperature, top_k, top_p, min_p):
    x = torch.tensor(logits)[None]
    ours = warp(x.clone(), [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)])
    ids = torch.zeros(1, 1, dtype=torch.long)
    theirs = TemperatureLogitsWarper(temperature)(ids, x.clone())
    if top_k:
        theirs = TopKLogitsWarper(top_k)(ids, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(ids, theirs)
    if min_p > 0:
        theirs = MinPLogitsWarper(min_p)(ids, theirs)
    _same(ours[0], theirs[0])


@settings(max_examples=200, deadline=None)
@given(logits=logits_st, typical_p=st.floats(0.05, 0.99), other=logits_st)
def test_typical_p_matches_hf_and_leaves_other_rows_alone(logits, typical_p, other):
    x = torch.tensor([logits, other])
    ours = warp(x.clone(), [SamplingParams(temperature=1.0, typical_p=typical_p), SamplingParams(temperature=1.0)])
    theirs = TypicalLogitsWarper(typical_p)(torch.zeros(1, 1, dtype=torch.long), x[:1].clone())
    _same(ours[0], theirs[0])
    _same(ours[1], x[1])


@settings(max_examples=200, deadline=None)
@given(logits=logits_st, epsilon=st.floats(1e-4, 0.99), other=logits_st)
def test_epsilon_cutoff_matches_hf_and_leaves_other_rows_alone(logits, epsilon, other):
    x = torch.tensor([logits, other])
    ours = warp(x.clone(), [SamplingParams(temperature=1.0, epsilon_cutoff=epsilon), SamplingParams(temperature=1.0)])
    theirs = EpsilonLogitsWarper(epsilon)(torch.zeros(1, 1, dtype=torch.long), x[:1].clone())
    _same(ours[0], theirs[0])
    _same(ours[1], x[1])


@pytest.mark.parametrize("top_p", [1 - 2 ** -30, 0.9999999999999999, 1 - 1e-7])
def test_top_p_just_below_one_matches_hf(top_p):
    """A top_p that rounds to 1.0 in float32 still drops what Hugging Face drops (found by hypothesis: 1 - top_p
    must be taken before rounding)."""
    x = torch.tensor([[0.0] * 23 + [40.0]])  # the 23 small tokens hold ~1e-16 of the mass
    ours = warp(x.clone(), [SamplingParams(temperature=1.0, top_p=top_p)])
    theirs = TopPLogitsWarper(top_p)(torch.zeros(1, 1, dtype=torch.long), x.clone())
    _same(ours[0], theirs[0])
    assert torch.isinf(ours[0, :23]).all()


@st.composite
def _sparse_probs(draw_):
    vocab = draw_(st.integers(1, 2600))  # up to three 1024-token blocks, the last one partial
    mass = draw_(st.dictionaries(st.integers(0, vocab - 1), st.floats(1e-12, 1.0), min_size=1, max_size=12))
    probs = torch.zeros(vocab)
    for token, p in mass.items():
        probs[token] = p
    return probs / probs.sum()


@settings(max_examples=300, deadline=None)
@given(probs=_sparse_probs(), u=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(1.0 - 2 ** -53)))
def test_inverse_cdf_draw_lands_in_the_tokens_interval(probs, u):
    token = inverse_cdf_draw(probs[None], torch.tensor([u], dtype=torch.float64))[0]
    assert probs[token] > 0
    cum = probs.double().cumsum(0)
    target = u * float(cum[-1])
    lo, hi = float(cum[token] - probs[token]), float(cum[token])
    assert lo - 1e-6 <= target <= hi + 1e-6


def test_a_row_without_mass_gets_its_argmax_and_spares_the_batch():
    vocab = 3000
    good = torch.zeros(vocab)
    good[2500] = 1.0
    nan_at_9 = torch.zeros(vocab)
    nan_at_9[9] = float("nan")
    probs = torch.stack([torch.full((vocab,), float("nan")), torch.zeros(vocab), nan_at_9, good])
    assert inverse_cdf_draw(probs, torch.full((4,), 0.5, dtype=torch.float64)) == [0, 0, 9, 2500]


def test_draw_matches_the_distribution():
    probs = torch.zeros(2500)
    probs[[0, 2, 1500, 2499]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20_000
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor(draw(probs.expand(n, -1), [gen] * n)), minlength=2500)
    assert int(counts.sum() - counts[[0, 2, 1500, 2499]].sum()) == 0
    for token, p in ((0, 0.1), (2, 0.2), (1500, 0.3), (2499, 0.4)):
        sigma = (n * p * (1 - p)) ** 0.5
        assert abs(int(counts[token]) - n * p) < 5 * sigma


needs_kernel = pytest.mark.skipif(not __import__("llminfer.kernels.build", fromlist=["x"]).skinny_linear_available(),
                                  reason="llminfer's CPU kernel does not build here")


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(probs=_sparse_probs(), u=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(1.0 - 2 ** -53)),
       temperature=st.sampled_from([1.0, 0.5, 1.7]))
def test_fused_draw_lands_in_the_tokens_interval_and_never_on_a_masked_token(probs, u, temperature):
    """``softmax_draw`` on log-probabilities with the masked tokens at -inf: a token of positive mass whose
    interval (of the tempered softmax, to the exponentials' rounding) holds the target."""
    logits = torch.where(probs > 0, probs.log(), torch.tensor(float("-inf")))[None]
    token = int(torch.ops.llminfer_cpu.softmax_draw(logits, torch.tensor([1 / temperature]),
                                                    torch.tensor([u], dtype=torch.float64))[0])
    tempered = (logits[0] / temperature).softmax(-1).double()
    assert probs[token] > 0
    cum = tempered.cumsum(0)
    target = u * float(cum[-1])
    assert float(cum[token] - tempered[token]) - 1e-5 <= target <= float(cum[token]) + 1e-5


@needs_kernel
def test_fused_draw_is_the_torch_draw_and_hands_back_rows_it_cannot_draw():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 151_646, generator=gen) * 3
    uniforms = torch.rand(64, dtype=torch.float64, generator=gen)
    temperatures = torch.tensor([0.6, 1.0, 1.9, 1.0] * 16)
    fused = torch.ops.llminfer_cpu.softmax_draw(logits, 1 / temperatures, uniforms).tolist()
    assert fused == inverse_cdf_draw((logits / temperatures[:, None]).softmax(-1), uniforms)
    bad = logits[:3].clone()
    bad[0, 7], bad[1], bad[2, 4] = float("nan"), float("-inf"), float("inf")
    assert torch.ops.llminfer_cpu.softmax_draw(bad, torch.ones(3), uniforms[:3]).tolist() == [-1, -1, -1]


@needs_kernel
def test_sample_takes_the_fused_draw_for_plain_rows_only_and_a_rows_token_ignores_its_batch(monkeypatch):
    """Temperature-only rows go to ``softmax_draw``, a top-p row and a NaN row the torch way; a seeded row draws
    the same token alone and beside them."""
    from llminfer.sampling import sampler

    calls = []
    op = torch.ops.llminfer_cpu.softmax_draw
    monkeypatch.setattr(torch.ops.llminfer_cpu, "softmax_draw", lambda *a: calls.append(a[0].shape[0]) or op(*a))
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * 2
    logits[2, 11] = float("nan")
    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=0.8, top_p=0.9, seed=6),
              SamplingParams(temperature=1.0, seed=7)]
    states = [SamplingState(p, "cpu") for p in params]
    batch, _ = sampler.sample(logits.clone(), states)
    assert calls == [2]  # rows 0 and 2; row 2 (NaN) is handed back and drawn the torch way
    assert batch[2] == 0  # as before: the NaN row's softmax is NaN everywhere, inverse_cdf_draw gives its first index
    alone, _ = sampler.sample(logits[:1].clone(), [SamplingState(params[0], "cpu")])
    assert alone[0] == batch[0]


def test_presence_and_frequency_follow_openai():
    x = torch.zeros(VOCAB)
    state = _state(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2])  # prompt: not counted
    for t in (3, 3, 4):
        state.append(t)
    state.process(x)
    assert x[3] == pytest.approx(-(0.5 + 2 * 0.25)) and x[4] == pytest.approx(-(0.5 + 0.25))
    assert x[1] == 0 and x[2] == 0


# ---------------------------------------------------------------------------------------- on the model
@pytest.fixture(scope="module")
def engine():
    with make_engine(builtin_model_path(), max_batch_size=16, block_size=16) as eng:
        yield eng


def test_no_repeat_ngram_in_200_tokens(engine):
    free = engine.run("Repeat after me", max_new_tokens=200, ignore_eos=True, repetition_penalty=1.0)
    grams = lambda ids, n: [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]  # noqa: E731
    r = engine.run("Repeat after me", max_new_tokens=200, ignore_eos=True, no_repeat_ngram_size=3)
    assert len(r.token_ids) == 200
    g = grams(list(r.token_ids), 3)
    assert len(g) == len(set(g))
    # The constraint had something to do: unconstrained greedy output repeats 3-grams (the model loops).
    g_free = grams(list(free.token_ids), 3)
    assert len(g_free) != len(set(g_free))


def test_bad_words_never_appear_in_50_samples(engine):
    tok = engine.tokenizer
    greedy = engine.run("The weather today", max_new_tokens=8, ignore_eos=True)
    word = tok.decode([greedy.token_ids[0]]).strip()
    assert word
    kw = dict(max_new_tokens=8, ignore_eos=True, temperature=0.7, top_k=3)
    seqs = engine.tokenizer
    variants = {tuple(seqs.encode(" " + word, add_special_tokens=False)), tuple(seqs.encode(word, add_special_tokens=False))}

    def contains(ids):
        ids = list(ids)
        return any(ids[i : i + len(v)] == list(v) for v in variants for i in range(len(ids) - len(v) + 1))

    free = engine.run_batch_continuous(["The weather today"] * 50, **kw, seed=None)
    assert sum(contains(r.token_ids) for r in free) > 0  # the ban has work to do
    banned = engine.run_requests([engine.make_request("The weather today", seed=s, bad_words=[word], **kw)
                                  for s in range(50)])
    assert not any(contains(r.token_ids) for r in banned)


def test_force_words_appear_when_there_is_room(engine):
    phrases = ["paged attention", "KV cache"]
    for seed in range(5):
        r = engine.run("Explain", max_new_tokens=12, temperature=0.8, seed=seed, force_words=phrases)
        for p in phrases:
            assert p in r.generated_text
    greedy = engine.run("Explain", max_new_tokens=12, force_words=phrases)
    assert all(p in greedy.generated_text for p in phrases)


def test_seed_independent_of_batch_composition(engine):
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=77)
    alone = engine.run("Seeded prompt", **kw).token_ids
    others = [engine.make_request(f"filler {i} " * (i + 1), max_new_tokens=12, temperature=1.0) for i in range(15)]
    target = engine.make_request("Seeded prompt", **kw)
    first = engine.run_requests([target, *others])[0].token_ids
    target = engine.make_request("Seeded prompt", **kw)
    others = [engine.make_request(f"filler {i} " * (i + 1), max_new_tokens=12, temperature=1.0) for i in range(15)]
    middle = engine.run_requests([*others[:7], target, *others[7:]])[7].token_ids
    assert alone == first == middle


def test_logprobs_are_consistent(engine):
    r = engine.run("Logprobs", max_new_tokens=6, logprobs=3)
    assert len(r.logprobs) == 6
    for tid, lp in zip(r.token_ids, r.logprobs):
        assert lp.token_id == tid and lp.logprob <= 0
        assert len(lp.top) == 3
        assert lp.top[0][0] == tid  # greedy picks the top-1
        assert lp.top[0][1] == pytest.approx(lp.logprob)


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"n": 0}, "n"), ({"stop_sequences": [""]}, "stop_sequences"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
    ({"bad_words": [""]}, "bad_words"), ({"min_p": 2.0}, "min_p"),
])
def test_bad_values_name_the_parameter(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


@given(st.integers(-(2**63), 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_seeds_differing_in_their_high_bits_seed_different_cpu_generators(seed):
    """torch's CPU generator keeps a seed's low 32 bits: llminfer folds the high ones in first, leaving seeds
    below 2**32 as they are, and CUDA's (all 64 bits used) as given."""
    folded = generator_seed(seed, torch.device("cpu"))
    assert 0 <= folded < 2**32
    if 0 <= seed < 2**32:
        assert folded == seed
    twin = (seed + 2**32) % 2**64  # the same low 32 bits: the same generator under torch's own seeding
    assert generator_seed(twin, torch.device("cpu")) != folded
    assert generator_seed(seed, torch.device("cuda")) == seed


def test_a_negative_seed_draws_apart_from_its_unsigned_twin():
    params = [SamplingParams(temperature=1.0, seed=s) for s in (-1, 2**63 - 1, 2**32, 0)]  # pairs torch seeds alike
    probs = torch.full((1, 1000), 1e-3)
    draws = []
    for p in params:
        generator = SamplingState(p, "cpu").generator
        draws.append([draw(probs, [generator])[0] for _ in range(8)])
    assert len({tuple(d) for d in draws}) == 4
