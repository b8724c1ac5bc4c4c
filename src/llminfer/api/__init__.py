"""OpenAI-compatible HTTP server on Litestar (``pip install 'llminfer[serve]'``).

``create_app(EngineConfig())`` builds the ASGI app; ``llminfer serve`` runs it with uvicorn.
"""

from llminfer.api.app import create_app
from llminfer.api.errors import APIError
from llminfer.api.server import ServerLimits, run_server, serve_in_thread

__all__ = ["APIError", "ServerLimits", "create_app", "run_server", "serve_in_thread"]
