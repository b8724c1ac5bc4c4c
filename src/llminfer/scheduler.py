"""Continuous-batching scheduler with token-budget steps (in the style of vLLM v1's ``Scheduler``).

Each step decides ``{request: num_new_tokens}`` under ``max_num_batched_tokens`` and ``max_batch_size``:
running requests first (decodes, and prefills still in progress), then waiting ones in policy order.
A prompt longer than the remaining budget (or ``long_prefill_token_threshold``) is computed in chunks
across steps (chunked prefill), so it never stalls the decodes of others. When KV blocks run out, the most
recently admitted running request is preempted by recompute: its blocks are freed and it goes back to the
head of the waiting queue (its full blocks usually survive in the prefix cache). Admission keeps a
free-block watermark so running requests can grow.

Liveness: a request that could never fit in the whole KV pool is rejected when it arrives, and a lone
running request that outgrows the pool fails with :class:`CapacityError`, so nothing can stall the queue.

The scheduler is plain synchronous code owned by the scheduler stage: no locks, no threads.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterator

import attrs

from llminfer.errors import CapacityError
from llminfer.kv.manager import KVCacheManager
from llminfer.protocols.messages import (
    NewRequestData,
    ScheduledSequence,
    SchedulerOutput,
    SequenceUpdate,
    StepOutput,
    TokenizedRequest,
)
from llminfer.sampling.params import SamplingParams


def speculation_allowed(params: SamplingParams) -> bool:
    """Speculative decoding verifies drafts with the target's warped distribution only, so it is used for
    requests without history-dependent processors (penalties, no-repeat n-gram, min_new_tokens) and
    without logprobs; other requests in the same batch decode one token per step."""
    return (params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty
            and not params.no_repeat_ngram_size and not params.min_new_tokens and params.logprobs is None
            and not params.bad_words and not params.force_words)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """The scheduler's state of one request.

    Attributes:
        token_ids: prompt followed by generated tokens.
        num_prompt_tokens: length of the prompt.
        num_computed_tokens: tokens whose KV is in the cache.
        num_cached_tokens: prompt tokens reused from the prefix cache at first admission (-1: not yet).
        block_hashes: chained hashes of full blocks of ``token_ids`` (extended as blocks fill).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_ns: int
    priority: int = 0
    prefix_key: str | None = None
    extra_keys: tuple[str, ...] = ()
    block_hashes: list[bytes] = attrs.field(factory=list)
    max_tokens_total: int = 0
    bad_words_ids: tuple = ()
    force_words_ids: tuple = ()
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    queued_ns: int = 0
    first_scheduled_ns: int = 0
    prefill_done_ns: int = 0
    sent_to_backend: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class WaitingQueue:
    """FCFS waiting queue; preempted requests go back to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityWaitingQueue(WaitingQueue):
    """Lower ``priority`` first, then arrival order. Preempted requests keep their place by key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Request]] = []
        self._tiebreak = itertools.count()

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_ns, next(self._tiebreak), req))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


@attrs.frozen
class SchedulerLimits:
    """Static limits the scheduler works under."""

    max_batch_size: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    watermark: float = 0.01
    policy: str = "fcfs"
    num_lookahead_tokens: int = 0  #: speculative decoding: draft tokens verified per decode step (0 = off)


