"""The vLLM backend: vLLM's async engine owns scheduling, the KV cache and the model step.

The engine's pipeline then is ``tokenize → vllm → [user stages] → sink``: llminfer tokenizes and
validates the prompt (same tokenizer, same length checks, token ids go to vLLM as a ``TokensPrompt``),
:class:`VLLMStage` submits each request to ``AsyncLLMEngine.generate`` with
``RequestOutputKind.DELTA`` and turns every ``RequestOutput`` it yields into a :class:`DeltaBatch` the
moment it arrives (true token streaming), and the usual sink delivers it. The prefix-hash, scheduler,
step and detokenize stages are skipped: vLLM hashes, schedules, detokenizes and applies stop strings
itself (:attr:`VLLMBackend.owns_scheduling` states this capability; the engine reads it).

Everything here is written against vLLM's public API (``vllm.AsyncLLMEngine`` / ``AsyncEngineArgs`` /
``SamplingParams`` / ``RequestOutput`` / ``inputs.TokensPrompt``) and imported lazily: without vLLM
installed, choosing the backend fails at once with :data:`INSTALL_HINT`. The parameter mappings
(:func:`sampling_kwargs`, :func:`engine_args_kwargs`) are pure functions, unit-tested without vLLM.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llminfer.config import EngineConfig, QuantMode
from llminfer.errors import (
    BackendUnavailableError,
    ConfigError,
    EngineError,
    InvalidRequestError,
    LLMInferError,
    RequestAbortedError,
)
from llminfer.protocols.messages import Abort, DeltaBatch, RequestDelta, RequestFailed, TokenizedRequest
from llminfer.results import TokenLogprob
from llminfer.sampling.params import SamplingParams
from llminfer.stages.schedule import SchedulerStage
from llminfer.trace import Tracer

log = structlog.get_logger("llminfer.vllm")

INSTALL_HINT = "the vLLM backend needs vLLM: pip install 'llminfer[vllm]' (CUDA only)"


def vllm_available() -> bool:
    """True when ``import vllm`` works."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or broken (no CUDA build, ...)
        return False
    return True


def require_vllm() -> Any:
    """Import vLLM.

    Returns:
        The ``vllm`` module.

    Raises:
        BackendUnavailableError: vLLM is not installed or does not import (one line: how to install it).
    """
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001
        detail = "" if isinstance(exc, ModuleNotFoundError) else f" ({type(exc).__name__}: {str(exc)[:200]})"
        raise BackendUnavailableError(INSTALL_HINT + detail) from None
    return vllm


# ----------------------------------------------------------------------------------------------- mappings
def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """llminfer :class:`SamplingParams` → keyword arguments of ``vllm.SamplingParams`` (pure; no vLLM).

    ``top_k=0`` (off) becomes vLLM's ``-1``; stop strings go to ``stop`` and are cut from the text as in
    llminfer (``include_stop_str_in_output=False``); ``n`` is always 1 (the engine fans out samples).
    ``output_kind`` is added by the backend (``RequestOutputKind.DELTA``).

    Returns:
        A dict of vLLM ``SamplingParams`` keyword arguments.

    Raises:
        InvalidRequestError: a setting vLLM has no equivalent for (``no_repeat_ngram_size``,
            ``force_words``).
    """
    if params.no_repeat_ngram_size:
        raise InvalidRequestError("no_repeat_ngram_size is not supported by the vLLM backend")
    if params.force_words:
        raise InvalidRequestError("force_words is not supported by the vLLM backend")
    kw: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "min_tokens": params.min_new_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": float(params.min_p),
        "seed": params.seed,
        "stop": list(params.stop_sequences),
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": False,
        "ignore_eos": params.ignore_eos,
        "repetition_penalty": float(params.repetition_penalty),
        "presence_penalty": float(params.presence_penalty),
        "frequency_penalty": float(params.frequency_penalty),
        "logprobs": params.logprobs,
        "skip_special_tokens": True,
    }
    if params.bad_words:
        kw["bad_words"] = list(params.bad_words)
    return kw


