"""The eager backend: a stock Hugging Face causal LM running on llminfer's paged KV cache."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from llminfer.backends.attention import METADATA_KWARG, PagedKVCache, build_metadata
from llminfer.protocols.messages import SchedulerOutput, StepOutput
from llminfer.sampling.sampler import SamplingState, sample


def run_packed(
    model: torch.nn.Module,
    cache: PagedKVCache,
    tokens: Sequence[Sequence[int]],
    starts: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    keep_rows: Sequence[int],
    device: torch.device,
    attention_backend: str = "torch",
) -> torch.Tensor:
    """One forward pass over a packed row of every sequence's new tokens, writing their K/V into ``cache``.

    Args:
        tokens: per sequence, the tokens to compute (their positions start at ``starts[i]``).
        block_tables: per sequence, KV block ids covering those positions.
        keep_rows: indices into the packed row whose logits are wanted.
        attention_backend: ``"torch"`` or ``"triton"`` (resolved, see
            :func:`~llminfer.backends.triton_attention.resolve_attention_backend`).

    Returns:
        ``[len(keep_rows), V]`` float32 logits.
    """
    flat = [t for seq in tokens for t in seq]
    meta, position_ids = build_metadata(cache, starts, [len(t) for t in tokens], block_tables, device,
                                        attention_backend)
    ids = torch.tensor(flat, dtype=torch.long, device=device)[None]
    keep = torch.tensor(list(keep_rows) or [len(flat) - 1], dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep,
                    **{METADATA_KWARG: meta})
    logits = out.logits[0].float()
    return logits if keep_rows else logits[:0]


class HFBackend:
    """Runs one packed step of a transformers model with paged attention, then samples.

    Args:
        model: a causal LM loaded with ``attn_implementation="llminfer_paged"``.
        cache: the paged KV tensors.
        eos_token_ids: suppressed below each request's ``min_new_tokens``.
        attention_backend: ``"torch"`` or ``"triton"`` (already resolved for the device).
        cuda_graphs: capture pure-decode steps as CUDA graphs (CUDA with Triton attention only; see
            :mod:`llminfer.backends.cuda_graphs`); ``max_batch_size`` and ``max_model_len`` size them.
    """

    name = "eager"

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, eos_token_ids: Sequence[int] = (),
                 attention_backend: str = "torch", cuda_graphs: bool = False, max_batch_size: int = 16,
                 max_model_len: int = 2048) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.cache = cache
        self.device = next(model.parameters()).device
        self.eos_token_ids = list(eos_token_ids)
        self.states: dict[str, SamplingState] = {}
        self.num_steps = 0
        self.graphs: Any = None
        if cuda_graphs and self.device.type == "cuda" and attention_backend == "triton":
            from llminfer.backends.cuda_graphs import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(model, cache, max_batch_size, max_model_len)
            self.graphs.capture_all()

    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run the model on the plan's packed tokens.

        Returns:
            ``[S, V]`` float32 logits, one row per sequence with ``sample`` set, in plan order.
        """
        seqs = plan.sequences
        if (self.graphs is not None and seqs and self.graphs.fits(len(seqs))
                and all(len(s.token_ids) == 1 and s.start_position > 0 for s in seqs)):
            logits = self.graphs.run([s.token_ids[0] for s in seqs], [s.start_position for s in seqs],
                                     [s.block_table for s in seqs])
            rows = [i for i, s in enumerate(seqs) if s.sample]
            return logits if len(rows) == len(seqs) else logits[rows]
        keep = []
        offset = 0
        for s in seqs:
            offset += len(s.token_ids)
            if s.sample:
                keep.append(offset - 1)
        return run_packed(self.model, self.cache, [s.token_ids for s in seqs], [s.start_position for s in seqs],
                          [s.block_table for s in seqs], keep, self.device, self.attention_backend)

    def release(self, request_ids: Sequence[str]) -> None:
        """Drop the sampling state of finished requests."""
        for rid in request_ids:
            self.states.pop(rid, None)

    def describe(self) -> dict[str, Any]:
        """Facts for ``engine.info()``: steps run so far, the attention kernels, CUDA-graph counts."""
        return {"steps": self.num_steps, "attention_backend": self.attention_backend,
                "cuda_graphs": self.graphs.describe() if self.graphs is not None else None}

    def _register(self, plan: SchedulerOutput) -> None:
        for new in plan.new_requests:
            self.states[new.request_id] = SamplingState(
                new.params, self.device, new.prompt_token_ids, new.bad_words_ids, new.force_words_ids,
                self.eos_token_ids, new.grammar)

    def execute(self, plan: SchedulerOutput) -> StepOutput:
        """Run one step; never raises (an exception is returned in ``StepOutput.error``)."""
        start = time.perf_counter_ns()
        try:
            self.release(plan.finished_request_ids)
            self._register(plan)
            sampling = [s for s in plan.sequences if s.sample]
            with torch.inference_mode():
                logits = self.forward(plan)
                tokens, logprobs = sample(logits, [self.states[s.request_id] for s in sampling])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.num_steps += 1
            sampled = {s.request_id: t for s, t in zip(sampling, tokens)}
            lps = {s.request_id: lp for s, lp in zip(sampling, logprobs) if lp is not None}
            return StepOutput(plan.step_id, sampled, start, time.perf_counter_ns(), logprobs=lps)
        except Exception as exc:  # noqa: BLE001 - the scheduler fails the step's requests with it
            return StepOutput(plan.step_id, {}, start, time.perf_counter_ns(), error=exc)
