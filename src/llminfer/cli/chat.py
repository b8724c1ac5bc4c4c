"""``llminfer chat``: an interactive multi-turn loop through the model's chat template (the reply streams
back; the conversation carries over, so the prefix cache reuses its KV).

The command is plain; :mod:`llminfer.cli` registers it on the Typer app. Every flag is checked before the
model loads (typer.BadParameter, ConfigError, InvalidRequestError); a model without a chat template is a
``--model`` error once loaded.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from llminfer.cli.engine_options import SPEC_FLAGS, EngineOptions, engine_options
from llminfer.cli.generate import stats_line
from llminfer.cli.options import SystemOpt, load_engine
from llminfer.cli.sampling import SamplingOptions, request_kwargs, sampling_options

if TYPE_CHECKING:
    from llminfer.sampling.params import SamplingParams

CHAT_HELP = "/exit (or Ctrl-D) quits, /reset forgets the conversation, Ctrl-C stops a reply"


@engine_options(exclude=("max_batch_size", "no_prefix_cache", "tp_size", "pp_size", "compile_mode", *SPEC_FLAGS),
                max_batch_size=4)
@sampling_options(exclude=("n", "logprobs"), max_new_tokens=512)
def chat(
    engine_opts: EngineOptions = EngineOptions(max_batch_size=4),
    sampling: SamplingOptions = SamplingOptions(max_new_tokens=512), system: SystemOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Print a stats line after each reply.")] = False,
) -> None:
    """Chat interactively: each line you type is a user message, the reply streams back through the model's
    chat template, and the conversation carries over (multi-turn; the prefix cache reuses its KV). /exit or
    Ctrl-D quits, /reset starts over, Ctrl-C stops a reply (and quits at the prompt)."""
    cfg = engine_opts.to_config()
    model = cfg.model_name
    params = sampling.to_params()
    interactive = sys.stdin.isatty()
    with load_engine(cfg, engine_opts.log_level, engine_opts.adapter, engine_opts.adapter_name) as engine:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise typer.BadParameter(f"--model: {model!r} has no chat template, which chat needs (use run --no-chat)")
        if interactive:
            typer.echo(f"llminfer chat with {model}: {CHAT_HELP}", err=True)
        chat_loop(engine, params, system=system, interactive=interactive, verbose=verbose)


def chat_loop(engine, params: SamplingParams, *, system: str | None = None, interactive: bool = False,
              verbose: bool = False, read_line=None) -> list[dict[str, str]]:
    """``llminfer chat``'s loop on a loaded engine: read a line, stream the reply to stdout, remember both.

    Args:
        params: how every reply is sampled (:meth:`~llminfer.cli.sampling.SamplingOptions.to_params`).
        system: a system message before the conversation.
        interactive: show a ``>>>`` prompt (a terminal); otherwise read lines silently (a pipe).
        verbose: a stats line after each reply.
        read_line: a callable returning the next line, raising EOFError at the end (default: stdin).

    Returns:
        The conversation when the loop ends (``/exit``, ``/quit``, end of input, Ctrl-C at the prompt).
        A request error (e.g. a conversation longer than the context) prints one ``error:`` line on stderr
        and drops that turn; Ctrl-C during a reply stops it and keeps the text so far.
    """
    from llminfer.chat import ChatRenderer
    from llminfer.errors import InvalidRequestError, LLMInferError

    if read_line is None:
        def read_line() -> str:
            if interactive:
                return input(">>> ")
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line

    base = [{"role": "system", "content": system}] if system is not None else []
    messages = list(base)
    renderer = ChatRenderer(engine.tokenizer)
    while True:
        try:
            line = read_line().strip()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                typer.echo("")
            return messages
        if not line:
            continue
        if line in ("/exit", "/quit", "/bye"):
            return messages
        if line == "/reset":
            messages = list(base)
            typer.echo("(conversation cleared)", err=True)
            continue
        if line in ("/help", "/?"):
            typer.echo(CHAT_HELP, err=True)
            continue
        messages.append({"role": "user", "content": line})
        pieces: list[str] = []
        final = None
        try:
            text = renderer.render(messages, param="messages")
            ids = renderer.fix_bos(list(engine.inputs.encode(text, param="messages", add_special_tokens=False)))
            for chunk in engine.stream(ids, **request_kwargs(params)):
                if not chunk.is_final:
                    pieces.append(chunk.token)
                    sys.stdout.write(chunk.token)
                    sys.stdout.flush()
                else:
                    final = chunk
        except KeyboardInterrupt:
            typer.echo("\n(stopped)", err=True)
        except LLMInferError as exc:
            messages.pop()
            hint = " (/reset starts over)" if isinstance(exc, InvalidRequestError) and \
                getattr(exc, "code", None) == "context_length_exceeded" else ""
            typer.echo(f"error: {exc}{hint}", err=True)
            continue
        typer.echo("")
        messages.append({"role": "assistant", "content": "".join(pieces)})
        if verbose and final is not None and final.stats is not None:
            typer.echo(stats_line(final.stats, final.finish_reason, True), err=True)