def engine_args_kwargs(cfg: EngineConfig, model_path: str, max_model_len: int | None = None) -> dict[str, Any]:
    """:class:`EngineConfig` → keyword arguments of ``vllm.AsyncEngineArgs`` (pure; no vLLM; the HF token
    is never included, see :func:`build_engine`).

    ``tp_size`` / ``pp_size`` → ``tensor_parallel_size`` / ``pipeline_parallel_size``; the KV page size,
    prefix caching, batch limits and memory fraction map onto vLLM's; ``QuantMode.NF4`` → vLLM's in-flight
    bitsandbytes quantization.

    Raises:
        ConfigError: a setting vLLM cannot honour (FP4 / INT8 in-flight quantization, the contiguous KV
            layout).
    """
    if not cfg.cache.enable_paged_kv:
        raise ConfigError("cache.enable_paged_kv=False is not available with the vLLM backend (vLLM always pages)")
    kw: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tp_size,
        "pipeline_parallel_size": cfg.pp_size,
        "max_model_len": max_model_len or cfg.max_model_len,
        "block_size": cfg.cache.page_size_tokens,
        "enable_prefix_caching": cfg.cache.enable_prefix_cache,
        "gpu_memory_utilization": cfg.cache.gpu_memory_utilization,
        "max_num_seqs": cfg.max_batch_size,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "trust_remote_code": cfg.hf_trust_remote_code,
        "disable_log_stats": False,
    }
    if cfg.hf_revision:
        kw["revision"] = cfg.hf_revision
        kw["tokenizer_revision"] = cfg.hf_revision
    if cfg.hf_cache_dir:
        kw["download_dir"] = cfg.hf_cache_dir
    if cfg.cache.num_blocks is not None:
        kw["num_gpu_blocks_override"] = cfg.cache.num_blocks
    if cfg.quant.mode is QuantMode.NF4:
        kw["quantization"] = "bitsandbytes"
    elif cfg.quant.mode is not QuantMode.NONE:
        raise ConfigError(f"quant.mode {cfg.quant.mode.value} is not available with the vLLM backend "
                          "(its in-flight bitsandbytes quantization is NF4 only)")
    return {k: v for k, v in kw.items() if v is not None}


def finish_reason(vllm_reason: str | None) -> str | None:
    """vLLM's ``CompletionOutput.finish_reason`` → llminfer's (``stop``, ``length``, ``abort``, ``error``)."""
    if vllm_reason is None:
        return None
    return vllm_reason if vllm_reason in ("stop", "length", "abort") else "error"


