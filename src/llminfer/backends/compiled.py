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
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from llminfer.backends.attention import METADATA_KWARG, PagedKVCache, build_metadata, paged_attention_forward
from llminfer.backends.hf import HFBackend
from llminfer.protocols.messages import SchedulerOutput

log = structlog.get_logger("llminfer.compiled")

ATTN_OP_IMPLEMENTATION = "llminfer_paged_op"
"""Name of the op-based paged attention in ``transformers.AttentionInterface``."""

COMPILE_BACKEND_ENV = "LLMINFER_COMPILE_BACKEND"
"""Environment variable naming the ``torch.compile`` backend (default ``inductor``; ``aot_eager`` and
``eager`` are useful to debug or to test quickly on slow machines)."""

_HEAD_POSTPROCESSING_ATTRS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

# ----------------------------------------------------------------------------------------------- the op
_step = threading.local()


class _Layer:
    """Stands in for the attention module inside the op (the paged attention only reads ``layer_idx``)."""

    __slots__ = ("layer_idx",)

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("llminfer::paged_attention", mutates_args=(), tags=_TAGS)
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                       scaling: float | None) -> torch.Tensor:
    """Paged attention of one layer for the current step (metadata from the thread's step context).

    Args:
        query: ``[1, H, T_pad, D]``; key, value: ``[1, H_kv, T_pad, D]``. Only the first ``T_real`` tokens
            (the step context's ``num_tokens``) are real; the rest is padding.
        layer_idx: the cache layer.
        scaling: softmax scale (None: ``1/sqrt(D)``).

    Returns:
        ``[1, T_pad, H, D]`` contiguous, zeros in the padded rows.

    Raises:
        RuntimeError: called outside a step (no step context in this thread).
    """
    meta = getattr(_step, "meta", None)
    if meta is None:
        raise RuntimeError("llminfer::paged_attention called outside an llminfer step")
    n = _step.num_tokens
    t_pad = query.shape[2]
    out, _ = paged_attention_forward(_Layer(layer_idx), query[:, :, :n], key[:, :, :n], value[:, :, :n], None,
                                     scaling=scaling, **{METADATA_KWARG: meta})
    if n == t_pad:
        return out.contiguous()
    full = query.new_zeros(1, t_pad, query.shape[1], query.shape[3])
    full[:, :n] = out
    return full


@paged_attention_op.register_fake
def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                          scaling: float | None) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def paged_attention_op_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function registered as ``"llminfer_paged_op"``: calls the opaque op. A step that runs
    eagerly on the compiled backend (prompt-logprob rows, a step larger than every bucket) passes its
    metadata as a keyword instead of the step context; it goes straight to the eager attention.

    Shapes as :func:`llminfer.backends.attention.paged_attention_forward` (``[1, T, H, D]`` out).
    """
    if kwargs.get(METADATA_KWARG) is not None:
        return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return paged_attention_op(query, key, value, int(module.layer_idx),
                              None if scaling is None else float(scaling)), None


def register_paged_attention_op() -> str:
    """Register :func:`paged_attention_op_forward` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_OP_IMPLEMENTATION, paged_attention_op_forward)
    return ATTN_OP_IMPLEMENTATION


# ----------------------------------------------------------------------------------------------- buckets
def token_buckets(max_tokens: int, smallest: int = 1) -> tuple[int, ...]:
    """Padded sizes for a step of up to ``max_tokens`` tokens: powers of two from ``smallest``, and
    ``max_tokens`` itself as the last bucket.

    Returns:
        Increasing bucket sizes (tokens); ``max_tokens`` is always the last one.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    out = []
    b = max(1, smallest)
    while b < max_tokens:
        out.append(b)
        b *= 2
    out.append(max_tokens)
    return tuple(out)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``n``, or None when ``n`` exceeds every bucket."""
    for b in buckets:
        if b >= n:
            return b
    return None


