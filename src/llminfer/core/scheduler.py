"""Continuous-batching scheduler with token-budget steps (in the style of vLLM v1's ``Scheduler``).

Each step decides ``{request: num_new_tokens}`` under ``max_num_batched_tokens`` and ``max_batch_size``:
running requests first (decodes, and prefills still in progress), then waiting ones in policy order.
A prompt longer than the remaining budget (or ``long_prefill_token_threshold``) is computed in chunks
across steps (chunked prefill), so it never stalls the decodes of others. When KV blocks run out, the most
recently admitted running request is preempted by recompute: its blocks are freed and it goes back to the
head of the waiting queue (its full blocks usually survive in the prefix cache). Admission keeps a
free-block watermark so running requests can grow.

A request that asks for prompt logprobs takes no prefix-cache hit until they are complete: the backend reads
them from the prefill's logits, which cached tokens would skip. They are collected per position (a request
recomputed after a preemption yields the same rows again, kept once) and ride on its first token's update.

A request with a structured-output constraint waits until its grammar has compiled (in a worker thread,
see :mod:`llminfer.sampling.structured`); the requests behind it are scheduled meanwhile, and a compile
that fails or times out fails that request alone.

Liveness: a request that could never fit in the whole KV pool is rejected when it arrives, and a lone
running request that outgrows the pool fails with :class:`CapacityError`, so nothing can stall the queue.

The scheduler is plain synchronous code owned by the engine core (:mod:`llminfer.core.engine_core`):
no locks, no threads. ``schedule()`` returns a plan; ``update_from_output(plan, output)`` applies the
backend's result for exactly that plan.
"""

from __future__ import annotations

import itertools
import time

