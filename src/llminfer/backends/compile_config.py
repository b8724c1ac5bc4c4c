"""How the compiled backend drives ``torch.compile``: the padded step sizes (buckets), inductor's options,
a backend that counts the graphs it compiles, and dynamo's per-thread cache limit.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llminfer.env import env_flag

COMPILE_BACKEND_ENV = "LLMINFER_COMPILE_BACKEND"
"""Environment variable naming the ``torch.compile`` backend (default ``inductor``; ``aot_eager`` and
``eager`` are useful to debug or to test quickly on slow machines)."""
CPP_WRAPPER_ENV = "LLMINFER_COMPILE_CPP_WRAPPER"
"""Set to ``0`` to keep Inductor's Python wrapper on CPU (see :func:`inductor_options`)."""
SMALL_HOST_CPUS = 4
"""Hosts with at most this many CPUs compile on CPU in-process, without Inductor's pool of compile workers."""


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


def inductor_options(mode: str, cudagraphs: bool, device: torch.device, own_graphs: bool = False,
                     cpp_wrapper: bool = True) -> dict[str, Any]:
    """Inductor config patches for ``compile_mode``, the CUDA-graph toggle and, on CPU, the C++ wrapper
    (``cpp_wrapper=False`` keeps the Python one: the compiled backend passes it for a model with weight-only
    int8 / int4 layers, whose C++ wrapper took minutes to compile; see :class:`CompiledBackend`).

    ``"reduce-overhead"`` means CUDA graphs; ``"max-autotune"`` means GEMM autotuning, with CUDA graphs
    only when ``cudagraphs`` is set; ``"default"`` uses CUDA graphs only when ``cudagraphs`` is set.
    CUDA graphs are never used off CUDA, and inductor's own are off when llminfer captures whole decode
    steps itself (``own_graphs``: a graph captured inside another's capture is not allowed).
    """
    import torch._inductor

    opts = dict(torch._inductor.list_mode_options(mode))
    use_cg = device.type == "cuda" and (cudagraphs or mode == "reduce-overhead") and not own_graphs
    opts["triton.cudagraphs"] = use_cg
    if device.type == "cpu" and (os.cpu_count() or 1) <= SMALL_HOST_CPUS:
        # No pool of compile worker processes: their start-up (seconds of CPU each, importing torch) shares a
        # small host's cores with the steps after a compilation; on a 2-core VM a measured run right after
        # one decoded at 8.7 instead of ~65 tok/s. Compiling in-process costs little there.
        opts["compile_threads"] = 1
    if device.type == "cpu" and cpp_wrapper and env_flag(CPP_WRAPPER_ENV):
        # Inductor's wrapper (the code that calls each fused kernel and extern op of the graph) in C++ rather
        # than Python: a decode step of the bench model calls some hundred kernels, and their Python calls were
        # most of what the compiled step spent beyond its products (measured side by side on a 2-core Zen 4
        # VM, fp32, 64 tokens: 56.1 -> 60.8 tok/s at batch 1, 305.5 -> 334.6 at batch 8).
        opts["cpp_wrapper"] = True
    if use_cg:
        opts["graph_partition"] = True  # run the cudagraph-unsafe attention op between captured pieces
    return opts


class CountingBackend:
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


def fresh_function(fn: Callable, tag: str) -> Callable:
    """A copy of ``fn`` with its own code object, so dynamo keeps a separate compile cache for it (one per
    backend: engines in one process never share, or evict, each other's compiled graphs)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def raise_recompile_limit(needed: int) -> None:
    """Make room in dynamo's per-code-object cache for every bucket, times a few adapter / grad-mode states
    (never lowers the limit; a full cache would make dynamo run new shapes uncompiled). torch 2.13's dynamo
    config is per thread (a value set in one thread reads as the default in another), so every thread
    that compiles or runs the graph calls this first."""
    import torch._dynamo.config as dcfg

    want = max(64, 4 * needed)
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, attr) and getattr(dcfg, attr) < want:
            setattr(dcfg, attr, want)


def describe_error(exc: BaseException) -> str:
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
