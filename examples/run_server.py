"""Serve the OpenAI-compatible API from Python (what ``llminfer serve`` does).

    python examples/run_server.py                         # built-in tiny model on http://127.0.0.1:8000
    python examples/run_server.py --port 8001 --api-key sk-local
    python examples/run_server.py --model Qwen/Qwen2.5-0.5B-Instruct

Then point any OpenAI client at http://127.0.0.1:8000/v1 (see examples/openai_api_client.py).
"""

from __future__ import annotations

import argparse

from llminfer import EngineConfig
from llminfer.api import create_app, run_server
from llminfer.logging import configure_logging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face model id or folder (default: built-in tiny model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-queue-size", type=int, default=1024)
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1")
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args()

    configure_logging("info")  # one structured log line per request
    cfg = EngineConfig(model_name=args.model, max_batch_size=args.max_batch_size)
    app = create_app(cfg, served_model_name=args.served_model_name, api_key=args.api_key,
                     max_queue_size=args.max_queue_size)
    run_server(app, host=args.host, port=args.port)  # the model loads in the app's startup


if __name__ == "__main__":
    main()
