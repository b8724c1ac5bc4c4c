"""The backend registry: the one place that says what each backend is, how it is built, which engine core
drives it, and what it can do.

Adding a backend is: write its module (a :class:`~llminfer.backends.base.StepBackend` subclass, or an
engine of its own with its own core), add a :class:`Backend` member, and register a :class:`BackendSpec`
for it in :data:`BACKENDS`. Everything that differs between backends (loading, the core, the threads it
steps on, which settings apply to it) is read from the spec, never from an ``if backend is ...`` branch.

The builders are named as ``"module:qualified.name"`` and imported when a backend is built, as vLLM's
attention-backend registry names its classes: choosing the eager backend never imports vLLM's adapter or
registers the compiled backend's custom op, and this module (which :mod:`llminfer.config` reads for
:meth:`~llminfer.config.EngineConfig.validate`) imports no backend.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from typing import Any, Literal

import attrs


class Backend(str, enum.Enum):
    """Which backend runs the model step (:func:`backend_spec` says what each one is)."""

    EAGER = "eager"  #: Hugging Face transformers model, llminfer's paged KV cache and scheduler.
    COMPILED = "compiled"  #: The eager step under ``torch.compile``.
    VLLM = "vllm"  #: vLLM's engine (owns its own scheduling and KV cache).


def resolve(qualname: str) -> Any:
    """The object named ``"package.module:Name.attr"`` (imported now).

    Raises:
        ImportError, AttributeError: no such module or name.
    """
    module, _, name = qualname.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@attrs.frozen
class BackendSpec:
    """What llminfer knows about one backend.

    Attributes:
        backend: its :class:`Backend` member.
        title: its name in messages ("the vLLM backend").
        summary: one line for ``--help`` and docs.
        builder: ``"module:name"`` of ``build(runtime, cfg) -> backend``, called once per engine after the
            runtime has loaded (:func:`llminfer.assembly.build_backend`).
        core: ``"module:name"`` of ``core(runtime, cfg, backend, tracer, stat_loggers, model_thread) ->``
            :class:`~llminfer.protocols.EngineCore`, called for every pipeline.
        availability: ``"module:name"`` of a check run before anything loads (raises
            :class:`~llminfer.errors.BackendUnavailableError` with how to install what is missing), or None.
        external_engine: the backend is an engine of its own (vLLM) that loads the model, owns the KV
            cache and schedules in its own processes: llminfer then loads the tokenizer and config only,
            allocates no KV pool, and steps on no model thread of its own.
        multi_device: takes ``tp_size`` / ``pp_size`` > 1.
        speculative: runs speculative decoding (an assistant model, or prompt lookup).
        cpu_fast_path: on CPU, llminfer's own linear and attention kernels apply, and ``dtype="auto"`` may
            be settled by measuring both candidates (:mod:`llminfer.models.dtype_probe`).
        cpu_lm_head: how the LM head runs on that CPU path: ``"prepacked"`` (oneDNN-prepacked at load,
            ``cpu_prepack_lm_head``), ``"kernel"`` (llminfer's kernel; the backend adds its own prepacked
            copy for larger batches), or None.
        compiles: the first step of each shape compiles (seconds to minutes: progress output says so).
    """

    backend: Backend
    title: str
    summary: str
    builder: str
    core: str
    availability: str | None = None
    external_engine: bool = False
    multi_device: bool = False
    speculative: bool = False
    cpu_fast_path: bool = False
    cpu_lm_head: Literal["prepacked", "kernel"] | None = None
    compiles: bool = False

    @property
    def needs_kv_manager(self) -> bool:
        """Whether llminfer allocates the paged KV pool and schedules on it (not for an external engine)."""
        return not self.external_engine

    @property
    def build(self) -> Callable[..., Any]:
        """The backend builder (imported now)."""
        return resolve(self.builder)

    @property
    def build_core(self) -> Callable[..., Any]:
        """The engine-core builder (imported now)."""
        return resolve(self.core)

    def check_available(self) -> None:
        """Run :attr:`availability` (nothing when None).

        Raises:
            BackendUnavailableError: the backend cannot run here.
        """
        if self.availability is not None:
            resolve(self.availability)()


#: llminfer's own engine core: the scheduler on the runtime's KV pool, stepping the backend.
SCHEDULED_CORE = "llminfer.assembly:scheduled_core"

BACKENDS: dict[Backend, BackendSpec] = {
    spec.backend: spec
    for spec in (
        BackendSpec(Backend.EAGER, "eager", "Hugging Face transformers model on llminfer's paged KV cache and scheduler",
                    builder="llminfer.backends.hf:build_eager", core=SCHEDULED_CORE, speculative=True,
                    cpu_fast_path=True, cpu_lm_head="prepacked"),
        BackendSpec(Backend.COMPILED, "compiled", "the eager step under torch.compile",
                    builder="llminfer.backends.compiled:CompiledBackend.from_runtime", core=SCHEDULED_CORE,
                    cpu_fast_path=True, cpu_lm_head="kernel", compiles=True),
        BackendSpec(Backend.VLLM, "vLLM", "vLLM's engine: its own scheduling, KV cache and model step",
                    builder="llminfer.backends.vllm:VLLMBackend.from_runtime",
                    core="llminfer.backends.vllm:VLLMEngineCore.from_runtime",
                    availability="llminfer.backends.vllm:require_vllm", external_engine=True, multi_device=True),
    )
}


def backend_spec(backend: Backend | str) -> BackendSpec:
    """The spec of ``backend`` (a member or its value).

    Raises:
        ValueError: no such backend.
    """
    return BACKENDS[Backend(backend)]


def backends_with(flag: str) -> list[str]:
    """The names (:class:`Backend` values) of the backends whose spec has ``flag`` set."""
    return [b.value for b, spec in BACKENDS.items() if getattr(spec, flag)]


def titles_with(flag: str) -> str:
    """The titles of the backends whose spec has ``flag`` set, for messages: ``"eager and compiled"``."""
    return " and ".join(spec.title for spec in BACKENDS.values() if getattr(spec, flag))
