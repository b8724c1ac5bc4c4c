"""LoRA adapters on a loaded transformers model, through PEFT, without reloading the base model.

Loading goes through transformers' ``model.load_adapter`` (PEFT injects LoRA wrappers around the
targeted linear layers and loads their weights). Switching, disabling and deleting act directly on PEFT's
tuner layers (``peft.tuners.tuners_utils.BaseTunerLayer``), which works across PEFT versions (transformers'
own ``set_adapter`` / ``delete_adapter`` wrappers demand a newer PEFT than some installs have).

The attention modules are not wrapped: their ``layer_idx`` and the keyword-argument path that carries
llminfer's paged-attention metadata are untouched, so adapters work with the eager and compiled backends.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from llminfer.errors import BackendUnavailableError

INSTALL_HINT = "LoRA adapters need PEFT: pip install 'llminfer[peft]'"


def require_peft() -> Any:
    """Import PEFT.

    Raises:
        BackendUnavailableError: PEFT is not installed (one line: how to install it).
    """
    import logging

    # PEFT imports bitsandbytes, which on AVX-512 BF16 CPUs logs a warning about an optional package
    # ("Failed to load CPU gemm_4bit_forward from kernels-community") that no LoRA user can act on.
    bnb_cpu = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = bnb_cpu.level
    bnb_cpu.setLevel(logging.ERROR)
    try:
        import peft
    except ImportError:
        raise BackendUnavailableError(INSTALL_HINT) from None
    finally:
        bnb_cpu.setLevel(level)
    return peft


def tuner_layers(model: torch.nn.Module) -> Iterator[Any]:
    """PEFT's tuner layers (LoRA-wrapped linears) inside ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            yield module


def load(model: torch.nn.Module, path_or_id: str, name: str, download_kwargs: dict[str, Any]) -> None:
    """Inject adapter ``name`` from ``path_or_id`` into ``model`` (its layers end up disabled or on the
    previously active adapter: call :func:`activate` next).

    Raises:
        Exception: whatever transformers / PEFT raise for a missing or mismatched adapter.
    """
    from llminfer.logging import quiet_transformers

    require_peft()
    # quiet: transformers prints a progress bar and a "load report" listing the base weights as MISSING
    # from the adapter's checkpoint (they are, and stay as loaded), which reads as if they were re-initialized
    with warnings.catch_warnings(), quiet_transformers():
        # PEFT warns that a second adapter makes "multiple adapters in the model": that is the point.
        warnings.filterwarnings("ignore", message=".*peft_config.*", category=UserWarning)
        model.load_adapter(path_or_id, adapter_name=name, adapter_kwargs=download_kwargs)
    model.eval()  # new LoRA dropout modules start in training mode


def activate(model: torch.nn.Module, name: str | None) -> None:
    """Run every tuner layer on adapter ``name``, or on the base weights alone when None (the layers
    return exactly their base layer's output then)."""
    for layer in tuner_layers(model):
        if name is None or name not in _layer_adapters(layer):
            layer.enable_adapters(False)
            continue
        layer.enable_adapters(True)
        if "inference_mode" in inspect.signature(layer.set_adapter).parameters:
            layer.set_adapter(name, inference_mode=True)
        else:  # pragma: no cover - older PEFT
            layer.set_adapter(name)


def delete(model: torch.nn.Module, name: str) -> None:
    """Remove adapter ``name``'s weights from every tuner layer and from the model's PEFT config."""
    with warnings.catch_warnings():
        # "Adapter x was active which is now deleted": the engine re-activates explicitly afterwards.
        warnings.filterwarnings("ignore", message=".*now deleted.*", category=UserWarning)
        for layer in tuner_layers(model):
            if name in _layer_adapters(layer):
                layer.delete_adapter(name)
    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict):
        configs.pop(name, None)
        if not configs and hasattr(model, "_hf_peft_config_loaded"):
            model._hf_peft_config_loaded = False


def _layer_adapters(layer: Any) -> set[str]:
    names: set[str] = set()
    for attr in getattr(layer, "adapter_layer_names", ()):
        container = getattr(layer, attr, None)
        if container is not None and hasattr(container, "keys"):
            names.update(container.keys())
    return names