# ----------------------------------------------------------------------------------------------- options
def inductor_options(mode: str, cudagraphs: bool, device: torch.device, own_graphs: bool = False) -> dict[str, Any]:
    """Inductor config patches for ``compile_mode`` and the CUDA-graph toggle.

    ``"reduce-overhead"`` means CUDA graphs; ``"max-autotune"`` means GEMM autotuning, with CUDA graphs
    only when ``cudagraphs`` is set; ``"default"`` uses CUDA graphs only when ``cudagraphs`` is set.
    CUDA graphs are never used off CUDA, and inductor's own are off when llminfer captures whole decode
    steps itself (``own_graphs``: a graph captured inside another's capture is not allowed).
    """
    import torch._inductor

    opts = dict(torch._inductor.list_mode_options(mode))
    use_cg = device.type == "cuda" and (cudagraphs or mode == "reduce-overhead") and not own_graphs
    opts["triton.cudagraphs"] = use_cg
    if use_cg:
        opts["graph_partition"] = True  # run the cudagraph-unsafe attention op between captured pieces
    return opts


class _CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles, then hands them to the real one."""

    def __init__(self, name: str | Callable, options: dict[str, Any]) -> None:
        self.name = name
        self.options = options
        self.count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.count += 1
        if callable(self.name):
            return self.name(gm, example_inputs)
        if self.name == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=self.options)
        from torch._dynamo import lookup_backend

        return lookup_backend(self.name)(gm, example_inputs)


def _fresh_function(fn: Callable, tag: str) -> Callable:
    """A copy of ``fn`` with its own code object, so dynamo keeps a separate compile cache for it (one per
    backend: engines in one process never share, or evict, each other's compiled graphs)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _body_forward(base: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return base(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state


def _full_forward(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits


class _RowSplitHead(torch.nn.Module):
    """The LM head run outside the graph on CPU: ``small`` (llminfer's kernel) for up to ``small_rows`` rows,
    ``packed`` (the eager backend's oneDNN-prepacked head) for more.

    Why: llminfer's kernel reads a weight fastest for one row (four in bf16), but the 151,646 x 512 head of
    the bench model at 8 and 32 rows ran 1.4-1.6x faster on the prepacked oneDNN GEMM in fp32, and a bf16
    ``F.linear`` on the unpacked weight 1.4-1.7x slower than the prepacked one (2-core AMD EPYC Zen 4, one
    thread, ``/tmp`` microbenchmark of issue 35). The head dominated batch-32 decode, so the compiled backend
    ran batch 32 slower than eager, whose head is the prepacked one."""

    def __init__(self, small: torch.nn.Module, packed: torch.nn.Module, small_rows: int) -> None:
        super().__init__()
        self.small, self.packed, self.small_rows = small, packed, small_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        return self.small(x) if rows <= self.small_rows else self.packed(x)


def cpu_head(head: torch.nn.Module) -> torch.nn.Module:
    """``head`` as the compiled backend runs it outside the graph on CPU (see :class:`_RowSplitHead`):
    unchanged where oneDNN cannot prepack it (quantized, another dtype, no oneDNN)."""
    from llminfer.backends.cpu_kernels import BF16_KERNEL_MAX_ROWS, SkinnyLinear
    from llminfer.backends.prepack import PrepackedLinear, prepack_supported

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
    if type(head) is torch.nn.Linear:  # no kernel here: the prepacked head at every row count, as eager
        return packed
    return _RowSplitHead(head, packed, BF16_KERNEL_MAX_ROWS if head.weight.dtype == torch.bfloat16 else 1)


# ----------------------------------------------------------------------------------------------- backend
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

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, eos_token_ids: Sequence[int] = (), *,
                 max_num_tokens: int = 2048, max_batch_size: int = 16, mode: str = "default",
                 cudagraphs: bool = False, fallback_to_eager: bool = True,
                 compile_backend: str | Callable | None = None, buckets: Sequence[int] | None = None,
                 attention_backend: str = "torch", max_model_len: int = 2048) -> None:
        super().__init__(model, cache, eos_token_ids, attention_backend)
        register_paged_attention_op()
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self._eager_attn_implementation = text_cfg._attn_implementation
        _set_attn_implementation(model, ATTN_OP_IMPLEMENTATION)
        self.mode = mode
        self.fallback_to_eager = fallback_to_eager
        self.buckets = tuple(sorted(set(buckets))) if buckets else token_buckets(max_num_tokens)
        self.keep_buckets = token_buckets(max(max_batch_size, 1))
        wants_graphs = self.device.type == "cuda" and (cudagraphs or mode == "reduce-overhead")
        own_graphs = wants_graphs and attention_backend == "triton"
        self.use_cudagraphs = wants_graphs and not own_graphs  # inductor's own (partitioned) graphs
        self.compile_backend_name = compile_backend or os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
        self._counter = _CountingBackend(self.compile_backend_name,
                                         inductor_options(mode, cudagraphs, self.device, own_graphs))
        self.split_head = not any(getattr(text_cfg, a, None) not in (None, 1, 1.0)
                                  for a in _HEAD_POSTPROCESSING_ATTRS)
        tag = f"{id(self):x}"
        if self.split_head:
            self._module = model.base_model
            self._head = model.get_output_embeddings()
            if self.device.type == "cpu":
                self._head = cpu_head(self._head)
            fn = _fresh_function(_body_forward, tag)
        else:
            self._module = model
            fn = _fresh_function(_full_forward, tag)
        self._target: Callable = torch.compile(fn, backend=self._counter, fullgraph=True, dynamic=False)
        from llminfer.backends.cuda_graphs import batch_buckets

        self._graphs_needed = ((len(self.buckets) + len(batch_buckets(max(max_batch_size, 1))))
                               * (1 if self.split_head else len(self.keep_buckets)))
        _raise_recompile_limit(self._graphs_needed)
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
        _step.meta, _step.num_tokens = meta, b
        try:
            if self.split_head:
                return self._head(self._target(self._module, ids, pos)[0])
            keep = torch.arange(b, device=ids.device)
            return self._target(self._module, ids, pos, keep)[0]
        finally:
            _step.meta = None

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

    def forward(self, plan: SchedulerOutput, extra_rows: Sequence[int] = ()) -> torch.Tensor:
        """Run the plan's packed tokens through the compiled graph (or the eager path after a fallback, or
        for a step larger than every bucket).

        Returns:
            ``[S, V]`` float32 logits, one row per sampling sequence, in plan order.

        Raises:
            Exception: the compiled step failed and ``fallback_to_eager`` is off.
        """
        if not self.compiled_ok or extra_rows:  # prompt-logprob rows: their count fits no keep bucket
            self.num_eager_steps += 1
            return super().forward(plan, extra_rows)
        if (logits := self.graph_step(plan)) is not None:
            self.num_compiled_steps += 1
            return logits
        seqs = plan.sequences
        total = sum(len(s.token_ids) for s in seqs)
        t_pad = bucket_for(total, self.buckets)
        n_keep = sum(1 for s in seqs if s.sample)
        k_pad = n_keep if self.split_head else bucket_for(max(n_keep, 1), self.keep_buckets)
        if t_pad is None or k_pad is None:
            self.num_eager_steps += 1
            return super().forward(plan)
        shape = (t_pad, 0 if self.split_head else k_pad)
        try:
            if shape in self._shapes_seen:
                logits = self._compiled_forward(plan, total, t_pad, n_keep, k_pad)
            else:  # the first step of this shape compiles it (seconds on CPU): say so
                from llminfer.logging import status

                with status(f"compiling the model step for {t_pad} tokens (first request of this size) ..."):
                    logits = self._compiled_forward(plan, total, t_pad, n_keep, k_pad)
                self._shapes_seen.add(shape)
        except Exception as exc:
            if not self.fallback_to_eager:
                raise
            self.disable_compiled(exc)
            self.num_eager_steps += 1
            return super().forward(plan)
        self.num_compiled_steps += 1
        return logits

    def disable_compiled(self, exc: BaseException | None = None) -> None:
        """Switch to the eager path for good (the model gets its eager attention implementation back);
        logs one warning naming ``exc``."""
        if not self.compiled_ok:
            return
        self.compiled_ok = False
        self.graphs = None  # they replay the compiled graph
        self.fallback_error = _describe(exc) if exc is not None else "disabled"
        _set_attn_implementation(self.model, self._eager_attn_implementation)
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
        _raise_recompile_limit(self._graphs_needed)  # dynamo's config is per thread: this one's too
        before = self.num_compiles
        dev = self.device
        meta, _ = build_metadata(self.cache, [], [], [], dev, self.attention_backend)
        for t_pad in self.buckets:
            if not self.compiled_ok or (max_tokens is not None and t_pad > max_tokens):
                break
            ids = torch.zeros(1, t_pad, dtype=torch.long, device=dev)
            pos = torch.zeros(1, t_pad, dtype=torch.long, device=dev)  # distinct: aliased inputs guard apart
            _step.meta, _step.num_tokens = meta, 0
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
                _step.meta = None
        return self.num_compiles - before

    @torch.inference_mode()  # inputs must be inference tensors in every call, or dynamo's guards differ
    def _compiled_forward(self, plan: SchedulerOutput, total: int, t_pad: int, n_keep: int, k_pad: int) -> torch.Tensor:
        _raise_recompile_limit(self._graphs_needed)  # dynamo's config is per thread (cheap when raised)
        seqs = plan.sequences
        dev = self.device
        keep: list[int] = []
        offset = 0
        for s in seqs:
            offset += len(s.token_ids)
            if s.sample:
                keep.append(offset - 1)
        meta, position_ids = build_metadata(self.cache, [s.start_position for s in seqs],
                                            [len(s.token_ids) for s in seqs], [s.block_table for s in seqs], dev,
                                            self.attention_backend)
        ids = torch.zeros(1, t_pad, dtype=torch.long, device=dev)
        pos = torch.zeros(1, t_pad, dtype=torch.long, device=dev)
        ids[0, :total] = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=dev)
        pos[:, :total] = position_ids
        keep_t = torch.tensor(keep + [0] * (k_pad - n_keep), dtype=torch.long, device=dev)
        _step.meta, _step.num_tokens = meta, total
        try:
            if self.use_cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            if self.split_head:
                hidden = self._target(self._module, ids, pos)  # [1, t_pad, hidden]
                logits = self._head(hidden[0, keep_t[:n_keep]]).float()
            else:
                logits = self._target(self._module, ids, pos, keep_t)[0, :n_keep].float()
        finally:
            _step.meta = None
        return logits.clone() if self.use_cudagraphs else logits


