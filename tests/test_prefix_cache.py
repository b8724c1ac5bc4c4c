"""Prefix caching: cache on == cache off token for token (greedy fp32), and the known traps."""

from __future__ import annotations

import pytest

from helpers import make_engine, random_prompts
from llminfer import KVCacheManager
from llminfer.kv import hashing

NEW = 10


def _prompts():
    system = random_prompts([23], 150_000, seed=11)[0]
    tails = random_prompts([1, 5, 9, 14], 150_000, seed=12)
    shared = [system + t for t in tails]
    repeated = [shared[1]] * 3
    aligned = random_prompts([16], 150_000, seed=13)[0]  # 4 full blocks of 4: a full hit next time
    base = random_prompts([17], 150_000, seed=14)[0]
    near = [base, base[:-1] + [(base[-1] + 1) % 150_000]]  # all but the last token shared
    block = random_prompts([4], 150_000, seed=15)[0]
    self_similar = block * 3 + [5, 6]  # identical blocks at different positions: a parent check matters
    return [self_similar] + shared + repeated + [aligned, aligned] + near + [self_similar]


def _run(engine, prompts):
    # First one alone (fills the cache), then the rest together: hits happen both across steps and
    # within one batch.
    first = engine.run(prompts[0], max_new_tokens=NEW, min_new_tokens=NEW)
    rest = engine.run_batch_continuous(prompts[1:], max_new_tokens=NEW, min_new_tokens=NEW)
    return [first, *rest]


@pytest.fixture(scope="module")
def cache_off(qwen2_dir):
    with make_engine(qwen2_dir, block_size=4, prefix_cache=False) as engine:
        return [r.token_ids for r in _run(engine, _prompts())]


def test_cache_on_equals_cache_off(qwen2_dir, cache_off):
    with make_engine(qwen2_dir, block_size=4, prefix_cache=True) as engine:
        results = _run(engine, _prompts())
        stats = engine.cache_stats()
    assert [r.token_ids for r in results] == cache_off
    assert stats["hits"] >= 6 and stats["cached_tokens"] > 0
    assert any(r.stats.cache_hit for r in results)
    assert stats["blocks_used"] == 0


def test_forced_hash_collisions_stay_correct(qwen2_dir, cache_off, monkeypatch):
    monkeypatch.setattr(hashing, "hash_block_tokens", lambda parent, tokens, extra=(): b"\x01" * 32)
    with make_engine(qwen2_dir, block_size=4, prefix_cache=True) as engine:
        results = _run(engine, _prompts())
    assert [r.token_ids for r in results] == cache_off


def test_full_hit_on_block_aligned_prompt(qwen2_dir):
    prompt = random_prompts([16], 150_000, seed=21)[0]
    with make_engine(qwen2_dir, block_size=4) as engine:
        a = engine.run(prompt, max_new_tokens=NEW, min_new_tokens=NEW)
        b = engine.run(prompt, max_new_tokens=NEW, min_new_tokens=NEW)
    assert a.token_ids == b.token_ids
    assert not a.stats.cache_hit
    assert b.stats.cached_tokens == 12  # 3 of 4 blocks: the last token is always computed


def test_preemption_then_prefix_hit(qwen2_dir, cache_off):
    """Trap 2: a preempted request resumes through a prefix hit on its own surviving blocks."""
    prompts = _prompts()
    with make_engine(qwen2_dir, block_size=4, num_blocks=24, max_batch_size=8) as engine:
        results = _run(engine, prompts)
        preemptions = sum(r.stats.num_preemptions for r in results)
        assert engine.cache_stats()["blocks_used"] == 0
    assert [r.token_ids for r in results] == cache_off
    assert preemptions > 0


