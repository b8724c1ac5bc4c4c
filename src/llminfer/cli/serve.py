"""``llminfer serve``: the OpenAI-compatible HTTP API (:mod:`llminfer.api`) on uvicorn, with its API key,
its connection limits and, for the compiled backend, a compile of every step shape before the first request.

The command is plain; :mod:`llminfer.cli` registers it on the Typer app. Every flag, the API key and the port
are checked before the model loads (typer.BadParameter, ConfigError); BackendUnavailableError without the
serve extra.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from llminfer.cli.engine_options import SPEC_FLAGS, EngineOptions, engine_options
from llminfer.cli.options import load_engine

FORCED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a process a second Ctrl-C ended


@engine_options(exclude=SPEC_FLAGS, log_level="info")
def serve(
    engine_opts: EngineOptions = EngineOptions(log_level="info"),
    host: Annotated[str, typer.Option("--host", help="Address to bind (default: loopback only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.", min=0, max=65535)] = 8000,
    batch_timeout_ms: Annotated[float, typer.Option("--batch-timeout-ms", help="How long the scheduler waits "
                                                    "to fill a batch (ms).")] = 5.0,
    max_queue_size: Annotated[int, typer.Option("--max-queue-size", min=0, help="Requests accepted beyond the "
                                                "running batch; more get HTTP 429 with Retry-After.")] = 1024,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="LLMINFER_API_KEY", help="Require "
                                                "`Authorization: Bearer KEY` on /v1 (env LLMINFER_API_KEY).")] = None,
    api_key_file: Annotated[str | None, typer.Option("--api-key-file", help="Read the API key from this file "
                                                     "(kept out of the process list).")] = None,
    read_timeout_s: Annotated[float, typer.Option("--read-timeout-s", min=0.001, help="Seconds a client has "
                                                  "to send a whole request; then its connection is closed.")] = 30.0,
    keep_alive_timeout_s: Annotated[float, typer.Option("--keep-alive-timeout-s", min=0.001, help="Seconds an "
                                                        "idle kept-alive connection stays open.")] = 5.0,
    limit_concurrency: Annotated[int | None, typer.Option("--limit-concurrency", min=1, help="HTTP requests "
                                                          "handled at once; more get HTTP 503 (default: "
                                                          "max-batch-size + max-queue-size + 64).")] = None,
    shutdown_grace_s: Annotated[float, typer.Option("--shutdown-grace-s", min=0, help="On SIGTERM/Ctrl-C, "
                                                    "seconds in-flight requests get to finish; remaining streams "
                                                    "then end with an error event.")] = 10.0,
    max_prompt_chars: Annotated[int | None, typer.Option("--max-prompt-chars", min=1, help="Refuse longer "
                                                         "prompt text before tokenizing (default: context "
                                                         "length x the longest token).")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="Model id clients see "
                                                          "(default: the model id).")] = None,
    compile_warmup: Annotated[bool, typer.Option("--compile-warmup/--no-compile-warmup", help="With --backend "
                              "compiled: compile every step shape before accepting requests, so no client waits "
                              "for a compile.")] = True,
    reject_unknown_fields: Annotated[bool, typer.Option(
        "--reject-unknown-fields", help="Answer request fields the API does not define with HTTP 400 naming "
        "them (default: ignore them and log a warning, as vLLM does).")] = False,
    sse_keepalive_s: Annotated[float, typer.Option("--sse-keepalive-s", min=0.0, help="Send an SSE comment "
                               "(': keep-alive') on a stream quiet for this many seconds, so idle-timeout proxies "
                               "keep it open; 0 disables.")] = 15.0,
) -> None:
    """Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models,
    /health, /healthz, /metrics) with uvicorn until Ctrl-C."""
    cfg = engine_opts.to_config(batch_timeout_ms=batch_timeout_ms, served_model_name=served_model_name)
    try:  # the server stack (litestar, and the engine with torch) only once the cheap checks passed
        from llminfer.api import create_app, run_server
        from llminfer.api.server import ServerLimits, bind_socket
    except ImportError as exc:  # pragma: no cover - the serve extra is missing
        from llminfer.errors import BackendUnavailableError

        raise BackendUnavailableError(f"the server needs: pip install 'llminfer[serve]' ({exc})") from None
    key = _api_key(api_key, api_key_file)
    try:  # the port first: a port in use is an error at once, not after the model has loaded
        sock = bind_socket(host, port)
    except OSError as exc:
        from llminfer.errors import ConfigError

        raise ConfigError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}"
                          f"{' (another server runs there? pick another --port)' if exc.errno == 98 else ''}") from None
    with sock:
        engine = load_engine(cfg, engine_opts.log_level, engine_opts.adapter, engine_opts.adapter_name)
        if compile_warmup and hasattr(engine.backend, "warmup"):  # the compiled backend
            warm_up(engine)
        compiler = getattr(getattr(engine, "runtime", None), "grammar_compiler", None)
        if compiler is not None:
            # Listen (and answer /health) only once structured output's compile process has started: it takes
            # seconds of a core, which the first requests would otherwise share with it.
            compiler.wait_ready(GRAMMAR_READY_TIMEOUT_S)
        asgi_app = create_app(engine, api_key=key, max_queue_size=max_queue_size,
                              max_prompt_chars=max_prompt_chars, reject_unknown_fields=reject_unknown_fields,
                              sse_keepalive_s=sse_keepalive_s or None)
        limits = ServerLimits(read_timeout_s=read_timeout_s, keep_alive_timeout_s=keep_alive_timeout_s,
                              limit_concurrency=limit_concurrency or engine_opts.max_batch_size + max_queue_size + 64,
                              shutdown_grace_s=shutdown_grace_s)
        bound = sock.getsockname()[1]
        where = f"[{host}]" if ":" in host else host
        def listening() -> None:
            typer.echo(f"serving {cfg.served_model_name or cfg.model_name} at http://{where}:{bound}/v1 (Ctrl-C stops)",
                       err=True)

        try:
            forced = run_server(asgi_app, host=host, port=port, log_level=engine_opts.log_level, limits=limits,
                                sock=sock, on_listening=listening)
        finally:
            engine.close()  # vLLM's engine processes exit with the server, not at interpreter teardown
    if forced:
        from llminfer.cli import click_exc  # typer's own copy of click where it has one

        forced_exit = click_exc.ClickException("forced shutdown (a second Ctrl-C): requests still running were "
                                               "ended")
        forced_exit.exit_code = FORCED_EXIT_CODE
        raise forced_exit


#: The longest ``serve`` waits for structured output's compile process before it listens anyway.
GRAMMAR_READY_TIMEOUT_S = 60.0


def warm_up(engine) -> int:
    """Compile the compiled backend's graph for every step shape before serving (a status line on a
    terminal; one stderr line with the count and the seconds after). Returns the graphs compiled."""
    import time

    from llminfer.logging import status

    start = time.perf_counter()
    message = "compiling the model step for every batch shape (warm-up before serving) ..."
    if not sys.stderr.isatty():  # no status line to show: say it once, since it takes minutes
        typer.echo(message, err=True)
    with status(message):
        count = engine.warmup()
    typer.echo(f"compiled {count} graph(s) in {time.perf_counter() - start:.1f} s before serving", err=True)
    return count


def _api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from ``--api-key``, ``LLMINFER_API_KEY`` or ``--api-key-file`` (its text, without the
    surrounding whitespace), checked before the model loads.

    Raises:
        typer.BadParameter: both flags given, an unreadable file, or an empty or blank key (an empty one
            would silently switch authentication off).
    """
    from llminfer.api.app import check_api_key

    if api_key is not None and api_key_file is not None:
        raise typer.BadParameter("give --api-key (or LLMINFER_API_KEY) or --api-key-file, not both")
    source = "LLMINFER_API_KEY" if api_key is not None and os.environ.get("LLMINFER_API_KEY") == api_key else "--api-key"
    if api_key_file is not None:
        source = f"--api-key-file {api_key_file}"
        try:
            with open(api_key_file, encoding="utf-8") as f:
                api_key = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise typer.BadParameter(f"--api-key-file: cannot read {api_key_file!r}: {exc}") from None
    elif api_key is None and "LLMINFER_API_KEY" in os.environ:
        # The CLI library treats an empty variable as unset; here that would mean no authentication.
        api_key, source = os.environ["LLMINFER_API_KEY"], "LLMINFER_API_KEY"
    try:
        check_api_key(api_key)
    except ValueError as exc:
        raise typer.BadParameter(f"{source}: {exc}") from None
    return api_key