def _describe(exc: BaseException) -> str:
    """``Type: first line`` of ``exc`` and of its root cause (dynamo wraps backend errors)."""
    def line(e: BaseException) -> str:
        text = str(e).strip()
        return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__

    root = getattr(exc, "inner_exception", None) or exc.__cause__
    seen = {id(exc)}
    while root is not None and id(root) not in seen and (getattr(root, "inner_exception", None) or root.__cause__):
        seen.add(id(root))
        root = getattr(root, "inner_exception", None) or root.__cause__
    return line(exc) if root is None else f"{line(exc)} <- {line(root)}"


def _set_attn_implementation(model: torch.nn.Module, name: str) -> None:
    """Point the config of ``model`` and of every submodule at attention implementation ``name`` (a name
    registered with ``transformers.AttentionInterface``; layers look it up on every call)."""
    seen: set[int] = set()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            cfg._attn_implementation = name


def _raise_recompile_limit(needed: int) -> None:
    """Make room in dynamo's per-code-object cache for every bucket, times a few adapter / grad-mode states
    (never lowers the limit; a full cache would make dynamo run new shapes uncompiled). torch 2.13's dynamo
    config is per thread (a value set in one thread reads as the default in another), so every thread
    that compiles or runs the graph calls this first."""
    import torch._dynamo.config as dcfg

    want = max(64, 4 * needed)
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, attr) and getattr(dcfg, attr) < want:
            setattr(dcfg, attr, want)
