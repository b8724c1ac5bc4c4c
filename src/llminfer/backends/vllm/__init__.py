"""The vLLM backend: vLLM's async engine owns scheduling, the KV cache and the model step.

:class:`VLLMEngineCore` is a second implementation of the :class:`~llminfer.protocols.EngineCore`
protocol, in the same pipeline slot as llminfer's own core: ``tokenize → vllm core → detokenize →
[user stages] → sink``. llminfer tokenizes and validates the prompt (same tokenizer, same length checks,
token ids go to vLLM as a ``TokensPrompt``); the core submits each request to ``AsyncLLMEngine.generate``
with ``RequestOutputKind.DELTA`` and turns every ``RequestOutput`` it yields into a :class:`DeltaBatch`
the moment it arrives (true token streaming). vLLM detokenizes and applies stop strings itself, so the
detokenize stage passes those batches on untouched.

Everything here is written against vLLM's public API (``vllm.AsyncLLMEngine`` / ``AsyncEngineArgs`` /
``SamplingParams`` / ``RequestOutput`` / ``inputs.TokensPrompt``) and imported lazily: without vLLM
installed, choosing the backend fails at once with :data:`INSTALL_HINT`. The parameter mappings
(:func:`sampling_kwargs`, :func:`engine_args_kwargs`) are pure functions, unit-tested without vLLM.
"""

from llminfer.backends.vllm.core import VLLMEngineCore
from llminfer.backends.vllm.engine_args import (
    DEFAULT_PAGE_SIZE,
    build_engine,
    check_cpu_head_size,
    cpu_kv_cache_bytes,
    cpu_threads_bind,
    engine_args_kwargs,
    resolve_block_size,
)
from llminfer.backends.vllm.handle import VLLMBackend, vllm_metrics
from llminfer.backends.vllm.install import (
    INSTALL_HINT,
    on_cpu,
    require_vllm,
    supported_block_sizes,
    vllm_available,
    vllm_build,
)
from llminfer.backends.vllm.mapping import (
    convert_logprobs,
    finish_reason,
    sampling_kwargs,
    structured_outputs_param,
)

__all__ = [
    "DEFAULT_PAGE_SIZE", "INSTALL_HINT", "VLLMBackend", "VLLMEngineCore", "build_engine", "check_cpu_head_size",
    "convert_logprobs", "cpu_kv_cache_bytes", "cpu_threads_bind", "engine_args_kwargs", "finish_reason", "on_cpu",
    "require_vllm", "resolve_block_size", "sampling_kwargs", "structured_outputs_param", "supported_block_sizes",
    "vllm_available", "vllm_build", "vllm_metrics",
]
