"""Hypothesis stateful tests of the scheduler and the block pool, with a fake model step."""

from __future__ import annotations

import time
import zlib

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llminfer.core.scheduler import Scheduler, SchedulerLimits
from llminfer.kv.manager import KVCacheManager
from llminfer.protocols.messages import StepOutput, TokenizedRequest
from llminfer.sampling.params import SamplingParams

SHARED_PREFIXES = [tuple(range(100, 100 + n)) for n in (0, 5, 8, 13)]


def fake_token(request_id: str, position: int) -> int:
    # zlib.crc32, not hash(): string hashes differ per process, and a failing example must replay.
    return zlib.crc32(f"{request_id}:{position}".encode()) % 7 + 1


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 40),
        block_size=st.sampled_from([1, 2, 4]),
        max_batch=st.integers(1, 6),
        budget=st.integers(1, 48),
        threshold=st.sampled_from([0, 3, 16]),
        caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
    )
    def setup(self, num_blocks, block_size, max_batch, budget, threshold, caching, policy):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_cache=caching)
        self.limits = SchedulerLimits(max_batch_size=max_batch, max_num_batched_tokens=budget,
                                      max_model_len=10_000, long_prefill_token_threshold=threshold,
                                      watermark=0.1, policy=policy)
        self.sched = Scheduler(self.limits, self.kv, eos_token_ids=())
        self.counter = 0
        self.live: set[str] = set()
        self.finished: set[str] = set()
        self.generated: dict[str, list[int]] = {}

    @rule(prefix=st.sampled_from(SHARED_PREFIXES), tail=st.lists(st.integers(1, 9), min_size=0, max_size=12),
          max_new=st.integers(1, 10), priority=st.integers(0, 3), prefix_key=st.sampled_from([None, "a", "b"]))
    def add(self, prefix, tail, max_new, priority, prefix_key):
        prompt = prefix + tuple(tail)
        if not prompt:
            prompt = (1,)
        self.counter += 1
        rid = f"r{self.counter}"
        msg = TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=max_new), time.perf_counter_ns(),
                               priority=priority, prefix_key=prefix_key)
        try:
            self.sched.add_request(msg)
        except Exception as exc:  # the only allowed rejection: it could never fit
            assert type(exc).__name__ == "CapacityError"
            assert self.kv.blocks_needed(len(prompt) + max_new - 1) > self.kv.num_blocks
            return
        self.live.add(rid)
        self.generated[rid] = []

    def _step(self, abort_during_step=None):
        plan, failures = self.sched.schedule()
        assert plan.num_tokens <= self.limits.max_num_batched_tokens, "token budget exceeded"
        assert len(plan.sequences) <= self.limits.max_batch_size
        for seq in plan.sequences:
            assert len(seq.token_ids) >= 1
            assert len(seq.block_table) * self.kv.block_size >= seq.start_position + len(seq.token_ids)
        for f in failures:
            self.live.discard(f.request_id)
            self.finished.add(f.request_id)
        sampled = {s.request_id: fake_token(s.request_id, s.start_position + len(s.token_ids))
                   for s in plan.sequences if s.sample}
        if abort_during_step is not None and plan.sequences:
            # The core takes an abort between schedule() and update_from_output() when it arrives while
            # the step runs: the plan still names the request, the update must skip it.
            rid = plan.sequences[abort_during_step % len(plan.sequences)].request_id
            if self.sched.finish_request(rid) is not None:
                self.live.discard(rid)
                self.finished.add(rid)
        updates = self.sched.update_from_output(plan, StepOutput(plan.step_id, sampled, 0, 0))
        for u in updates:
            assert u.request_id not in self.finished or u.finish_reason is not None, "update after finish"
            self.generated[u.request_id].extend(u.new_token_ids)
            if u.finish_reason is not None:
                self.live.discard(u.request_id)
                self.finished.add(u.request_id)
        return plan

    @rule()
    def step(self):
        self._step()

    @rule(which=st.integers(0, 5))
    def step_with_abort_in_flight(self, which):
        self._step(abort_during_step=which)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.sched.finish_request(rid) is not None
        self.live.discard(rid)
        self.finished.add(rid)

    @rule()
    def drain(self):
        """Liveness: with no new arrivals every request finishes within a bounded number of steps."""
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self._step()
        assert not self.sched.has_unfinished(), "requests starved"
        assert not self.live
        pinned = {b.block_id for blocks in self.kv.pins.values() for b in blocks}
        assert self.kv.pool.num_free_blocks + len(pinned) == self.kv.num_blocks, "blocks leaked at quiescence"
        assert len(pinned) <= self.kv.max_pinned_blocks

    @rule(key=st.sampled_from(["a", "b"]))
    def unpin(self, key):
        self.kv.unpin_prefix(key)

    @invariant()
    def invariants(self):
        if hasattr(self, "sched"):
            self.sched.check_invariants()


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestScheduler = SchedulerMachine.TestCase