class Scheduler:
    """Owns request state and the KV cache manager.

    Args:
        limits: batch size, token budget, context length, chunking and watermark.
        kv: the KV cache manager (block pool).
        eos_token_ids: token ids that end a request unless it asked ``ignore_eos``.
    """

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.limits = limits
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: WaitingQueue = PriorityWaitingQueue() if limits.policy == "priority" else WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._step_ids = itertools.count()
        self._finished_since_last_step: list[str] = []
        self._last_plan: list[tuple[Request, int, int]] = []
        self.watermark_blocks = int(limits.watermark * kv.num_blocks)
        self.num_preemptions = 0
        # Prompt blocks being computed right now, by hash → owning request. A waiting request whose next
        # uncached block is in flight waits for it (then reuses it through the prefix cache) instead of
        # computing the same KV twice: this is how n > 1 samples and concurrent identical system prompts
        # share their prompt's blocks.
        self._inflight: dict[bytes, str] = {}
        self.num_deferred = 0

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, msg: TokenizedRequest) -> Request:
        """Queue a tokenized request.

        Raises:
            CapacityError: prompt plus its minimum output can never fit in the KV pool.
        """
        prompt_len = len(msg.prompt_token_ids)
        min_total = prompt_len + max(1, msg.params.min_new_tokens)
        if self.kv.blocks_needed(min_total) > self.kv.num_blocks:
            raise CapacityError(
                f"request needs {min_total} tokens of KV cache (prompt {prompt_len} + at least "
                f"{max(1, msg.params.min_new_tokens)} generated) but the whole pool holds "
                f"{self.kv.capacity_tokens} tokens; raise the KV budget or shorten the prompt"
            )
        max_total = self.limits.max_model_len
        if msg.params.max_new_tokens is not None:
            max_total = min(max_total, prompt_len + msg.params.max_new_tokens)
        req = Request(
            request_id=msg.request_id,
            token_ids=list(msg.prompt_token_ids),
            num_prompt_tokens=prompt_len,
            params=msg.params,
            arrival_ns=msg.arrival_ns,
            priority=msg.priority,
            prefix_key=msg.prefix_key,
            extra_keys=msg.extra_keys,
            block_hashes=list(msg.block_hashes),
            max_tokens_total=max_total,
            queued_ns=time.perf_counter_ns(),
            bad_words_ids=msg.bad_words_ids,
            force_words_ids=msg.force_words_ids,
        )
        self.requests[req.request_id] = req
        self.waiting.push(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its blocks at once. Returns False if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        self._finish(req)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> tuple[SchedulerOutput, list[SequenceUpdate]]:
        """Plan the next step.

        Returns:
            The plan (possibly with no sequences) and updates for requests that failed while planning
            (a lone request that outgrew the KV pool).
        """
        budget = self.limits.max_num_batched_tokens
        threshold = self.limits.long_prefill_token_threshold
        plan: list[tuple[Request, int, int]] = []  # (request, new tokens, speculative lookahead)
        failures: list[SequenceUpdate] = []
        preempted = False
        now = time.perf_counter_ns()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if threshold:
                num_new = min(num_new, threshold)
            num_new = min(num_new, budget)
            lookahead = self._lookahead(req, num_new, budget)
            scheduled = True
            while not self.kv.allocate_slots(req, req.num_computed_tokens + num_new + lookahead):
                victim = self.running.pop()
                if victim is req and not self.running:
                    failures.append(self._fail_capacity(req))
                    scheduled = False
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                continue  # req left ``running``; index i now points at the next one
            plan.append((req, num_new, lookahead))
            budget -= num_new + lookahead
            i += 1

        if not preempted:
            for req in list(self.waiting):
                if budget <= 0 or len(self.running) >= self.limits.max_batch_size:
                    break
                cached_blocks, num_cached = self.kv.find_cached_prefix(req)
                if self._waits_for_inflight(req, len(cached_blocks)):
                    self.num_deferred += 1
                    continue
                num_new = req.num_tokens - num_cached
                if threshold:
                    num_new = min(num_new, threshold)
                num_new = min(num_new, budget)
                reserve = self.watermark_blocks if self.running else 0
                if not self.kv.allocate_slots(req, num_cached + num_new, cached_blocks, reserve):
                    break  # head-of-line waits for blocks; running requests will free some
                self.waiting.remove(req)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                    self.kv.record_query(req.num_prompt_tokens, num_cached)
                    req.first_scheduled_ns = now
                req.num_computed_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                self._mark_inflight(req, len(cached_blocks))
                plan.append((req, num_new, 0))
                budget -= num_new

        self._last_plan = plan
        sequences = []
        new_requests = []
        for req, num_new, lookahead in plan:
            start = req.num_computed_tokens
            sequences.append(
                ScheduledSequence(
                    request_id=req.request_id,
                    token_ids=tuple(req.token_ids[start : start + num_new]),
                    start_position=start,
                    block_table=tuple(self.kv.block_ids(req.request_id)),
                    sample=start + num_new == req.num_tokens,
                    num_generated=req.num_generated,
                    num_lookahead=lookahead,
                )
            )
            if not req.sent_to_backend:
                req.sent_to_backend = True
                new_requests.append(
                    NewRequestData(req.request_id, req.params, tuple(req.token_ids[: req.num_prompt_tokens]),
                                   req.bad_words_ids, req.force_words_ids)
                )
        finished = tuple(self._finished_since_last_step)
        self._finished_since_last_step.clear()
        out = SchedulerOutput(next(self._step_ids), tuple(sequences), tuple(new_requests), finished)
        return out, failures

    def update(self, result: StepOutput) -> list[SequenceUpdate]:
        """Apply a step's result: advance computed tokens, append sampled tokens, finish requests.

        A failed step (``result.error``) fails every request that was in it and frees their blocks.
        """
        updates: list[SequenceUpdate] = []
        plan, self._last_plan = self._last_plan, []
        if result.error is not None:
            for req, _, _ in plan:
                if req.status is RequestStatus.RUNNING:
                    self.running.remove(req)
                    self._finish(req)
                    updates.append(self._update(req, (), "error", result.error))
            return updates
        for req, num_new, _ in plan:
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            sampled = result.sampled.get(req.request_id)
            tokens: tuple[int, ...] = () if sampled is None else (sampled,) if isinstance(sampled, int) else sampled
            # Accepted draft tokens (all sampled tokens but the last) had their KV computed in this step.
            req.num_computed_tokens += num_new + max(len(tokens) - 1, 0)
            if not req.prefill_done_ns and req.num_computed_tokens >= req.num_prompt_tokens:
                req.prefill_done_ns = result.end_ns or time.perf_counter_ns()
            if req.num_computed_tokens >= req.num_prompt_tokens:
                self._clear_inflight(req)
            if not tokens:
                self.kv.cache_full_blocks(req, req.num_computed_tokens)
                continue  # a prefill chunk that does not reach the end of the known tokens
            reason = None
            kept = 0
            for token in tokens:
                req.token_ids.append(token)
                kept += 1
                reason = self._finish_reason(req, token)
                if reason is not None:
                    break  # tokens after a finish (EOS inside an accepted draft run) are dropped
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            spec = result.spec.get(req.request_id)
            if spec is not None:
                req.spec_proposed += spec[0]
                req.spec_accepted += spec[1]
            if reason is not None:
                self.running.remove(req)
                self._finish(req)
            lp = result.logprobs.get(req.request_id)
            updates.append(self._update(req, tuple(req.token_ids[-kept:]), reason,
                                        logprobs=(lp,) if lp is not None else ()))
        return updates

    def _lookahead(self, req: Request, num_new: int, budget: int) -> int:
        """Draft tokens to verify for ``req`` this step: only plain decodes (one new token) of requests
        whose sampling needs no per-token history, capped by the remaining output and the budget."""
        k = self.limits.num_lookahead_tokens
        if not k or num_new != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        if not speculation_allowed(req.params) or req.bad_words_ids or req.force_words_ids:
            return 0
        return max(0, min(k, req.max_tokens_total - req.num_tokens - 1, budget - num_new))

    # ------------------------------------------------------------------ internals
    def _finish_reason(self, req: Request, token: int) -> str | None:
        # The sampler masks EOS and stop ids below min_new_tokens, so a match here is a real finish.
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if req.num_tokens >= req.max_tokens_total:
            return "length"
        return None

    def _update(self, req: Request, tokens: tuple[int, ...], reason: str | None,
                error: Exception | None = None, logprobs: tuple = ()) -> SequenceUpdate:
        return SequenceUpdate(
            request_id=req.request_id,
            new_token_ids=tokens,
            finish_reason=reason,
            error=error,
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
            queue_time_ns=max(req.first_scheduled_ns - req.queued_ns, 0) if req.first_scheduled_ns else 0,
            prefill_time_ns=max(req.prefill_done_ns - req.first_scheduled_ns, 0) if req.prefill_done_ns else 0,
            logprobs=logprobs,
            spec_proposed=req.spec_proposed,
            spec_accepted=req.spec_accepted,
        )

    def _mark_inflight(self, req: Request, num_cached_blocks: int) -> None:
        if not self.kv.enable_prefix_cache:
            return
        for block_hash in req.block_hashes[num_cached_blocks : req.num_prompt_tokens // self.kv.block_size]:
            self._inflight.setdefault(block_hash, req.request_id)

    def _clear_inflight(self, req: Request) -> None:
        if self._inflight:
            for block_hash in req.block_hashes[: req.num_prompt_tokens // self.kv.block_size]:
                if self._inflight.get(block_hash) == req.request_id:
                    del self._inflight[block_hash]

    def _waits_for_inflight(self, req: Request, num_cached_blocks: int) -> bool:
        """True when the next block ``req`` would compute is being computed by another request."""
        if not self._inflight or num_cached_blocks >= len(req.block_hashes):
            return False
        if num_cached_blocks >= (req.num_tokens - 1) // self.kv.block_size:
            return False  # the hit is already as long as it may be
        owner = self._inflight.get(req.block_hashes[num_cached_blocks])
        return owner is not None and owner != req.request_id

    def _preempt(self, req: Request) -> None:
        self._clear_inflight(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def _fail_capacity(self, req: Request) -> SequenceUpdate:
        self._finish(req)
        err = CapacityError(
            f"request {req.request_id} outgrew the KV cache ({req.num_tokens} tokens, pool holds "
            f"{self.kv.capacity_tokens}); raise the KV budget or lower max_new_tokens"
        )
        return self._update(req, (), "error", err)

    def _finish(self, req: Request) -> None:
        self._clear_inflight(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        if req.sent_to_backend:
            self._finished_since_last_step.append(req.request_id)

    def check_invariants(self) -> None:
        """Assert the scheduler's and block pool's invariants (used by property tests).

        Raises:
            AssertionError: naming the broken invariant.
        """
        waiting = {r.request_id for r in self.waiting}
        running = {r.request_id for r in self.running}
        assert not waiting & running, "a request is both waiting and running"
        assert waiting | running == set(self.requests), "request registry out of sync with queues"
        assert len(self.running) <= self.limits.max_batch_size, "running exceeds max_batch_size"
        for owner in self._inflight.values():
            assert owner in running, f"in-flight prompt blocks owned by non-running request {owner}"
        refs: dict[int, int] = {}
        for rid, table in self.kv.block_tables.items():
            assert rid in self.requests, f"block table of finished request {rid}"
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), f"ref count drift on {block!r}"
            assert (block.ref_cnt == 0) == self.kv.pool.is_free(block), f"{block!r} free xor referenced broken"
