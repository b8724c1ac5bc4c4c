"""The eager backend: a stock Hugging Face causal LM running on llminfer's paged KV cache."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from llminfer.backends.attention import METADATA_KWARG, PagedKVCache, build_metadata
from llminfer.protocols.messages import SchedulerOutput, StepOutput
from llminfer.results import TokenLogprob
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
        attention_backend: ``"torch"``, ``"cpu"`` (llminfer's CPU decode kernel) or ``"triton"`` (resolved, see
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


@attrs.frozen
class PromptLogprobJob:
    """The prompt positions of one sequence whose logprobs this step yields.

    Attributes:
        request_id: the request.
        first_position: prompt position of the first target (>= 1).
        targets: the prompt tokens at ``first_position, first_position + 1, ...``.
        k: top alternatives to report.
        rows: their rows in the packed step (the logits row before each target).
    """

    request_id: str
    first_position: int
    targets: tuple[int, ...]
    k: int
    rows: tuple[int, ...]


def prompt_logprob_jobs(plan: SchedulerOutput, states: Mapping[str, SamplingState],
                        lengths: Sequence[int] | None = None) -> list[PromptLogprobJob]:
    """What the step's sequences with ``prompt_logprobs`` need: the row of each computed prompt position
    whose next token is also a prompt token (its logits give that token's logprob).

    Args:
        lengths: per sequence, its tokens in the packed row (default: ``len(token_ids)``; speculative
            decoding appends draft tokens).
    """
    jobs = []
    offset = 0
    for i, s in enumerate(plan.sequences):
        n = len(s.token_ids)
        state = states.get(s.request_id)
        if state is not None and state.params.prompt_logprobs is not None:
            start = s.start_position
            end = min(start + n, state.num_prompt - 1)  # positions whose next token is in the prompt
            if end > start:
                jobs.append(PromptLogprobJob(s.request_id, start + 1, tuple(state.token_ids[start + 1 : end + 1]),
                                             state.params.prompt_logprobs,
                                             tuple(range(offset, offset + end - start))))
        offset += lengths[i] if lengths is not None else n
    return jobs


def prompt_logprobs(logits: torch.Tensor, jobs: Sequence[PromptLogprobJob]) -> dict[str, tuple[int, tuple[TokenLogprob, ...]]]:
    """Log-softmax of raw logits at the jobs' rows: each target's logprob and rank, and the top-k.

    Args:
        logits: ``[sum(len(job.rows)), V]`` float32, the jobs' rows in order (overwritten with logprobs).

    Returns:
        ``{request_id: (first_position, entries)}`` for :class:`~llminfer.protocols.messages.StepOutput`.
    """
    out: dict[str, tuple[int, tuple[TokenLogprob, ...]]] = {}
    logits -= logits.logsumexp(dim=-1, keepdim=True)  # in place: the rows can be many
    row = 0
    for job in jobs:
        lp = logits[row : row + len(job.rows)]
        row += len(job.rows)
        targets = torch.tensor(job.targets, dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, targets[:, None])
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        top_ids: list[list[int]] = [[] for _ in job.targets]
        top_values: list[list[float]] = [[] for _ in job.targets]
        if job.k:
            values, ids = torch.topk(lp, job.k, dim=-1)
            top_ids, top_values = ids.tolist(), values.tolist()
        entries = tuple(TokenLogprob(t, v, tuple(zip(ti, tv)), r) for t, v, ti, tv, r in
                        zip(job.targets, chosen[:, 0].tolist(), top_ids, top_values, ranks))
        out[job.request_id] = (job.first_position, entries)
    return out


class HFBackend:
    """Runs one packed step of a transformers model with paged attention, then samples.

    Args:
        model: a causal LM loaded with ``attn_implementation="llminfer_paged"``.
        cache: the paged KV tensors.
        eos_token_ids: suppressed below each request's ``min_new_tokens``.
        attention_backend: ``"torch"``, ``"cpu"`` or ``"triton"`` (already resolved for the device).
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

    def forward(self, plan: SchedulerOutput, extra_rows: Sequence[int] = ()) -> torch.Tensor:
        """Run the model on the plan's packed tokens.

        Args:
            extra_rows: further packed rows whose logits are wanted (prompt logprobs).

        Returns:
            ``[S + len(extra_rows), V]`` float32 logits: one row per sequence with ``sample`` set, in plan
            order, then the extra rows.
        """
        seqs = plan.sequences
        if not extra_rows and (logits := self.graph_step(plan)) is not None:
            return logits
        keep = []
        offset = 0
        for s in seqs:
            offset += len(s.token_ids)
            if s.sample:
                keep.append(offset - 1)
        keep.extend(extra_rows)
        return run_packed(self.model, self.cache, [s.token_ids for s in seqs], [s.start_position for s in seqs],
                          [s.block_table for s in seqs], keep, self.device, self.attention_backend)

    def graph_step(self, plan: SchedulerOutput) -> torch.Tensor | None:
        """Replay the plan from a captured decode graph when it is a pure-decode step that fits a bucket.

        Returns:
            ``[S, V]`` float32 logits of the sampling sequences, or None (the step runs another way).
        """
        seqs = plan.sequences
        if (self.graphs is None or not seqs or not self.graphs.fits(len(seqs))
                or not all(len(s.token_ids) == 1 and s.start_position > 0 for s in seqs)):
            return None
        logits = self.graphs.run([s.token_ids[0] for s in seqs], [s.start_position for s in seqs],
                                 [s.block_table for s in seqs])
        rows = [i for i, s in enumerate(seqs) if s.sample]
        return logits if len(rows) == len(seqs) else logits[rows]

    def release(self, request_ids: Sequence[str]) -> None:
        """Drop the sampling state of finished requests."""
        for rid in request_ids:
            self.states.pop(rid, None)

    def describe(self) -> dict[str, Any]:
        """Facts for ``engine.info()``: steps run so far, the attention kernels, CUDA-graph counts."""
        return {"steps": self.num_steps, "attention_backend": self.attention_backend,
                "cuda_graphs": self.graphs.describe() if self.graphs is not None else None}

    def _register(self, plan: SchedulerOutput, failed: dict[str, BaseException] | None = None) -> None:
        """Sampling state for the plan's new requests; with ``failed``, a request whose state cannot be
        built (a grammar matcher that fails, say) is recorded there instead of failing the step."""
        for new in plan.new_requests:
            try:
                self.states[new.request_id] = SamplingState(
                    new.params, self.device, new.prompt_token_ids, new.bad_words_ids, new.force_words_ids,
                    self.eos_token_ids, new.grammar)
            except Exception as exc:  # noqa: BLE001 - that request fails, the step goes on
                if failed is None:
                    raise
                failed[new.request_id] = exc

    def execute(self, plan: SchedulerOutput) -> StepOutput:
        """Run one step; never raises. A request whose own sampling fails is reported in
        ``StepOutput.failed`` (the others get their tokens); an exception of the whole step (the forward
        pass) is returned in ``StepOutput.error``."""
        start = time.perf_counter_ns()
        try:
            self.release(plan.finished_request_ids)
            failed: dict[str, BaseException] = {}
            self._register(plan, failed)
            sampling = [s for s in plan.sequences if s.sample]
            jobs = prompt_logprob_jobs(plan, self.states)
            with torch.inference_mode():
                logits = self.forward(plan, [r for job in jobs for r in job.rows]) if jobs else self.forward(plan)
                prompt_lps = prompt_logprobs(logits[len(sampling):], jobs) if jobs else {}
                logits = logits[: len(sampling)]
                if failed:
                    keep = [i for i, s in enumerate(sampling) if s.request_id not in failed]
                    sampling = [sampling[i] for i in keep]
                    logits = logits[keep]
                errors: dict[int, BaseException] = {}
                tokens, logprobs = sample(logits, [self.states[s.request_id] for s in sampling], errors)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.num_steps += 1
            for row in errors:
                failed[sampling[row].request_id] = errors[row]
            sampled = {s.request_id: t for s, t in zip(sampling, tokens) if s.request_id not in failed}
            lps = {s.request_id: lp for s, lp in zip(sampling, logprobs) if lp is not None}
            return StepOutput(plan.step_id, sampled, start, time.perf_counter_ns(), logprobs=lps,
                              prompt_logprobs={k: v for k, v in prompt_lps.items() if k not in failed},
                              failed=failed)
        except Exception as exc:  # noqa: BLE001 - the scheduler fails the step's requests with it
            return StepOutput(plan.step_id, {}, start, time.perf_counter_ns(), error=exc)