def convert_logprobs(token_ids: list[int], entries: list[dict[int, Any]] | None, k: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-token ``{token_id: Logprob}`` dicts → :class:`TokenLogprob` (chosen token, top ``k``)."""
    if not entries:
        return ()
    out = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry.get(tok)
        lp = float(getattr(chosen, "logprob", chosen if isinstance(chosen, (int, float)) else -math.inf))
        ranked = sorted(((int(t), float(getattr(v, "logprob", v))) for t, v in entry.items()),
                        key=lambda item: -item[1])
        out.append(TokenLogprob(int(tok), lp, tuple(ranked[:k])))
    return tuple(out)


# ----------------------------------------------------------------------------------------------- backend
class VLLMBackend:
    """llminfer's handle on a vLLM async engine.

    Args:
        client: the engine (``vllm.AsyncLLMEngine`` or anything with ``generate(prompt, sampling_params,
            request_id)`` → async iterator of ``RequestOutput`` and ``async abort(request_id)``).
        make_sampling_params: builds vLLM ``SamplingParams`` from :func:`sampling_kwargs` output (the
            backend adds ``output_kind=DELTA``).
        make_prompt: builds vLLM's prompt from a list of token ids (``TokensPrompt``).
        version: the vLLM version string (for ``engine.info()``).
    """

    name = "vllm"
    owns_scheduling = True
    """Capability: vLLM schedules, caches KV and detokenizes; the engine skips those stages."""

    def __init__(self, client: Any, make_sampling_params: Callable[..., Any], make_prompt: Callable[[list[int]], Any],
                 version: str = "?") -> None:
        self.client = client
        self.make_sampling_params = make_sampling_params
        self.make_prompt = make_prompt
        self.version = version
        self.queries_tokens = 0
        self.hit_tokens = 0
        self.num_requests = 0
        self.num_running = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig, model_path: str, max_model_len: int | None) -> VLLMBackend:
        """Start vLLM's async engine for ``cfg`` (see :func:`build_engine`).

        Raises:
            BackendUnavailableError: vLLM is not installed.
            ConfigError: a setting vLLM cannot honour.
        """
        vllm = require_vllm()
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        client = build_engine(cfg, model_path, max_model_len)

        def make_params(**kw: Any) -> Any:
            return vllm.SamplingParams(**kw, output_kind=RequestOutputKind.DELTA)

        return cls(client, make_params, lambda ids: TokensPrompt(prompt_token_ids=ids),
                   getattr(vllm, "__version__", "?"))

    async def generate(self, request: TokenizedRequest) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas as vLLM produces them.

        Raises:
            InvalidRequestError: a sampling setting vLLM cannot honour.
        """
        params = self.make_sampling_params(**sampling_kwargs(request.params))
        prompt = self.make_prompt(list(request.prompt_token_ids))
        k = request.params.logprobs or 0
        counted = False
        self.num_running += 1
        try:
            async for out in self.client.generate(prompt, params, request.request_id):
                comp = out.outputs[0]
                cached = int(getattr(out, "num_cached_tokens", None) or 0)
                if not counted:
                    counted = True
                    self.num_requests += 1
                    self.queries_tokens += len(request.prompt_token_ids)
                    self.hit_tokens += cached
                ids = tuple(int(t) for t in comp.token_ids)
                reason = finish_reason(comp.finish_reason) if out.finished else None
                if out.finished and reason is None:
                    reason = "stop"
                error = RequestAbortedError("request aborted by vLLM") if reason == "abort" else None
                if reason == "error":
                    error = EngineError(f"vLLM finished the request with {comp.finish_reason!r}")
                yield RequestDelta(
                    request_id=request.request_id, text=comp.text, token_ids=ids, finish_reason=reason, error=error,
                    prompt_tokens=len(request.prompt_token_ids), cached_tokens=cached, time_ns=time.perf_counter_ns(),
                    logprobs=convert_logprobs(list(ids), comp.logprobs, k) if request.params.logprobs is not None else (),
                )
                if out.finished:
                    return
        finally:
            self.num_running -= 1

    async def abort(self, request_id: str) -> None:
        """Abort a request inside vLLM (a no-op for an unknown or finished one)."""
        await self.client.abort(request_id)

    def cache_stats(self) -> dict[str, Any]:
        """Prefix-cache statistics from vLLM: per request, vLLM reports the prompt tokens it served from its
        prefix cache (``RequestOutput.num_cached_tokens``); ``hit_rate`` = cached / prompt tokens."""
        q = self.queries_tokens
        return {"hit_rate": self.hit_tokens / q if q else 0.0, "queries": q, "hits": self.hit_tokens,
                "cached_tokens": self.hit_tokens, "requests": self.num_requests, "source": "vllm"}

    def info(self) -> dict[str, Any]:
        """Facts vLLM knows after start-up (version, KV blocks when it exposes them)."""
        facts: dict[str, Any] = {"vllm": self.version}
        cache_cfg = getattr(getattr(self.client, "vllm_config", None), "cache_config", None)
        if cache_cfg is not None:
            facts["kv_blocks"] = getattr(cache_cfg, "num_gpu_blocks", None)
            facts["kv_block_size"] = getattr(cache_cfg, "block_size", None)
        return facts


def build_engine(cfg: EngineConfig, model_path: str, max_model_len: int | None) -> Any:
    """Create ``vllm.AsyncLLMEngine`` from :func:`engine_args_kwargs`; the HF token goes in as the
    ``hf_token`` engine argument where vLLM has it, else as ``HF_TOKEN`` in this process's environment
    (vLLM's workers inherit it); it is never logged.

    Raises:
        BackendUnavailableError: vLLM is missing, or cannot start here (no GPU, ...), one line.
    """
    vllm = require_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw = engine_args_kwargs(cfg, model_path, max_model_len)
    if cfg.hf_token:
        if "hf_token" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
            kw["hf_token"] = cfg.hf_token
        else:
            os.environ.setdefault("HF_TOKEN", cfg.hf_token)
    log.info("starting vLLM", **{k: v for k, v in kw.items() if k != "hf_token"})
    try:
        return vllm.AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**kw))
    except Exception as exc:  # noqa: BLE001 - one clear line, the token scrubbed
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        if cfg.hf_token:
            text = text.replace(cfg.hf_token, "***")
        raise BackendUnavailableError(f"vLLM could not start: {text}") from None


