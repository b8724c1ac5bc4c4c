"""What the scheduler works under: the static :class:`SchedulerLimits`, and one step's :class:`StepBudget`."""

from __future__ import annotations

import attrs

from llminfer.request import Request


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
    #: prompt tokens per step whose logprobs are computed (each is a ``[V]`` float32 logits row: 512 rows of
    #: a 152k vocabulary are 311 MB); longer prompts asking for them are prefilled in chunks
    max_prompt_logprob_rows: int = 512


@attrs.define
class StepBudget:
    """What one step may still take: ``tokens`` of the ``max_num_batched_tokens`` budget (draft tokens
    included) and ``logprob_rows`` of prompt-logprob rows; ``long_prefill`` caps one prefill chunk
    (0 = no cap)."""

    tokens: int
    logprob_rows: int
    long_prefill: int = 0

    def clamp(self, req: Request, num_new: int) -> int:
        """The most of ``num_new`` tokens ``req`` may compute in this step (<= 0: none)."""
        if self.long_prefill:
            num_new = min(num_new, self.long_prefill)
        num_new = min(num_new, self.tokens)
        if req.needs_prompt_logprobs:
            num_new = min(num_new, self.logprob_rows)
        return num_new

    def take(self, req: Request, num_new: int, lookahead: int) -> None:
        self.tokens -= num_new + lookahead
        if req.needs_prompt_logprobs:
            self.logprob_rows -= num_new