def test_preempted_request_resumes_through_a_prefix_hit():
    """Trap 2, at the scheduler: after a preemption the victim is re-admitted with its surviving full
    blocks as a prefix hit (its first chunk starts past 0), and the hit is counted."""
    from llminfer.core.scheduler import Scheduler, SchedulerLimits
    from llminfer.protocols.messages import StepOutput, TokenizedRequest
    from llminfer.sampling.params import SamplingParams

    kv = KVCacheManager(num_blocks=12, block_size=2)
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_batched_tokens=64, max_model_len=1000,
                                      watermark=0.0), kv)
    for rid, first in (("a", 10), ("b", 40)):
        sched.add_request(TokenizedRequest(rid, tuple(range(first, first + 8)), SamplingParams(max_new_tokens=12),
                                           0))
    hits_at_preemption = None
    resumed_at = None
    for _ in range(200):
        plan, _ = sched.schedule()
        if hits_at_preemption is None and sched.num_preemptions:
            hits_at_preemption = kv.num_hits
        for seq in plan.sequences:
            if hits_at_preemption is not None and seq.request_id == "b" and resumed_at is None:
                resumed_at = seq.start_position
        sampled = {s.request_id: 7 for s in plan.sequences if s.sample}
        sched.update_from_output(plan, StepOutput(plan.step_id, sampled, 0, 0))
        if not sched.has_unfinished():
            break
    assert hits_at_preemption is not None, "the pool was sized to force a preemption"
    assert resumed_at is not None and resumed_at > 0
    assert kv.num_hits > hits_at_preemption
    assert kv.pool.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("pinned", [True, False])
def test_prefix_key_pins_the_shared_prefix_through_eviction(qwen2_dir, pinned):
    """A pinned system prompt survives a flood of other prompts that evicts every unpinned block; the
    output is the same either way (greedy fp32)."""
    system = random_prompts([24], 150_000, seed=41)[0]
    questions = random_prompts([3, 5], 150_000, seed=42)
    key = KVCacheManager.hash_prefix("the system prompt") if pinned else None
    flood = random_prompts([40] * 6, 150_000, seed=43)
    with make_engine(qwen2_dir, block_size=4, num_blocks=40) as engine:
        engine.run(system + questions[0], max_new_tokens=NEW, prefix_key=key)
        engine.run(system + questions[1], max_new_tokens=NEW, prefix_key=key)  # narrows the pin to `system`
        for prompt in flood:  # each fills most of the pool: every free block is reused
            engine.run(prompt, max_new_tokens=NEW)
        again = engine.run(system + questions[1], max_new_tokens=NEW, prefix_key=key)
        stats = engine.cache_stats()
    assert again.stats.cache_hit is pinned
    assert stats["blocks_pinned"] == (6 if pinned else 0)  # the 24-token system prompt: 6 blocks of 4
    with make_engine(qwen2_dir, block_size=4, num_blocks=40, prefix_cache=False) as engine:
        assert engine.run(system + questions[1], max_new_tokens=NEW).token_ids == again.token_ids


def _cached_seq(kv, request_id, token_ids):
    seq = _Seq(request_id, token_ids)
    assert kv.allocate_slots(seq, len(token_ids))
    kv.cache_full_blocks(seq, len(token_ids))
    return seq