# ----------------------------------------------------------------------------------------------- stages
class VLLMStage(SchedulerStage):
    """Takes the scheduler's place in the pipeline (it is one, to the pipeline: it receives the aborts on
    the control channel) and streams each request through :class:`VLLMBackend`.

    Input: :class:`TokenizedRequest` / :class:`RequestFailed`; output: one :class:`DeltaBatch` per vLLM
    output. Aborts (client disconnects, cancels) cancel the request's stream, which aborts it in vLLM.
    On shutdown the inbox closes and in-flight requests finish first.
    """

    name = "vllm"

    def __init__(self, backend: VLLMBackend, tracer: Tracer | None = None) -> None:
        # Deliberately not SchedulerStage.__init__: no llminfer scheduler or KV pool here.
        self.backend = backend
        self.tracer = tracer or Tracer(enabled=False)
        self.step_outbox = None
        self.step_inbox = None
        self.control = None
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._aborted: set[str] = set()
        self._steps = 0

    async def _send(self, outbox: ObjectSendStream[Any], delta: RequestDelta) -> None:
        self._steps += 1
        await outbox.send(DeltaBatch(self._steps, (delta,), delta.time_ns or time.perf_counter_ns()))

    async def _serve(self, req: TokenizedRequest, outbox: ObjectSendStream[Any]) -> None:
        scope = self._scopes[req.request_id]
        finished = False
        try:
            with scope:
                self.tracer.record(req.request_id, self.name, "queued", len(req.prompt_token_ids))
                async for delta in self.backend.generate(req):
                    await self._send(outbox, delta)
                    finished = delta.finished
                if not finished:
                    await self._send(outbox, RequestDelta(req.request_id, "", (), finish_reason="error",
                                                          error=EngineError("vLLM ended the stream early")))
                    finished = True
        except LLMInferError as exc:
            await self._send(outbox, RequestDelta(req.request_id, "", (), finish_reason="error", error=exc))
            finished = True
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the stage
            await self._send(outbox, RequestDelta(req.request_id, "", (), finish_reason="error",
                                                  error=EngineError(f"vLLM: {type(exc).__name__}: {exc}")))
            finished = True
        finally:
            self._scopes.pop(req.request_id, None)
        if not finished and req.request_id in self._aborted:
            self._aborted.discard(req.request_id)
            with anyio.CancelScope(shield=True):
                try:
                    await self.backend.abort(req.request_id)
                except Exception:  # noqa: BLE001 - already gone
                    pass
                await self._send(outbox, RequestDelta(req.request_id, "", (), finish_reason="abort",
                                                      error=RequestAbortedError("request cancelled")))

    async def _watch_control(self) -> None:
        if self.control is None:
            return
        async for msg in self.control:
            if isinstance(msg, Abort):
                scope = self._scopes.get(msg.request_id)
                if scope is not None:
                    self._aborted.add(msg.request_id)
                    scope.cancel()

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        step_outbox = self.step_outbox
        async with outbox:
            async with anyio.create_task_group() as control_tg:
                control_tg.start_soon(self._watch_control)
                async with anyio.create_task_group() as requests_tg:
                    async for msg in inbox:
                        if isinstance(msg, TokenizedRequest):
                            self._scopes[msg.request_id] = anyio.CancelScope()
                            requests_tg.start_soon(self._serve, msg, outbox)
                        elif isinstance(msg, RequestFailed):
                            await self._send(outbox, RequestDelta(msg.request_id, "", (), finish_reason="error",
                                                                  error=msg.error))
                        else:
                            await outbox.send(msg)
                control_tg.cancel_scope.cancel()
            if step_outbox is not None:
                await step_outbox.aclose()


class IdleStepStage:
    """The pipeline's step slot when the backend owns scheduling: never receives a plan."""

    name = "step"

    async def run(self, inbox: ObjectReceiveStream[Any], outbox: ObjectSendStream[Any]) -> None:
        async with outbox:
            async for _ in inbox:
                pass
