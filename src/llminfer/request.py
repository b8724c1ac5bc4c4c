"""The engine core's one per-request state, from admission to finish.

A :class:`Request` is created by the scheduler when a tokenized request is admitted and lives until it
finishes or is aborted; every other per-request shape in the pipeline is a frozen message about it. Its
timestamps (``time.perf_counter_ns``) are the only source of the request's timings: the stats record
(:class:`~llminfer.results.GenerationStats`) is computed from them once, by :meth:`Request.stats`, when the
request finishes, and the trace events the core records use the same values.
"""

from __future__ import annotations

import enum

import attrs

from llminfer.results import GenerationStats, TokenLogprob
from llminfer.sampling.params import SamplingParams
from llminfer.sampling.structured import GrammarHandle


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """One request inside the engine core (owned by the scheduler; never shared with other stages).

    Attributes:
        token_ids: prompt followed by generated tokens.
        num_prompt_tokens: length of the prompt.
        max_tokens_total: prompt plus the most tokens it may generate (``max_new_tokens``, or the context).
        num_computed_tokens: tokens whose KV is in the cache.
        num_cached_tokens: prompt tokens reused from the prefix cache at first admission (None: not yet).
        block_hashes: chained hashes of full blocks of ``token_ids`` (extended as blocks fill).
        extra_keys: prefix-cache partition keys (adapter, cache salt).
        bad_words_ids, force_words_ids: tokenized banned and forced words.
        grammar: the structured-output constraint being compiled; the request waits until it is ready.
        arrival_ns: submitted to the engine; queued_ns: admitted by the scheduler; first_scheduled_ns,
            prefill_done_ns, first_token_ns, last_token_ns: as named (0: not yet).
        prefix_key: pin the prompt's shared prefix under this key once computed (KVCacheManager.pin_prefix).
        sent_to_backend: the backend has been told about it (its sampling state must be dropped at finish).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_ns: int
    max_tokens_total: int
    priority: int = 0
    extra_keys: tuple[str, ...] = ()
    block_hashes: list[bytes] = attrs.field(factory=list)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    force_words_ids: tuple[tuple[tuple[int, ...], ...], ...] = ()
    grammar: GrammarHandle | None = None
    prefix_key: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    queued_ns: int = 0
    first_scheduled_ns: int = 0
    prefill_done_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    sent_to_backend: bool = False
    prompt_logprobs: list[TokenLogprob] = attrs.field(factory=list)  #: collected in the prefill, positions 1..
    prompt_logprobs_sent: bool = False

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some are still to compute (so it takes no prefix-cache hit)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def collect_prompt_logprobs(self, first_position: int, entries: tuple) -> None:
        """Keep the prompt-logprob entries of positions not collected yet (a request recomputed after a
        preemption gets the same rows again; ``prompt_logprobs[i]`` is position ``i + 1``)."""
        for i, entry in enumerate(entries):
            if first_position + i == len(self.prompt_logprobs) + 1:
                self.prompt_logprobs.append(entry)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def stats(self, end_ns: int) -> GenerationStats:
        """The request's stats record at ``end_ns`` (its finish), from its own timestamps."""
        total_ms = max(end_ns - self.arrival_ns, 0) / 1e6
        n = self.num_generated
        cached = self.num_cached_tokens or 0
        return GenerationStats(
            total_latency_ms=total_ms,
            ttft_ms=max(self.first_token_ns - self.arrival_ns, 0) / 1e6 if self.first_token_ns else 0.0,
            throughput_tokens_per_sec=n / (total_ms / 1e3) if total_ms > 0 else 0.0,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=n,
            cache_hit=cached > 0,
            cached_tokens=cached,
            num_preemptions=self.num_preemptions,
            queue_time_ms=(self.first_scheduled_ns - self.queued_ns) / 1e6 if self.first_scheduled_ns else 0.0,
            prefill_time_ms=(self.prefill_done_ns - self.first_scheduled_ns) / 1e6 if self.prefill_done_ns else 0.0,
            spec_proposed_tokens=self.spec_proposed,
            spec_accepted_tokens=self.spec_accepted,
        )


def check_stop(req: Request, token: int, eos_token_ids: frozenset[int]) -> str | None:
    """Why ``req`` finishes after appending ``token``: ``"stop"`` (EOS or a stop token id), ``"length"``
    (``max_new_tokens`` or the context reached), or None. The sampler masks EOS and stop ids below
    ``min_new_tokens``, so a match here is a real finish. Stop *strings* are the front end's: they finish
    a request through :meth:`llminfer.core.scheduler.Scheduler.finish_request`."""
    params = req.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return "stop"
    if req.num_tokens >= req.max_tokens_total:
        return "length"
    return None