def test_a_token_id_key_pins_exactly_its_blocks_and_a_text_key_narrows_to_the_shared_run():
    kv = KVCacheManager(16, 2)
    a = _cached_seq(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.pin_prefix(KVCacheManager.hash_prefix([1, 2, 3, 4], 2), a) == 2
    assert kv.pin_prefix("text", a) == 4
    b = _cached_seq(kv, "b", [1, 2, 3, 4, 5, 6, 9, 9])
    assert kv.pin_prefix("text", b) == 3
    kv.check_integrity()


def test_pins_give_way_to_requests_oldest_first_and_to_a_reset():
    kv = KVCacheManager(8, 2, max_pinned_fraction=1.0)
    kv.pin_prefix("first", _cached_seq(kv, "a", [1, 2, 3, 4]))
    kv.pin_prefix("second", _cached_seq(kv, "c", [5, 6, 7, 8]))
    kv.free("a")
    kv.free("c")
    assert kv.pool.num_free_blocks == 4
    assert kv.allocate_slots(_Seq("big", list(range(100, 112))), 12)  # 6 blocks: one pin must go
    assert list(kv.pins) == ["second"]
    kv.check_integrity()
    kv.free("big")
    kv.reset_cache()
    assert not kv.pins and kv.pool.num_free_blocks == 8


def test_pins_hold_at_most_their_share_of_the_pool():
    kv = KVCacheManager(8, 2, max_pinned_fraction=0.5)
    kv.pin_prefix("first", _cached_seq(kv, "a", [1, 2, 3, 4]))
    kv.pin_prefix("second", _cached_seq(kv, "c", [5, 6, 7, 8, 9, 10]))  # 2 + 3 > 4: the oldest goes
    assert list(kv.pins) == ["second"]


class _Seq:
    def __init__(self, request_id, token_ids):
        self.request_id = request_id
        self.token_ids = token_ids
        self.block_hashes = []
        self.extra_keys = ()


def test_adapters_and_salts_never_share_blocks(qwen2_dir):
    prompt = random_prompts([20], 150_000, seed=31)[0]
    with make_engine(qwen2_dir, block_size=4) as engine:
        engine.run(prompt, max_new_tokens=2)
        salted = engine.run(prompt, max_new_tokens=2, cache_salt="tenant-b")
        again = engine.run(prompt, max_new_tokens=2)
    assert not salted.stats.cache_hit
    assert again.stats.cache_hit


def test_stats_and_trace_share_one_set_of_timestamps(qwen2_dir):
    """The stats record and the trace come from the core's timestamps: the trace's intervals are the
    stats' to the nanosecond, and the intervals nest (queue + prefill <= TTFT <= latency)."""
    with make_engine(qwen2_dir, block_size=4) as engine:
        r = engine.run(random_prompts([40], 150_000, seed=41)[0], max_new_tokens=4)
        events = {(e.stage, e.event): e.t_ns for e in engine.tracer.snapshot() if e.request_id == r.request_id}
    s = r.stats
    assert {("scheduler", "queued"), ("scheduler", "first_scheduled"), ("sink", "first_token"),
            ("scheduler", "finished")} <= set(events)
    queue_ns = events["scheduler", "first_scheduled"] - events["scheduler", "queued"]
    prefill_ns = events["scheduler", "prefill_done"] - events["scheduler", "first_scheduled"]
    assert s.queue_time_ms == queue_ns / 1e6 and s.prefill_time_ms == prefill_ns / 1e6
    assert s.queue_time_ms + s.prefill_time_ms <= s.ttft_ms <= s.total_latency_ms


def test_collision_guard_checks_tokens_and_parent(monkeypatch):
    """With every hash forced equal, only a block whose tokens, extra keys and parent all match is reused."""
    from types import SimpleNamespace

    monkeypatch.setattr(hashing, "hash_block_tokens", lambda parent, tokens, extra=(): b"\x01" * 32)
    kv = KVCacheManager(num_blocks=16, block_size=4)
    block = [11, 12, 13, 14]

    def seq(rid, tokens, extra=()):
        return SimpleNamespace(request_id=rid, token_ids=tokens, block_hashes=[], extra_keys=extra)

    first = seq("a", block * 3 + [5, 6])
    assert kv.allocate_slots(first, 14)
    kv.cache_full_blocks(first, 14)
    kv.free("a")
    # Same tokens again: block 0 matches; blocks 1 and 2 hold the same tokens but a different parent.
    hits, n = kv.find_cached_prefix(seq("b", block * 3 + [5, 6]))
    assert n == 4 and len(hits) == 1
    # Different first-block tokens under the same (forced) hash: no hit at all.
    assert kv.find_cached_prefix(seq("c", [1, 2, 3, 4] + block + [5]))[1] == 0
    # Same tokens, other extra keys (another adapter): no hit.
    assert kv.find_cached_prefix(seq("d", block * 3 + [5], ("adapter:x",)))[1] == 0


def test_n_samples_share_prompt_blocks(qwen2_dir):
    prompt = random_prompts([64], 150_000, seed=51)[0]
    with make_engine(qwen2_dir, block_size=4, max_batch_size=8) as engine:
        results = engine.run_n(prompt, n=4, max_new_tokens=6, temperature=1.0, seed=3)
        stats = engine.cache_stats()
        alone = engine.run(prompt, max_new_tokens=6, temperature=1.0, seed=4)
    # One request computed the prompt; the three others reused all of its full blocks but the last token's.
    assert stats["hits"] == 3
    assert [r.stats.cached_tokens for r in results].count(60) == 3
    assert len({r.token_ids for r in results}) > 1  # different seeds, different samples
    assert results[1].token_ids == alone.token_ids  # seed + 1, same tokens as alone


def test_identical_prompts_together_compute_prompt_once(qwen2_dir):
    prompt = random_prompts([40], 150_000, seed=52)[0]
    with make_engine(qwen2_dir, block_size=4, max_batch_size=8, prefix_cache=False) as off:
        want = off.run(prompt, max_new_tokens=5, min_new_tokens=5).token_ids
    with make_engine(qwen2_dir, block_size=4, max_batch_size=8) as engine:
        results = engine.run_batch_continuous([prompt] * 5, max_new_tokens=5, min_new_tokens=5)
    assert all(r.token_ids == want for r in results)
    assert sum(r.stats.cache_hit for r in results) == 4
