"""OpenAI-compatible HTTP server on Litestar (``pip install 'llminfer[serve]'``).

``create_app(EngineConfig())`` builds the ASGI app; ``llminfer serve`` runs it with uvicorn. The names are
loaded on first use, so importing a submodule (``llminfer.api.protocol``, the request schema) does not load
the engine and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llminfer.api.app import create_app
    from llminfer.api.errors import APIError
    from llminfer.api.server import ServerLimits, run_server, serve_in_thread

__all__ = ["APIError", "ServerLimits", "create_app", "run_server", "serve_in_thread"]

_LAZY = {"create_app": "llminfer.api.app", "APIError": "llminfer.api.errors", "ServerLimits": "llminfer.api.server",
         "run_server": "llminfer.api.server", "serve_in_thread": "llminfer.api.server"}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llminfer.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value
