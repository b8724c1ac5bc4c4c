"""The compiled backend: the eager backend's packed step under ``torch.compile``.

How the step is split
---------------------
The paged attention (``backends.attention.paged_attention_forward``) is data-dependent Python: it loops over
the step's prefill segments and gathers a different context length for each sequence. Traced by dynamo
it would specialise on every segment length and recompile nearly every step. So the attention is hidden
from the compiler behind one opaque custom operator, ``torch.ops.llminfer.paged_attention(query, key,
value, layer_idx, scaling)``, that reads the step's metadata from a thread-local "step context" set just
before the compiled call (the design vLLM uses for its ``unified_attention`` op). Everything else, the
embedding, every decoder layer's projections, rotary embedding, norms and MLP, compiles as **one graph**
(``fullgraph=True``, no graph breaks), whose only inputs are ``input_ids`` and ``position_ids`` of shape
``[1, T]``. The op is tagged ``cudagraph_unsafe``, so with CUDA graphs on the torch attention path inductor
partitions the graph around it: the dense pieces replay as CUDA graphs, the attention runs eagerly between
them. With the Triton attention path (fixed-grid kernels reading device metadata) ``compile_cudagraphs``
instead captures whole pure-decode steps of the compiled graph in the eager backend's
:class:`~llminfer.backends.cuda_graphs.DecodeGraphRunner`: the same static buffers, batch buckets and
memory pool, so the two backends replay decode the same way.

Shapes never vary inside the graph except ``T``, and ``T`` is padded up to a bucket (powers of two by
default, see :func:`token_buckets`), so each bucket compiles once and nothing recompiles in steady state
(:attr:`CompiledBackend.num_compiles` counts graph compilations; it is in ``engine.info()``).
Padded tokens are never seen by the attention op: it computes and writes K/V for the first ``T_real``
tokens only (so no KV slot is touched for padding, and real rows attend only to real context) and returns
zeros for the padded rows, which every later layer processes row-wise and which are dropped at the end.

The language-model head runs outside the graph on the rows whose logits are wanted (one GEMM; compiling
it gains nothing and would add the number of sampled rows as a second varying shape), exactly as the
eager backend applies it. Models whose head post-processes logits (soft-capping, logit scales) compile
the whole ``CausalLM`` forward instead, with the kept-row count padded to a bucket too.

Failures
--------
With ``compile_fallback_to_eager`` (the default) a compile or runtime error of the compiled step logs one
structlog warning and the same step is rerun on the eager path (re-writing the same KV slots with the
same values, so nothing is lost); every later step stays eager. Without it the step fails and its
requests get the error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from llminfer.backends.attention import PagedKVCache, build_metadata
from llminfer.backends.base import logits_hooked
from llminfer.backends.compile_config import (
    COMPILE_BACKEND_ENV,
    CountingBackend,
    bucket_for,
    describe_error,
    fresh_function,
    inductor_options,
    raise_recompile_limit,
    token_buckets,
)
from llminfer.backends.compiled_attention import (
    ATTN_OP_IMPLEMENTATION,
    register_paged_attention_op,
    set_attn_implementation,
    step_context,
)
from llminfer.backends.hf import HFBackend
from llminfer.backends.packing import PackedStep
from llminfer.models.weight_only_base import WeightOnlyLinear

__all__ = ["COMPILE_BACKEND_ENV", "CompiledBackend", "bucket_for", "cpu_head", "token_buckets"]

log = structlog.get_logger("llminfer.compiled")

_HEAD_POSTPROCESSING_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _body_forward(base: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return base(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state


def _full_forward(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits


def settle_compile_workers(timeout_s: float = 120.0) -> None:
    """Wait until Inductor's pool of compile workers, if a compilation started one, is up.

    Why: the pool starts at the first compilation, and its workers spend seconds of CPU importing torch
    after the compilation itself has returned (from Inductor's cache, a compilation takes well under that).
    Those seconds shared the cores with the steps that followed: on a 2-core Zen 4 VM the first measured
    run after a one-run warm-up decoded at 13.8 instead of about 60 tok/s (batch 1, fp32 bench model), and
    not at all with ``TORCHINDUCTOR_COMPILE_THREADS=1``. Waiting here moves that time into the compilation.
    A no-op where no pool was started; any failure of torch's private API is ignored."""
    try:
        from torch._inductor.async_compile import AsyncCompile

        ready = getattr(AsyncCompile, "_ready_future", None)
        if ready is not None:
            ready.result(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - another torch release, a pool that failed: the steps run anyway
        log.debug("could not wait for Inductor's compile workers", exc_info=True)


def cpu_head(head: torch.nn.Module) -> torch.nn.Module:
    """``head`` as the compiled backend runs it outside the graph on CPU: where ``head`` is on llminfer's
    kernel (a :class:`~llminfer.kernels.layers.SkinnyLinear`), a
    :class:`~llminfer.kernels.prepack.PrepackedLinear` that keeps the kernel for a few rows
    (:func:`~llminfer.kernels.prepack.head_kernel_rows`) and takes oneDNN's packed GEMM beyond, as the eager
    backend's head does: for more rows a large vocabulary head runs faster there, and it dominates
    large-batch decode. A plain ``nn.Linear`` head gets the packed GEMM at every row count; ``head`` is
    returned unchanged where oneDNN cannot prepack it (quantized, another dtype, no oneDNN)."""
    from llminfer.kernels.layers import SkinnyLinear
    from llminfer.kernels.prepack import PrepackedLinear, head_kernel_rows, prepack_supported

    if not isinstance(head, torch.nn.Linear) or type(head) not in (torch.nn.Linear, SkinnyLinear):
        return head
    if not prepack_supported(head.weight.dtype, head.weight.device):
        return head
    try:
        packed = PrepackedLinear(head)
        with torch.inference_mode():
            packed(torch.zeros(1, head.in_features, dtype=head.weight.dtype))
    except RuntimeError:  # an oneDNN build without this kernel
        return head
    if type(head) is SkinnyLinear:
        packed.kernel_rows = head_kernel_rows(packed)
    return packed


class CompiledBackend(HFBackend):
    """:class:`HFBackend` with the model step under ``torch.compile`` (see the module docstring).

    Args:
        model: a causal LM; its attention implementation is switched to ``"llminfer_paged_op"``.
        cache: the paged KV tensors.
        eos_token_ids: as for :class:`HFBackend`.
        max_num_tokens: most tokens in one step (the scheduler's ``max_num_batched_tokens``); the largest
            bucket.
        max_batch_size: most sampled rows in one step (buckets of the kept rows in whole-forward mode).
        mode: ``compile_mode`` (``default``, ``reduce-overhead``, ``max-autotune``).
        cudagraphs: ``compile_cudagraphs`` (CUDA only).
        fallback_to_eager: ``compile_fallback_to_eager``.
        compile_backend: ``torch.compile`` backend name or callable; default ``$LLMINFER_COMPILE_BACKEND``
            or ``"inductor"``.
        buckets: padded step sizes in tokens (default :func:`token_buckets` of ``max_num_tokens``).
        attention_backend: the attention kernels inside the opaque op (``"torch"`` or ``"triton"``).
        max_model_len: sizes the decode graphs' block tables (with Triton attention and CUDA graphs).
    """

    name = "compiled"

    @classmethod
    def from_runtime(cls, rt: Any, cfg: Any) -> CompiledBackend:
        """The compiled backend for a loaded :class:`~llminfer.runtime.Runtime` and its
        :class:`~llminfer.config.EngineConfig` (registered in :data:`llminfer.backends.registry.BACKENDS`)."""
        backend = cls(rt.model, rt.kv_cache, rt.eos_token_ids,
                      max_num_tokens=max(cfg.scheduler.max_num_batched_tokens, 1), max_batch_size=cfg.max_batch_size,
                      mode=cfg.compile_mode, cudagraphs=cfg.compile_cudagraphs,
                      fallback_to_eager=cfg.compile_fallback_to_eager, attention_backend=rt.attention_backend,
                      max_model_len=rt.max_model_len)
        if cfg.cpu_argmax_screen:
            backend.attach_argmax_screen()
        return backend

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, eos_token_ids: Sequence[int] = (), *,
                 max_num_tokens: int = 2048, max_batch_size: int = 16, mode: str = "default",
                 cudagraphs: bool = False, fallback_to_eager: bool = True,
                 compile_backend: str | Callable | None = None, buckets: Sequence[int] | None = None,
                 attention_backend: str = "torch", max_model_len: int = 2048) -> None:
        super().__init__(model, cache, eos_token_ids, attention_backend)
        register_paged_attention_op()
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._eager_attn_implementation = text_cfg._attn_implementation
        set_attn_implementation(model, ATTN_OP_IMPLEMENTATION)
        self.mode = mode
        self.fallback_to_eager = fallback_to_eager
        self.buckets = tuple(sorted(set(buckets))) if buckets else token_buckets(max_num_tokens)
        self.keep_buckets = token_buckets(max(max_batch_size, 1))
        wants_graphs = self.device.type == "cuda" and (cudagraphs or mode == "reduce-overhead")
        own_graphs = wants_graphs and attention_backend == "triton"
        self.use_cudagraphs = wants_graphs and not own_graphs  # inductor's own (partitioned) graphs
        self.compile_backend_name = compile_backend or os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
        # Weight-only layers keep inductor's Python wrapper: with the C++ one, the built-in SmolLM2 under int4-wo
        # (its 210 products on llminfer's ops) took 277 s to its first token, against 8.9 s (2-vCPU Zen 4).
        quantized = any(isinstance(m, WeightOnlyLinear) for m in model.modules())
        self._counter = CountingBackend(self.compile_backend_name,
                                         inductor_options(mode, cudagraphs, self.device, own_graphs,
                                                          cpp_wrapper=not quantized))
        self.split_head = not any(getattr(text_cfg, a, None) not in (None, 1, 1.0)
                                  for a in _HEAD_POSTPROCESSING_ATTRS)
        tag = f"{id(self):x}"
        if self.split_head:
            self._module = model.base_model
            self._head = model.get_output_embeddings()
            if self.device.type == "cpu":
                self._head = cpu_head(self._head)
            self.output_head = self._head
            fn = fresh_function(_body_forward, tag)
        else:
            self._module = model
            self.output_head = None
            fn = fresh_function(_full_forward, tag)
        self._target: Callable = torch.compile(fn, backend=self._counter, fullgraph=True, dynamic=False)
        from llminfer.backends.cuda_graphs import batch_buckets

        self._graphs_needed = ((len(self.buckets) + len(batch_buckets(max(max_batch_size, 1))))
                               * (1 if self.split_head else len(self.keep_buckets)))
        raise_recompile_limit(self._graphs_needed)
        self.compiled_ok = True
        self.fallback_error: str | None = None
        self.num_compiled_steps = 0
        self.num_eager_steps = 0
        self._shapes_seen: set[tuple[int, int]] = set()  # graphs run once, (t_pad, k_pad or 0): compiled
        if any(hasattr(getattr(m, "weight", None), "quant_state") or hasattr(getattr(m, "weight", None), "SCB")
               for m in model.modules()):
            reason = RuntimeError("bitsandbytes-quantized layers do not compile (dynamo cannot trace their "
                                  "in-place weight casts)")
            if not fallback_to_eager:
                from llminfer.errors import BackendUnavailableError

                raise BackendUnavailableError(f"the compiled backend cannot run this model: {reason}; use "
                                              "--backend eager or allow compile_fallback_to_eager")
            self.disable_compiled(reason)
        if own_graphs and self.compiled_ok:
            try:
                self.attach_decode_graphs(max_batch_size, max_model_len, capture=True)
            except Exception as exc:
                if not fallback_to_eager:
                    raise
                self.disable_compiled(exc)

    def screenable_head(self) -> torch.nn.Module | None:
        """The head this backend calls after its graph (:attr:`output_head`), or None with the head inside it
        or where a hook can see the logits (:func:`~llminfer.backends.base.logits_hooked`)."""
        head = self.output_head
        return None if head is None or logits_hooked(self.model, head) else head

    def attach_decode_graphs(self, max_batch_size: int, max_model_len: int, capture: bool = True) -> Any:
        """Replay pure-decode steps of the compiled graph from the eager backend's
        :class:`~llminfer.backends.cuda_graphs.DecodeGraphRunner` (``capture=False``: run each bucket on
        the static buffers without capturing, which is how CPU tests exercise this path).

        Returns:
            The runner (also ``self.graphs``), its graphs captured.
        """
        from llminfer.backends.cuda_graphs import DecodeGraphRunner

        self.graphs = DecodeGraphRunner(self.model, self.cache, max_batch_size, max_model_len, capture=capture,
                                        forward_fn=self._graph_forward)
        self.graphs.capture_all()
        return self.graphs

    def _graph_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        """One decode bucket through the compiled graph: ``ids``, ``pos`` ``[1, B]`` → ``[B, V]`` logits."""
        b = ids.shape[1]
        step_context.meta, step_context.num_tokens = meta, b
        try:
            if self.split_head:
                return self._head(self._target(self._module, ids, pos)[0])
            keep = torch.arange(b, device=ids.device)
            return self._target(self._module, ids, pos, keep)[0]
        finally:
            step_context.meta = None

    @property
    def num_compiles(self) -> int:
        """Graphs compiled so far (one per bucket in use; more means recompilation)."""
        return self._counter.count

    def stats(self) -> dict[str, Any]:
        """Compile facts for ``engine.info()``: counts, buckets, mode, whether it fell back to eager."""
        return {
            "compile_backend": self.compile_backend_name if isinstance(self.compile_backend_name, str)
            else getattr(self.compile_backend_name, "__name__", "custom"),
            "compile_mode": self.mode,
            "cudagraphs": self.use_cudagraphs or self.graphs is not None,
            "num_compiles": self.num_compiles,
            "compiled_steps": self.num_compiled_steps,
            "eager_steps": self.num_eager_steps,
            "token_buckets": list(self.buckets),
            "fell_back_to_eager": not self.compiled_ok,
            "fallback_error": self.fallback_error,
        }

    def describe(self) -> dict[str, Any]:
        """Facts for ``engine.info()``: ``compile`` holds :meth:`stats`."""
        return {**super().describe(), "compile": self.stats()}

    def forward(self, step: PackedStep) -> torch.Tensor:
        """Run the packed step through the compiled graph (or the eager path after a fallback, for a step
        with prompt-logprob rows, or for a step larger than every bucket).

        Returns:
            ``[len(step.keep_rows), V]`` float32 logits, the sample rows first.

        Raises:
            Exception: the compiled step failed and ``fallback_to_eager`` is off.
        """
        if not self.compiled_ok or step.jobs:  # prompt-logprob rows: their count fits no keep bucket
            self.num_eager_steps += 1
            return super().forward(step)
        if (logits := self.graph_step(step)) is not None:
            self.num_compiled_steps += 1
            return logits
        total = step.num_tokens
        t_pad = bucket_for(total, self.buckets)
        n_keep = len(step.sample_rows)
        k_pad = n_keep if self.split_head else bucket_for(max(n_keep, 1), self.keep_buckets)
        if t_pad is None or k_pad is None:
            self.num_eager_steps += 1
            return super().forward(step)
        shape = (t_pad, 0 if self.split_head else k_pad)
        try:
            if shape in self._shapes_seen:
                logits = self._compiled_forward(step, t_pad, k_pad)
            else:  # the first step of this shape compiles it (seconds on CPU): say so
                from llminfer.logging import status

                with status(f"compiling the model step for {t_pad} tokens (first request of this size) ..."):
                    logits = self._compiled_forward(step, t_pad, k_pad)
                    settle_compile_workers()
                self._shapes_seen.add(shape)
        except Exception as exc:
            if not self.fallback_to_eager:
                raise
            self.disable_compiled(exc)
            self.num_eager_steps += 1
            return super().forward(step)
        self.num_compiled_steps += 1
        return logits

    def disable_compiled(self, exc: BaseException | None = None) -> None:
        """Switch to the eager path for good (the model gets its eager attention implementation back);
        logs one warning naming ``exc``."""
        if not self.compiled_ok:
            return
        self.compiled_ok = False
        self.graphs = None  # they replay the compiled graph
        self.fallback_error = describe_error(exc) if exc is not None else "disabled"
        set_attn_implementation(self.model, self._eager_attn_implementation)
        log.warning("torch.compile path disabled; continuing on the eager path", error=self.fallback_error)

    @torch.inference_mode()
    def warmup(self, max_tokens: int | None = None) -> int:
        """Compile the graph of every bucket up to ``max_tokens`` (default: all) before serving.

        Runs the compiled graph on padding only: the attention op sees zero real tokens, so no KV slot is
        written. Call it while no step runs (before the engine serves requests).

        Returns:
            Graphs compiled by this call.

        Raises:
            Exception: compilation failed and ``fallback_to_eager`` is off (with it, the backend falls back
            to eager and this returns).
        """
        raise_recompile_limit(self._graphs_needed)  # dynamo's config is per thread: this one's too
        before = self.num_compiles
        dev = self.device
        meta, _ = build_metadata(self.cache, [], [], [], dev, self.attention_backend)
        for t_pad in self.buckets:
            if not self.compiled_ok or (max_tokens is not None and t_pad > max_tokens):
                break
            ids = torch.zeros(1, t_pad, dtype=torch.long, device=dev)
            pos = torch.zeros(1, t_pad, dtype=torch.long, device=dev)  # distinct: aliased inputs guard apart
            step_context.meta, step_context.num_tokens = meta, 0
            try:
                if self.use_cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()
                if self.split_head:
                    self._target(self._module, ids, pos)
                    self._shapes_seen.add((t_pad, 0))
                else:
                    for k_pad in self.keep_buckets:
                        if k_pad <= t_pad:
                            keep = torch.zeros(k_pad, dtype=torch.long, device=dev)
                            self._target(self._module, ids, pos, keep)
                            self._shapes_seen.add((t_pad, k_pad))
            except Exception as exc:
                if not self.fallback_to_eager:
                    raise
                self.disable_compiled(exc)
            finally:
                step_context.meta = None
        settle_compile_workers()
        return self.num_compiles - before

    @torch.inference_mode()  # inputs must be inference tensors in every call, or dynamo's guards differ
    def _compiled_forward(self, step: PackedStep, t_pad: int, k_pad: int) -> torch.Tensor:
        """The step padded to ``t_pad`` tokens (and ``k_pad`` kept rows when the head is inside the graph)
        through the compiled graph: ``[len(step.sample_rows), V]`` float32 logits."""
        raise_recompile_limit(self._graphs_needed)  # dynamo's config is per thread (cheap when raised)
        dev = self.device
        total, keep, n_keep = step.num_tokens, list(step.sample_rows), len(step.sample_rows)
        meta, position_ids = build_metadata(self.cache, step.starts, [len(t) for t in step.tokens],
                                            step.block_tables, dev, self.attention_backend)
        ids = torch.zeros(1, t_pad, dtype=torch.long, device=dev)
        pos = torch.zeros(1, t_pad, dtype=torch.long, device=dev)
        ids[0, :total] = torch.tensor([t for seq in step.tokens for t in seq], dtype=torch.long, device=dev)
        pos[:, :total] = position_ids
        keep_t = torch.tensor(keep + [0] * (k_pad - n_keep), dtype=torch.long, device=dev)
        step_context.meta, step_context.num_tokens = meta, total
        try:
            if self.use_cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            if self.split_head:
                hidden = self._target(self._module, ids, pos)  # [1, t_pad, hidden]
                logits = self._head(hidden[0, keep_t[:n_keep]]).float()
            else:
                logits = self._target(self._module, ids, pos, keep_t)[0, :n_keep].float()
        finally:
            step_context.meta = None
        return logits.clone() if self.use_cudagraphs else logits