from llminfer.core.budget import SchedulerLimits, StepBudget
from llminfer.core.inflight import InflightPrompts
from llminfer.core.queues import PriorityWaitingQueue, WaitingQueue
from llminfer.errors import CapacityError, EngineError, InvalidRequestError, LLMInferError
from llminfer.kv.manager import KVCacheManager
from llminfer.protocols.messages import (
    NewRequestData,
    ScheduledSequence,
    SchedulerOutput,
    SequenceUpdate,
    StepOutput,
    TokenizedRequest,
)
from llminfer.request import Request, RequestStatus, check_stop
from llminfer.stats import IterationStats


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
        self.watermark_blocks = int(limits.watermark * kv.num_blocks)
        self.num_preemptions = 0
        self.iteration = IterationStats()  # what the steps since the last take_iteration_stats() produced
        self.inflight = InflightPrompts(kv.block_size, enabled=kv.enable_prefix_cache)

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, msg: TokenizedRequest) -> Request:
        """Queue a tokenized request.

        A request of ``P`` prompt tokens that generates ``M`` tokens writes the KV of ``P + M - 1`` tokens
        (the last token's is never computed). With ``max_new_tokens`` given, that must fit in the whole
        pool; without it, the request is capped at what the pool (and the context) holds and ends with
        ``finish_reason="length"`` there, instead of failing when the pool runs out.

        Raises:
            CapacityError: prompt plus ``max_new_tokens`` (or the minimum output) can never fit in the KV
                pool, even alone (``param`` names ``max_new_tokens`` when the prompt alone would fit).
        """
        prompt_len = len(msg.prompt_token_ids)
        capacity = self.kv.capacity_tokens
        min_new = max(1, msg.params.min_new_tokens)
        if self.kv.blocks_needed(prompt_len + min_new - 1) > self.kv.num_blocks:
            raise CapacityError(
                f"request needs {prompt_len + min_new - 1} tokens of KV cache (prompt {prompt_len} + at least "
                f"{min_new} generated) but the whole pool holds {capacity} tokens; raise the KV budget "
                "or shorten the prompt"
            )
        max_new = msg.params.max_new_tokens
        if max_new is not None and self.kv.blocks_needed(prompt_len + max_new - 1) > self.kv.num_blocks:
            raise CapacityError(
                f"request needs up to {prompt_len + max_new - 1} tokens of KV cache (prompt {prompt_len} + "
                f"max_new_tokens {max_new} - 1) but the whole pool holds {capacity} tokens; lower "
                f"max_new_tokens to at most {capacity - prompt_len + 1} or raise the KV budget",
                param="max_new_tokens"
            )
        # Without max_new_tokens: up to the context, and no further than one request alone can grow.
        max_total = min(self.limits.max_model_len, capacity + 1)
        if max_new is not None:
            max_total = min(max_total, prompt_len + max_new)
        req = Request(
            request_id=msg.request_id,
            token_ids=list(msg.prompt_token_ids),
            num_prompt_tokens=prompt_len,
            params=msg.params,
            arrival_ns=msg.arrival_ns,
            priority=msg.priority,
            extra_keys=msg.extra_keys,
            block_hashes=list(msg.block_hashes),
            max_tokens_total=max_total,
            queued_ns=time.perf_counter_ns(),
            bad_words_ids=msg.bad_words_ids,
            force_words_ids=msg.force_words_ids,
            grammar=msg.grammar,
            prefix_key=msg.prefix_key,
        )
        self.requests[req.request_id] = req
        self.waiting.push(req)
        return req

    def finish_request(self, request_id: str, num_output_tokens: int | None = None) -> Request | None:
        """End a request wherever it is (abort, or a stop string the front end found) and free its blocks
        at once. ``num_output_tokens`` keeps only that many generated tokens (the rest were produced
        after the stop string). Returns the finished request, None if it is unknown (already finished).
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        if num_output_tokens is not None:
            del req.token_ids[req.num_prompt_tokens + num_output_tokens:]
        self._finish(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def waiting_for_grammar(self) -> bool:
        """Some waiting request's structured-output grammar is still compiling."""
        return any(r.grammar is not None and not r.sent_to_backend and not r.grammar.ready() for r in self.waiting)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> tuple[SchedulerOutput, list[SequenceUpdate]]:
        """Plan the next step: running requests first, then (unless one was preempted) waiting ones.

        Returns:
            The plan (possibly with no sequences) and updates for requests that failed while planning
            (a lone request that outgrew the KV pool, a grammar that failed to compile).
        """
        budget = StepBudget(self.limits.max_num_batched_tokens, max(1, self.limits.max_prompt_logprob_rows),
                            self.limits.long_prefill_token_threshold)
        plan: list[tuple[Request, int, int]] = []  # (request, new tokens, speculative lookahead)
        failures: list[SequenceUpdate] = []
        now = time.perf_counter_ns()
        preempted = self._schedule_running(budget, plan, failures)
        if not preempted:
            self._schedule_waiting(budget, plan, failures, now)
        return self._plan_output(plan), failures

    def _schedule_running(self, budget: StepBudget, plan: list, failures: list[SequenceUpdate]) -> bool:
        """Give each running request its next tokens (decode, or the next prefill chunk), preempting the
        most recently admitted ones when blocks run out. Returns True if anything was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            req = self.running[i]
            num_new = budget.clamp(req, req.num_tokens - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue  # this step's prompt-logprob rows are spent; it goes on next step
            lookahead = self._lookahead(req, num_new, budget.tokens)
            while not self.kv.allocate_slots(req, req.num_computed_tokens + num_new + lookahead):
                victim = self.running.pop()
                if victim is req and not self.running:
                    failures.append(self._fail_capacity(req))
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                plan.append((req, num_new, lookahead))
                budget.take(req, num_new, lookahead)
                i += 1
            # otherwise req left ``running``; index i now points at the next one
        return preempted

    def _schedule_waiting(self, budget: StepBudget, plan: list, failures: list[SequenceUpdate], now: int) -> None:
        """Admit waiting requests in policy order while budget, batch slots and blocks last. Requests that
        cannot go yet (grammar compiling, their prompt block in flight elsewhere, no prompt-logprob rows
        left) are skipped and keep their place; the first one that finds no blocks stops admission."""
        skipped: list[Request] = []
        while self.waiting and budget.tokens > 0 and len(self.running) < self.limits.max_batch_size:
            req = self.waiting.pop()
            ready = self._admissible(req, budget, now)
            if isinstance(ready, SequenceUpdate):
                failures.append(ready)
                continue
            if ready is None:
                skipped.append(req)
                continue
            cached_blocks, num_cached = ready
            num_new = budget.clamp(req, req.num_tokens - num_cached)
            reserve = self.watermark_blocks if self.running else 0
            if not self.kv.allocate_slots(req, num_cached + num_new, cached_blocks, reserve):
                skipped.append(req)
                break  # head-of-line waits for blocks; running requests will free some
            self._start_running(req, num_cached, len(cached_blocks), now)
            plan.append((req, num_new, 0))
            budget.take(req, num_new, 0)
        self.waiting.prepend(skipped)

    def _admissible(self, req: Request, budget: StepBudget, now: int) -> tuple[list, int] | SequenceUpdate | None:
        """Whether a popped waiting request can start this step: its prefix-cache hit ``(blocks, tokens)``
        if so, None to skip it this step, or the failure update of a grammar that did not compile."""
        if req.grammar is not None and not req.sent_to_backend:
            if not req.grammar.ready():
                return None  # compiling in a worker thread; the requests behind it go ahead
            try:
                req.grammar.result()
            except InvalidRequestError as exc:  # invalid constraint, or the compile timed out
                self._finish(req)
                return SequenceUpdate(req.request_id, (), "error", exc, stats=req.stats(now))
        if req.needs_prompt_logprobs:
            # Prompt logprobs come out of the prefill's logits: cached tokens would skip them.
            return ([], 0) if budget.logprob_rows > 0 else None
        cached_blocks, num_cached = self.kv.find_cached_prefix(req)
        if self.inflight.must_wait(req, len(cached_blocks)):
            return None
        return cached_blocks, num_cached

    def _start_running(self, req: Request, num_cached: int, num_cached_blocks: int, now: int) -> None:
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_cached
            req.first_scheduled_ns = now
        # Every admission is a prefix-cache query, a resumption after preemption too (its blocks usually
        # survive in the cache), so the hit rate shows what preemption costs.
        self.kv.record_query(req.num_tokens, num_cached)
        self.iteration.prefix_cache_queries += req.num_tokens
        self.iteration.prefix_cache_hits += num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.inflight.mark(req, num_cached_blocks)

    def _plan_output(self, plan: list[tuple[Request, int, int]]) -> SchedulerOutput:
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
                                   req.bad_words_ids, req.force_words_ids,
                                   req.grammar.result() if req.grammar is not None else None)
                )
        finished = tuple(self._finished_since_last_step)
        self._finished_since_last_step.clear()
        return SchedulerOutput(next(self._step_ids), tuple(sequences), tuple(new_requests), finished)

    def update_from_output(self, plan: SchedulerOutput, result: StepOutput) -> list[SequenceUpdate]:
        """Apply the backend's result for ``plan``: advance computed tokens, append sampled tokens, finish
        requests. Requests of the plan that finished meanwhile (aborted while the step ran) are skipped.

        A failed step (``result.error``) fails every request that was in it and frees their blocks; a
        request in ``result.failed`` fails alone.
        Final updates carry the request's stats (:meth:`Request.stats`).
        """
        updates: list[SequenceUpdate] = []
        end_ns = result.end_ns or time.perf_counter_ns()
        for seq in plan.sequences:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            error = result.error if result.error is not None else result.failed.get(req.request_id)
            if error is not None:
                self.running.remove(req)
                self._finish(req)
                updates.append(SequenceUpdate(req.request_id, (), "error", _as_engine_error(error),
                                              stats=req.stats(end_ns)))
                continue
            sampled = result.sampled.get(req.request_id)
            tokens: tuple[int, ...] = () if sampled is None else (sampled,) if isinstance(sampled, int) else sampled
            # Accepted draft tokens (all sampled tokens but the last) had their KV computed in this step.
            req.num_computed_tokens += len(seq.token_ids) + max(len(tokens) - 1, 0)
            if req.num_computed_tokens >= req.num_prompt_tokens:
                if not req.prefill_done_ns:
                    req.prefill_done_ns = end_ns
                self.inflight.clear(req)
            prompt_lp = result.prompt_logprobs.get(req.request_id)
            if prompt_lp is not None:
                req.collect_prompt_logprobs(*prompt_lp)
            if not tokens:
                self.kv.cache_full_blocks(req, req.num_computed_tokens)
                continue  # a prefill chunk that does not reach the end of the known tokens
            spec = result.spec.get(req.request_id)
            if spec is not None:
                req.spec_proposed += spec[0]
                req.spec_accepted += spec[1]
            updates.append(self._append_tokens(req, tokens, result.logprobs.get(req.request_id), end_ns))
        return updates

    def _append_tokens(self, req: Request, tokens: tuple[int, ...], logprobs, end_ns: int) -> SequenceUpdate:
        """Append a step's sampled tokens to ``req`` up to the first finish, record their timing, cache its
        newly full blocks, and finish it if it stopped. Returns its update."""
        reason = None
        kept = 0
        for token in tokens:
            req.token_ids.append(token)
            kept += 1
            reason = check_stop(req, token, self.eos_token_ids)
            if reason is not None:
                break  # tokens after a finish (EOS inside an accepted draft run) are dropped
        it = self.iteration
        if not req.first_token_ns:
            req.first_token_ns = end_ns
            it.first_token(req.num_prompt_tokens, end_ns - req.arrival_ns)
        else:  # IterationStats.next_token, inlined: this runs once per token
            gap = end_ns - req.last_token_ns
            it.inter_token_ns[gap] = it.inter_token_ns.get(gap, 0) + 1
        req.last_token_ns = end_ns
        it.num_generation_tokens += kept
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        self.kv.cache_full_blocks(req, req.num_computed_tokens)
        if req.prefix_key is not None and kept == len(req.token_ids) - req.num_prompt_tokens:
            self.kv.pin_prefix(req.prefix_key, req)  # its first tokens: the prompt's blocks are all cached now
        if reason is not None:
            self.running.remove(req)
            self._finish(req)
        prompt_entries: tuple = ()
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            prompt_entries = tuple(req.prompt_logprobs)
        return SequenceUpdate(req.request_id, tuple(req.token_ids[-kept:]), reason,
                              logprobs=(logprobs,) if logprobs is not None else (),
                              stats=req.stats(end_ns) if reason is not None else None,
                              prompt_logprobs=prompt_entries, ends_with_stop_token=reason == "stop")

    def take_iteration_stats(self) -> IterationStats:
        """What the steps since the last call produced (see :mod:`llminfer.stats`); starts a fresh record."""
        it, self.iteration = self.iteration, IterationStats()
        return it

    def _lookahead(self, req: Request, num_new: int, budget: int) -> int:
        """Draft tokens to verify for ``req`` this step: only plain decodes (one new token) of requests
        whose sampling needs no per-token history, capped by the remaining output and the budget."""
        k = self.limits.num_lookahead_tokens
        if not k or num_new != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        if not req.params.speculation_allowed:
            return 0
        return max(0, min(k, req.max_tokens_total - req.num_tokens - 1, budget - num_new))

    # ------------------------------------------------------------------ internals
    def _preempt(self, req: Request) -> None:
        self.inflight.clear(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.iteration.num_preemptions += 1
        self.waiting.push_front(req)

    def _fail_capacity(self, req: Request) -> SequenceUpdate:
        self._finish(req)
        err = CapacityError(
            f"request {req.request_id} outgrew the KV cache ({req.num_tokens} tokens, pool holds "
            f"{self.kv.capacity_tokens}); raise the KV budget or lower max_new_tokens"
        )
        return SequenceUpdate(req.request_id, (), "error", err, stats=req.stats(time.perf_counter_ns()))

    def _finish(self, req: Request) -> None:
        self.inflight.clear(req)
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
        for owner in self.inflight.owners():
            assert owner in running, f"in-flight prompt blocks owned by non-running request {owner}"
        for rid in self.kv.block_tables:
            assert rid in self.requests, f"block table of finished request {rid}"
        self.kv.check_integrity()


def _as_engine_error(exc: BaseException) -> Exception:
    """What the request's caller gets for a backend failure: llminfer's own errors as they are, anything
    else as an :class:`EngineError` naming it (never a bare torch or xgrammar exception)."""
    if isinstance(exc, LLMInferError):
        return exc
    return EngineError(f"the backend failed on this request: {type(exc).__name__}: {exc}")

__all__ = ["Scheduler", "SchedulerLimits", "check_stop"]
