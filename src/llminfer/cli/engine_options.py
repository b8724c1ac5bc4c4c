"""The engine flags of ``run``, ``stream``, ``chat``, ``info``, ``serve``, ``bench`` and ``compare``, declared once.

:class:`EngineOptions` declares every engine flag: one attrs field each, whose type carries its Typer option
(name, help; the types are :mod:`llminfer.cli.options`'). :func:`engine_options` puts those flags into a
command's signature in place of its one ``engine_opts: EngineOptions`` parameter (a command leaves out the
flags it does not offer with ``exclude``), and :meth:`EngineOptions.to_config` is the one place they become an
:class:`~llminfer.config.EngineConfig` (through :func:`~llminfer.cli.options.build_config`, so a bad value
is ``--flag: message`` before the model loads).

A new engine flag needs one field here (its default the ``EngineConfig`` default) and, when its field name
is not a :func:`~llminfer.cli.options.build_config` keyword or ``EngineConfig`` field, an entry in
:data:`CONFIG_NAMES`; every command that takes ``engine_opts`` then shows and forwards it.

Nothing here imports torch: ``--help`` and every flag error answer at once.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import attrs

from llminfer.cli.option_group import option_group
from llminfer.cli.options import (
    QUANT_AUTO,
    AdapterName,
    AdapterOpt,
    Assistant,
    AttnBackend,
    BackendOpt,
    BatchSize,
    CacheDir,
    CompileMode,
    Device,
    Dtype,
    HFToken,
    Int4Head,
    KVBytes,
    LocalOnly,
    LogLevel,
    LongPrefill,
    MaxBatchedTokens,
    MaxLen,
    Model,
    NoPrefix,
    PageSize,
    PPSize,
    QuantOpt,
    Revision,
    SpecC,
    SpecK,
    SpecLookupMax,
    SpecLookupMin,
    SpecMethod,
    Threads,
    TPSize,
    TrustRemote,
    auto_quant,
    build_config,
    check_engine_flags,
)
from llminfer.config import Backend

if typing.TYPE_CHECKING:
    from llminfer.config import EngineConfig


@attrs.frozen(kw_only=True)
class EngineOptions:
    """Every engine flag as given on the command line (see the module docstring for how one is added).

    Fields are named like :func:`~llminfer.cli.options.build_config`'s keywords (or, through
    :data:`CONFIG_NAMES`, ``EngineConfig`` fields); ``log_level``, ``adapter`` and ``adapter_name`` are not
    config fields: :func:`~llminfer.cli.options.load_engine` takes them. Values are checked by
    :meth:`to_config`, not here.
    """

    model: Model = None
    backend: BackendOpt = Backend.EAGER
    dtype: Dtype = "auto"
    device: Device = "auto"
    max_batch_size: BatchSize = 16
    page_size: PageSize = 16
    no_prefix_cache: NoPrefix = False
    kv_cache_bytes: KVBytes = None
    max_model_len: MaxLen = None
    revision: Revision = None
    hf_token: HFToken = None
    local_files_only: LocalOnly = False
    cache_dir: CacheDir = None
    trust_remote_code: TrustRemote = False
    tp_size: TPSize = 1
    pp_size: PPSize = 1
    quant: QuantOpt = QUANT_AUTO
    int4_lm_head: Int4Head = "int8"
    adapter: AdapterOpt = None
    adapter_name: AdapterName = None
    compile_mode: CompileMode = "default"
    attention_backend: AttnBackend = "auto"
    threads: Threads = None
    max_num_batched_tokens: MaxBatchedTokens = None
    long_prefill_token_threshold: LongPrefill = 0
    assistant_model: Assistant = None
    spec_num_assistant_tokens: SpecK = 5
    spec_confidence_threshold: SpecC = 0.4
    spec_method: SpecMethod = None
    spec_prompt_lookup_max: SpecLookupMax = 4
    spec_prompt_lookup_min: SpecLookupMin = 2
    log_level: LogLevel = "warning"

    def to_config(self, *, check: bool = True, **overrides: Any) -> EngineConfig:
        """The validated :class:`EngineConfig` these flags describe.

        Args:
            check: first give a missing ``--model`` the default model
                (:func:`~llminfer.models.trained.default_model`) and run
                :func:`~llminfer.cli.options.check_engine_flags` (``--device``'s form, a ``--model`` path,
                ``--log-level``, ``--adapter-name`` alone). ``bench`` and ``compare`` pass False: they keep
                ``EngineConfig``'s built-in model and check ``--log-level`` themselves.
            overrides: field values this command decides itself (``max_batch_size=4``), or further
                ``EngineConfig`` fields (``served_model_name=...``), by field name.

        Raises:
            typer.BadParameter: a value out of range, as ``--flag: message``.
        """
        model = self.model
        if check:
            from llminfer.models.trained import default_model

            model = model or default_model()
            check_engine_flags(model=model, device=self.device, log_level=self.log_level, adapter=self.adapter,
                               adapter_name=self.adapter_name)
        values = {CONFIG_NAMES.get(a.name, a.name): getattr(self, a.name) for a in attrs.fields(EngineOptions)
                  if a.name not in _NOT_CONFIG}
        values["model"] = model
        if str(self.quant).lower() == QUANT_AUTO:  # here, where --adapter is known (it is no config field)
            values["quant"] = auto_quant(model, device=self.device, dtype=self.dtype, backend=self.backend,
                                         adapter=self.adapter)
        values.update({CONFIG_NAMES.get(k, k): v for k, v in overrides.items()})
        return build_config(**values)


CONFIG_NAMES: dict[str, str] = {
    "spec_method": "speculative_method",
    "spec_prompt_lookup_max": "speculative_prompt_lookup_max",
    "spec_prompt_lookup_min": "speculative_prompt_lookup_min",
}
""":class:`EngineOptions` field → the ``EngineConfig`` field it sets, where ``build_config`` has no keyword
of that name."""

_NOT_CONFIG = frozenset({"log_level", "adapter", "adapter_name"})


def engine_options(*, exclude: tuple[str, ...] = (), **defaults: Any) -> Callable:
    """Decorator: replace a command's ``engine_opts: EngineOptions`` parameter by one Typer option per
    :class:`EngineOptions` field not in ``exclude`` (:func:`llminfer.cli.option_group.option_group`).

    Args:
        exclude: flags this command does not offer (their fields keep the default, or ``defaults``' value).
        defaults: per-command defaults, e.g. ``log_level="info"``.

    Raises:
        TypeError: (at import) as :func:`~llminfer.cli.option_group.option_group`.
    """
    return option_group(EngineOptions, "engine_opts", exclude=exclude, **defaults)


#: the speculative-decoding flags (only ``run`` and ``stream`` offer them)
SPEC_FLAGS = ("assistant_model", "spec_num_assistant_tokens", "spec_confidence_threshold", "spec_method",
              "spec_prompt_lookup_max", "spec_prompt_lookup_min")
