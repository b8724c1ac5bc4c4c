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
    try:
        import peft
    except ImportError:
        raise BackendUnavailableError(INSTALL_HINT) from None
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
    require_peft()
    with warnings.catch_warnings():
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