class AdapterManager:
    """The LoRA adapter lifecycle of one engine: load, activate, unload, list.

    The model runs one adapter at a time and the adapter's name partitions the prefix cache (it is part
    of every block hash), so changes are refused while requests are in flight; unloading also resets the
    prefix cache (through ``reset_prefix_cache``, a message the engine sends into the core's ordered
    inbox, so that no later request can hit KV computed under the removed adapter).

    Args:
        model: the loaded transformers model.
        download_kwargs: hub arguments (token, cache folder, offline) for adapter ids.
        secrets: strings never to show in an error (the HF token).
    """

    def __init__(self, model: torch.nn.Module, download_kwargs: dict[str, Any],
                 secrets: tuple[str | None, ...] = ()) -> None:
        self.model = model
        self.download_kwargs = download_kwargs
        self.secrets = secrets
        self.adapters: dict[str, str] = {}
        self.active: str | None = None

    @classmethod
    def checked(cls, engine: Any, what: str) -> AdapterManager:
        """The engine's manager (made on first use with its hub settings), once adapters can change now.

        Raises:
            BackendUnavailableError: PEFT is not installed, or the backend has no transformers model (vLLM).
            EngineError: requests are in flight (``what`` says what was refused).
        """
        from llminfer.errors import EngineError

        engine.load()
        if engine.model is None:
            raise BackendUnavailableError(f"LoRA adapters are not available with the {engine.cfg.backend.value} "
                                          "backend in this version")
        require_peft()
        if not engine.is_idle():
            raise EngineError(f"cannot {what} while requests are in flight; wait until they finish "
                              "(adapters change the model every request runs on)")
        if engine.adapter_manager is not None:
            return engine.adapter_manager
        cfg = engine.cfg
        dl = {"token": cfg.hf_token, "cache_dir": cfg.hf_cache_dir, "local_files_only": cfg.hf_local_files_only}
        return cls(engine.model, dl, (cfg.hf_token,))

    def load(self, path_or_id: str, adapter_name: str | None = None, *, activate: bool = True) -> str:
        """Load a PEFT LoRA adapter into the model (the base model is not reloaded). Returns its name.

        Raises:
            ConfigError: a bad or already used name.
            ModelLoadError: the adapter cannot be found or does not fit the model.
        """
        import re
        from pathlib import Path

        from llminfer.errors import ConfigError, ModelLoadError, one_line

        if str(path_or_id).startswith(("/", ".", "~")) and not Path(str(path_or_id)).expanduser().exists():
            raise ModelLoadError(f"adapter folder {path_or_id!r} does not exist")
        name = adapter_name or Path(str(path_or_id).rstrip("/")).name or "default"
        if not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", name):
            raise ConfigError(f"adapter_name {name!r}: use 1-64 letters, digits, '_' or '-'")
        if name in self.adapters:
            raise ConfigError(f"an adapter named {name!r} is already loaded; unload it or choose another name")
        previous = self.active
        try:
            load(self.model, str(path_or_id), name, {k: v for k, v in self.download_kwargs.items() if v})
        except Exception as exc:  # noqa: BLE001 - PEFT/transformers raise many kinds; one clear line
            raise ModelLoadError(f"cannot load adapter {path_or_id!r}: {one_line(exc, self.secrets)}") from None
        self.adapters[name] = str(path_or_id)
        self.set(name if activate else previous)
        return name

    def set(self, adapter_name: str | None) -> None:
        """Make ``adapter_name`` active (None: the base model).

        Raises:
            ConfigError: no adapter of that name is loaded.
        """
        from llminfer.errors import ConfigError

        if adapter_name is not None and adapter_name not in self.adapters:
            raise ConfigError(f"no adapter named {adapter_name!r} is loaded (loaded: {sorted(self.adapters)})")
        activate(self.model, adapter_name)
        self.active = adapter_name

    def unload(self, adapter_name: str) -> None:
        """Remove an adapter's weights; if it was active, the base model becomes active.

        Raises:
            ConfigError: no adapter of that name is loaded.
        """
        from llminfer.errors import ConfigError

        if adapter_name not in self.adapters:
            raise ConfigError(f"no adapter named {adapter_name!r} is loaded (loaded: {sorted(self.adapters)})")
        if self.active == adapter_name:
            self.set(None)
        delete(self.model, adapter_name)
        del self.adapters[adapter_name]
        self.set(self.active)  # PEFT may pick another active adapter on deletion