class BlockPoolMachine(RuleBasedStateMachine):
    """The pool alone: allocate / touch cached / free, with ref counts tracked independently."""

    @initialize(n=st.integers(1, 16))
    def setup(self, n):
        from llminfer.kv.block_pool import BlockPool

        self.pool = BlockPool(n)
        self.held: list[list] = []
        self.next_hash = 0

    @precondition(lambda self: self.pool.num_free_blocks > 0)
    @rule(data=st.data())
    def allocate(self, data):
        k = data.draw(st.integers(1, self.pool.num_free_blocks))
        blocks = self.pool.allocate(k)
        for b in blocks:
            self.next_hash += 1
            self.pool.cache(b, self.next_hash.to_bytes(32, "little"), (self.next_hash,), (), None)
        self.held.append(blocks)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def share(self, data):
        blocks = data.draw(st.sampled_from(self.held))
        self.pool.touch(blocks)
        self.held.append(list(blocks))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        self.pool.free(reversed(self.held.pop(i)))

    @rule(data=st.data())
    def revive_cached(self, data):
        cached = [b for b in self.pool.blocks if b.block_hash is not None and b.ref_cnt == 0]
        if cached:
            b = data.draw(st.sampled_from(cached))
            assert self.pool.lookup(b.block_hash, b.token_ids, (), None) is b
            self.pool.touch([b])
            self.held.append([b])

    @invariant()
    def refs_match(self):
        if not hasattr(self, "pool"):
            return
        counts: dict[int, int] = {}
        for blocks in self.held:
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == counts.get(b.block_id, 0)
            assert (b.ref_cnt == 0) == self.pool.is_free(b)
        assert self.pool.num_free_blocks == sum(1 for b in self.pool.blocks if b.ref_cnt == 0)


BlockPoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestBlockPool = BlockPoolMachine.TestCase


def test_preemption_happens_and_recovers():
    """A pool too small for all running requests forces preemption by recompute; all still finish."""
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_cache=True)
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_batched_tokens=64, max_model_len=1000,
                                      watermark=0.0), kv)
    for i in range(4):
        sched.add_request(TokenizedRequest(f"r{i}", (1, 2, 3), SamplingParams(max_new_tokens=6), i))
    done = set()
    for _ in range(500):
        if not sched.has_unfinished():
            break
        plan, failures = sched.schedule()
        assert not failures
        sampled = {s.request_id: 5 for s in plan.sequences if s.sample}
        for u in sched.update_from_output(plan, StepOutput(plan.step_id, sampled, 0, 0)):
            if u.finish_reason:
                done.add(u.request_id)
        sched.check_invariants()
    assert done == {"r0", "r1", "r2", "r3"}
    assert sched.num_preemptions > 0
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_full_prefix_hit_still_computes_last_token():
    """Trap 1: a block-aligned prompt whose blocks are all cached must still compute one token."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(SchedulerLimits(max_batch_size=4, max_num_batched_tokens=64, max_model_len=1000), kv)
    prompt = tuple(range(1, 9))  # two full blocks
    for rid in ("a", "b"):
        sched.add_request(TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=1), 0))
        plan, _ = sched.schedule()
        (seq,) = plan.sequences
        assert len(seq.token_ids) >= 1 and seq.sample
        sched.update_from_output(plan, StepOutput(plan.step_id, {rid: 3}, 0, 0))
    assert kv.num_hits == 1 and kv.hit_tokens == 4  # one block reused, the last block recomputed
