"""The step backend: what every backend that runs llminfer's engine step shares.

:meth:`StepBackend.execute` is the envelope of one step (a template method): it drops the state of
finished requests, builds the sampling state of new ones, runs the subclass's :meth:`StepBackend.run_step`
under ``torch.inference_mode``, waits for the device, and turns any exception into the step's error, so
the core never sees one raised. A subclass packs the plan (:class:`~llminfer.backends.packing.PackedStep`),
runs its model and samples; it does not repeat the envelope.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from llminfer.backends.attention import PagedKVCache
from llminfer.protocols.messages import ScheduledSequence, SchedulerOutput, StepOutput
from llminfer.results import TokenLogprob
from llminfer.sampling.sampler import SamplingState, sample


def logits_hooked(model: torch.nn.Module, head: torch.nn.Module) -> bool:
    """Whether a forward hook can see or change the logits: one on ``head`` or on ``model`` (the causal LM
    whose output holds them), or a global module hook."""
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or head._forward_hooks or head._forward_pre_hooks or model._forward_hooks)


@attrs.define
class StepResult:
    """What :meth:`StepBackend.run_step` produced (the fields of :class:`StepOutput` it fills).

    Attributes:
        sampled: per request, its token (or with drafts: accepted drafts, then the target's token).
        logprobs: per request that asked, its sampled token's logprob entry.
        prompt_logprobs: per request that asked, ``(first position, entries)``.
        spec: per drafting request, ``(drafts proposed, drafts accepted)``.
        failed: requests whose own sampling failed, and why (they alone fail).
    """

    sampled: dict[str, int | tuple[int, ...]] = attrs.field(factory=dict)
    logprobs: dict[str, TokenLogprob] = attrs.field(factory=dict)
    prompt_logprobs: dict[str, tuple[int, tuple[TokenLogprob, ...]]] = attrs.field(factory=dict)
    spec: dict[str, tuple[int, int]] = attrs.field(factory=dict)
    failed: dict[str, BaseException] = attrs.field(factory=dict)


class StepBackend(ABC):
    """Runs one engine step of a transformers model on llminfer's paged KV cache.

    Args:
        model: a causal LM loaded with llminfer's paged attention.
        cache: the paged KV tensors.
        eos_token_ids: suppressed below each request's ``min_new_tokens``.
        attention_backend: ``"torch"``, ``"cpu"`` or ``"triton"`` (already resolved for the device).
    """

    name = "step"

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, eos_token_ids: Sequence[int] = (),
                 attention_backend: str = "torch") -> None:
        self.model = model
        self.cache = cache
        self.attention_backend = attention_backend
        self.device = next(model.parameters()).device
        self.eos_token_ids = list(eos_token_ids)
        self.states: dict[str, SamplingState] = {}
        self.num_steps = 0

    @abstractmethod
    def run_step(self, plan: SchedulerOutput) -> StepResult:
        """Compute and sample ``plan`` (called inside :meth:`execute`, under ``torch.inference_mode``; every
        sequence of ``plan`` has its sampling state in :attr:`states`, and there is at least one).

        Raises:
            Exception: the step failed (:meth:`execute` fails its requests with it).
        """

    def execute(self, plan: SchedulerOutput) -> StepOutput:
        """Run one step; never raises. A request whose sampling state cannot be built (a grammar matcher
        that fails, say) is left out of the step and reported in ``StepOutput.failed``, as is one whose own
        sampling fails; the others get their tokens. An exception of the whole step (the forward pass) is
        returned in ``StepOutput.error``."""
        start = time.perf_counter_ns()
        try:
            self.release(plan.finished_request_ids)
            failed = self._register(plan)
            if failed:
                plan = attrs.evolve(plan, sequences=tuple(s for s in plan.sequences if s.request_id not in failed))
            result = StepResult()
            if plan.sequences:
                with torch.inference_mode():
                    result = self.run_step(plan)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            self.num_steps += 1
            failed.update(result.failed)
            return StepOutput(plan.step_id, {k: v for k, v in result.sampled.items() if k not in failed}, start,
                              time.perf_counter_ns(), logprobs=result.logprobs, spec=result.spec,
                              prompt_logprobs={k: v for k, v in result.prompt_logprobs.items() if k not in failed},
                              failed=failed)
        except Exception as exc:  # noqa: BLE001 - the scheduler fails the step's requests with it
            return StepOutput(plan.step_id, {}, start, time.perf_counter_ns(), error=exc)

    def sample_rows(self, logits: torch.Tensor, seqs: Sequence[ScheduledSequence], result: StepResult) -> None:
        """Sample one token per row of ``logits`` (``[len(seqs), V]`` float32) for ``seqs`` into ``result``;
        a sequence whose own sampling fails goes to ``result.failed``."""
        errors: dict[int, BaseException] = {}
        tokens, logprobs = sample(logits, [self.states[s.request_id] for s in seqs], errors)
        for row, exc in errors.items():
            result.failed[seqs[row].request_id] = exc
        for s, token, lp in zip(seqs, tokens, logprobs):
            if s.request_id not in result.failed:
                result.sampled[s.request_id] = token
                if lp is not None:
                    result.logprobs[s.request_id] = lp

    def release(self, request_ids: Sequence[str]) -> None:
        """Drop the sampling state of finished requests."""
        for rid in request_ids:
            self.states.pop(rid, None)

    def describe(self) -> dict[str, Any]:
        """Facts for ``engine.info()``: steps run so far and the attention kernels."""
        return {"steps": self.num_steps, "attention_backend": self.attention_backend}

    def _register(self, plan: SchedulerOutput) -> dict[str, BaseException]:
        """Sampling state for the plan's new requests.

        Returns:
            The requests whose state cannot be built, and why (they fail alone; the step goes on).
        """
        failed: dict[str, BaseException] = {}
        for new in plan.new_requests:
            try:
                self.states[new.request_id] = SamplingState(
                    new.params, self.device, new.prompt_token_ids, new.bad_words_ids, new.force_words_ids,
                    self.eos_token_ids, new.grammar)
            except Exception as exc:  # noqa: BLE001 - that request fails, the step goes on
                failed[new.request_id] = exc
        return failed
