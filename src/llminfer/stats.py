"""Engine statistics for monitoring: what each engine step produced, handed to stat loggers.

The engine core is the one place these numbers come from (llminfer's core and the vLLM core alike). While
a step runs, the scheduler adds to an :class:`IterationStats` with plain integer arithmetic (no lock, no
metrics library, nothing allocated per token); when the core emits the step it hands the record to every
:class:`StatLogger` in ``engine.stat_loggers`` (the HTTP server's Prometheus metrics is one) and starts a
fresh one. The split follows vLLM v1's ``IterationStats``: counters and per-token latencies are recorded as
tokens are produced, so a request aborted halfway has its tokens counted; per-request latencies are
recorded when a request finishes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import structlog

from llminfer.results import GenerationStats

log = structlog.get_logger("llminfer.stats")

COMPLETED = frozenset({"stop", "length"})
"""Finish reasons of requests that ran to their end (their per-request latencies are recorded)."""


@attrs.frozen
class FinishedRequest:
    """One request that ended, for the per-request histograms.

    Attributes:
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
        prompt_tokens, generation_tokens: token counts.
        e2e_s: arrival → finish (s).
        queue_s: admitted → first scheduled (s); None where the core does not see it (vLLM).
        prefill_s: first scheduled → prompt computed (s); None where not seen.
        decode_s: first token → finish (s); None without a token.
    """

    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    e2e_s: float
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (s): ``decode_s / (generation_tokens - 1)``."""
        if self.decode_s is None or self.generation_tokens < 2:
            return None
        return self.decode_s / (self.generation_tokens - 1)

    @classmethod
    def from_stats(cls, reason: str, stats: GenerationStats, scheduled: bool = True) -> FinishedRequest:
        """From a request's stats record; ``scheduled``: the core measured queue and prefill times."""
        e2e = stats.total_latency_ms / 1e3
        decode = (stats.total_latency_ms - stats.ttft_ms) / 1e3 if stats.completion_tokens else None
        return cls(reason, stats.prompt_tokens, stats.completion_tokens, e2e,
                   queue_s=stats.queue_time_ms / 1e3 if scheduled else None,
                   prefill_s=stats.prefill_time_ms / 1e3 if scheduled and stats.prefill_time_ms else None,
                   decode_s=decode)


@attrs.define(slots=True)
class IterationStats:
    """What one engine step produced (the counterpart of vLLM's ``IterationStats``).

    Attributes:
        num_prompt_tokens: prompt tokens of the requests whose first token came in this step (a prompt
            counts once, when its prefill completes, like vLLM's ``prompt_tokens``).
        num_generation_tokens: tokens sampled in this step (accepted draft tokens included).
        time_to_first_tokens_s: arrival → first token (s), one entry per request that got its first token.
        inter_token_ns: inter-token latency histogram of this step: gap (ns) since a request's previous
            token → number of requests that got a token after that gap. Requests decoding in consecutive
            steps share one gap, so a step adds one entry per distinct gap, not one per token.
        num_preemptions: requests preempted (their KV freed, to be recomputed) in this step.
        prefix_cache_queries, prefix_cache_hits: tokens looked up in the prefix cache at admission (the
            prompt; for a preempted request resuming, its generated tokens too), and how many of them were
            found (in tokens, as vLLM counts them).
        finished: the requests that ended in this step.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = attrs.field(factory=list)
    inter_token_ns: dict[int, int] = attrs.field(factory=dict)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished: list[FinishedRequest] = attrs.field(factory=list)

    def first_token(self, num_prompt_tokens: int, ttft_ns: int) -> None:
        """A request got its first token ``ttft_ns`` after it arrived."""
        self.num_prompt_tokens += num_prompt_tokens
        self.time_to_first_tokens_s.append(ttft_ns / 1e9)

    def next_token(self, gap_ns: int) -> None:
        """A request got a token ``gap_ns`` after its previous one."""
        self.inter_token_ns[gap_ns] = self.inter_token_ns.get(gap_ns, 0) + 1

    def __bool__(self) -> bool:
        return bool(self.num_generation_tokens or self.num_prompt_tokens or self.finished or self.num_preemptions
                    or self.prefix_cache_queries)


@runtime_checkable
class StatLogger(Protocol):
    """Receives each engine step's :class:`IterationStats` (called by the engine core, in its event loop or
    on its model thread, never from two threads at once; keep it cheap: update counters and histograms,
    never block)."""

    def record(self, stats: IterationStats) -> None: ...


def record_all(loggers: list[StatLogger], stats: IterationStats) -> None:
    """Hand ``stats`` to every logger. A logger that raises is logged once (with its traceback) and removed
    from ``loggers``, so a broken metrics sink neither stops the engine nor floods the log at every step."""
    broken = []
    for logger in loggers:
        try:
            logger.record(stats)
        except Exception:  # noqa: BLE001 - serving goes on without this logger's numbers
            log.exception("stat logger failed; it gets no more statistics", logger=repr(logger))
            broken.append(logger)
    for logger in broken:
        loggers.remove(logger)
