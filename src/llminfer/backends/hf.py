"""The eager backend: a stock Hugging Face causal LM running on llminfer's paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llminfer.backends.attention import PagedKVCache
from llminfer.backends.base import StepBackend, StepResult, logits_hooked
from llminfer.backends.decoder_loop import decode_stack_steps, uses_decoder_loop
from llminfer.backends.packing import PackedStep, prompt_logprobs, run_packed
from llminfer.kernels.prepack import argmax_only
from llminfer.protocols.messages import SchedulerOutput

__all__ = ["HFBackend", "build_eager", "run_packed"]


def build_eager(rt: Any, cfg: Any) -> StepBackend:
    """The eager backend for a loaded :class:`~llminfer.runtime.Runtime` and its
    :class:`~llminfer.config.EngineConfig` (registered in :data:`llminfer.backends.registry.BACKENDS`): with
    ``speculative_method="ngram"`` the prompt-lookup backend, with an assistant model the speculative one,
    else :class:`HFBackend`."""
    if cfg.speculative_method == "ngram":
        from llminfer.backends.speculative import PromptLookupBackend

        return PromptLookupBackend(rt.model, rt.kv_cache, rt.eos_token_ids, cfg.speculative_num_assistant_tokens,
                                   cfg.speculative_prompt_lookup_min, cfg.speculative_prompt_lookup_max,
                                   rt.attention_backend)
    if rt.draft_model is not None:
        from llminfer.backends.speculative import SpeculativeBackend

        return SpeculativeBackend(rt.model, rt.kv_cache, rt.draft_model, rt.draft_cache, rt.eos_token_ids,
                                  cfg.speculative_num_assistant_tokens, cfg.speculative_confidence_threshold)
    backend = HFBackend(rt.model, rt.kv_cache, rt.eos_token_ids, rt.attention_backend, cuda_graphs=cfg.cuda_graphs,
                        max_batch_size=cfg.max_batch_size, max_model_len=rt.max_model_len)
    if cfg.cpu_argmax_screen:
        backend.attach_argmax_screen()
    return backend


class HFBackend(StepBackend):
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
        super().__init__(model, cache, eos_token_ids, attention_backend)
        #: The module that computes the logits (where an argmax screen may sit; :meth:`attach_argmax_screen`).
        self.output_head: torch.nn.Module | None = (
            model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None)
        self.graphs: Any = None
        if cuda_graphs and self.device.type == "cuda" and attention_backend == "triton":
            from llminfer.backends.cuda_graphs import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(model, cache, max_batch_size, max_model_len)
            self.graphs.capture_all()

    def run_step(self, plan: SchedulerOutput) -> StepResult:
        """Pack the plan, run the model once, sample every sampling sequence and read the prompt logprobs."""
        step = PackedStep.from_plan(plan, self.states)
        seqs = [s for s in plan.sequences if s.sample]
        greedy = [row for row, s in enumerate(seqs) if self.states[s.request_id].argmax_only]
        with argmax_only(self.screenable_head(), greedy):
            logits = self.forward(step)
        n = len(step.sample_rows)
        result = StepResult(prompt_logprobs=prompt_logprobs(logits[n:], step.jobs) if step.jobs else {})
        self.sample_rows(logits[:n], seqs, result)
        return result

    def forward(self, step: PackedStep) -> torch.Tensor:
        """Run the model on the packed step (from a captured decode graph where one fits).

        Returns:
            ``[len(step.keep_rows), V]`` float32 logits: the sample rows, then the prompt-logprob rows.
        """
        if not step.jobs and (logits := self.graph_step(step)) is not None:
            return logits
        return step.run(self.model, self.cache, self.device, self.attention_backend)

    def graph_step(self, step: PackedStep) -> torch.Tensor | None:
        """Replay the step from a captured decode graph when it is a pure-decode step that fits a bucket.

        Returns:
            ``[len(step.sample_rows), V]`` float32 logits, or None (the step runs another way).
        """
        if self.graphs is None or not step.is_pure_decode or not self.graphs.fits(len(step.tokens)):
            return None
        logits = self.graphs.run([t[0] for t in step.tokens], list(step.starts), list(step.block_tables))
        # one row per sequence in a pure-decode step: a sequence's row is its index
        return logits if len(step.sample_rows) == len(step.tokens) else logits[list(step.sample_rows)]

    def screenable_head(self) -> torch.nn.Module | None:
        """:attr:`output_head` while the model still calls it as its head and no hook can see the logits
        (:func:`~llminfer.backends.base.logits_hooked`), else None: an adapter that wraps the head (PEFT's LoRA
        on ``lm_head``) or a forward hook changes the logits, which an argmax screen does not see."""
        head = self.output_head
        if head is None or self.model.get_output_embeddings() is not head:
            return None
        return None if logits_hooked(self.model, head) else head

    def attach_argmax_screen(self) -> bool:
        """Screen greedy rows through int8 / bf16 copies of an fp32 or bf16 CPU head where measured faster
        (:func:`~llminfer.kernels.argmax_screen.attach_argmax_screen`); returns whether it did. A head the
        ``dtype="auto"`` measurement already screened (:mod:`llminfer.models.dtype_probe`) keeps that outcome
        rather than being timed a second time."""
        head = self.output_head
        if self.device.type != "cpu" or head is None:
            return False
        if hasattr(head, "argmax_screen_probe_ms"):
            screen = getattr(head, "argmax_screen", None)
            if screen is not None:
                screen.reset_counts()  # the measurement's dummy steps are not the engine's
            return screen is not None
        from llminfer.kernels.argmax_screen import attach_argmax_screen

        return attach_argmax_screen(head)

    def describe(self) -> dict[str, Any]:
        """Facts for ``engine.info()``: steps run so far, the attention kernels, CUDA-graph counts, whether
        steps run through llminfer's decoder loop (:mod:`llminfer.backends.decoder_loop`) or ``model(...)``,
        how many steps ran all their layers in one op (:mod:`llminfer.backends.decode_stack`), and the argmax screen (its load-time probe in ms, rows screened, candidates per row), or None."""
        screen = getattr(self.output_head, "argmax_screen", None)
        probe = getattr(self.output_head, "argmax_screen_probe_ms", None)
        return {**super().describe(), "cuda_graphs": self.graphs.describe() if self.graphs is not None else None,
                "decoder_loop": uses_decoder_loop(self.model), "decode_stack_steps": decode_stack_steps(self.model),
                "argmax_screen": None if probe is None else {
                    "kept": screen is not None, "probe_ms": probe, **(screen.describe() if screen else {})}}
