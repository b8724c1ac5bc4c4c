"""The one-prompt commands: ``run`` (one prompt, then a stats line) and ``stream`` (tokens as they arrive).
Without ``--model`` they load :func:`llminfer.models.default_model` (the trained
``llminfer/smollm2-135m-instruct``, or ``$LLMINFER_DEFAULT_MODEL``). ``chat`` is :mod:`llminfer.cli.chat`'s,
``info`` :mod:`llminfer.cli.info`'s, ``serve`` :mod:`llminfer.cli.serve`'s.

The functions are plain; :mod:`llminfer.cli` registers them on the Typer app. Every flag is checked before
the model loads: bad values raise typer.BadParameter, ConfigError or InvalidRequestError. The sampling flags
are declared once, in :class:`llminfer.cli.sampling.SamplingOptions`, and arrive as its ``sampling``; the
engine flags in :class:`llminfer.cli.engine_options.EngineOptions`, arriving as ``engine_opts``.

``run`` and ``stream`` send the prompt through the model's chat template (as one user message, after the
``--system`` message if given) when the tokenizer has one, as the HTTP server's chat endpoint does;
``--no-chat`` sends the raw text. The stats line says which (``chat template: on``).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from llminfer.cli.engine_options import EngineOptions, engine_options
from llminfer.cli.options import ChatOpt, SystemOpt, load_engine
from llminfer.cli.sampling import SamplingOptions, request_kwargs, sampling_options


def stats_line(stats, finish_reason: str | None = None, chat: bool | None = None) -> str:
    """The ``[latency ... | finish ...]`` line after a reply: ``stats`` (a ``RequestStats``), the finish
    reason, and whether the chat template was applied (None: not said)."""
    spec = ""
    if stats.spec_acceptance_rate is not None:
        spec = f" | draft acceptance {stats.spec_acceptance_rate:.0%}"
    template = "" if chat is None else f" | chat template: {'on' if chat else 'off'}"
    return (f"[latency {stats.total_latency_ms:.1f} ms | TTFT {stats.ttft_ms:.1f} ms | "
            f"{stats.throughput_tokens_per_sec:.1f} tok/s | prompt {stats.prompt_tokens} tok | "
            f"completion {stats.completion_tokens} tok | cached {stats.cached_tokens} tok{spec}{template}"
            f"{f' | finish {finish_reason}' if finish_reason else ''}]")


def _check_chat_flags(prompt: str, chat: bool | None, system: str | None) -> None:
    """Before loading: raises typer.BadParameter for ``--system`` with ``--no-chat`` and for an empty
    PROMPT (exit 2, like every other argument error)."""
    if system is not None and chat is False:
        raise typer.BadParameter("--system needs the chat template: drop --no-chat")
    if not prompt:
        raise typer.BadParameter("PROMPT is empty: give the text to complete")


def chat_prompt(engine, prompt: str, chat: bool | None, system: str | None) -> tuple[str | list[int], bool]:
    """What ``run`` / ``stream`` generate from, and whether the chat template was applied.

    With the template (``chat`` True, or None and the tokenizer has one): ``[system,] user`` messages
    rendered by :class:`llminfer.chat.ChatRenderer` (the server's rendering) and tokenized with one BOS, as
    token ids. Otherwise ``prompt`` itself.

    Raises:
        typer.BadParameter: ``--chat`` or ``--system`` for a model without a chat template.
    """
    from llminfer.chat import ChatRenderer

    has_template = bool(getattr(engine.tokenizer, "chat_template", None))
    if not (has_template if chat is None else chat) and system is None:
        return prompt, False
    if not has_template:
        flag = "--chat" if chat else "--system"
        raise typer.BadParameter(f"{flag}: this model's tokenizer has no chat template (use --no-chat without "
                                 "--system)")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}]
    renderer = ChatRenderer(engine.tokenizer)
    text = renderer.render(messages, param="prompt")
    ids = renderer.fix_bos(list(engine.inputs.encode(text, param="prompt", add_special_tokens=False)))
    return ids, True


@engine_options()
@sampling_options()
def run(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    engine_opts: EngineOptions = EngineOptions(), sampling: SamplingOptions = SamplingOptions(),
    chat: ChatOpt = None, system: SystemOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object (a list with "
                                          "--num-samples > 1).")] = False,
) -> None:
    """Generate for one prompt; print the text, then one stats line."""
    _check_chat_flags(prompt, chat, system)
    cfg = engine_opts.to_config()
    params = sampling.to_params()
    n = params.n
    with load_engine(cfg, engine_opts.log_level, engine_opts.adapter, engine_opts.adapter_name) as engine:
        source, templated = chat_prompt(engine, prompt, chat, system)
        results = engine.run_n(source, n=n, **request_kwargs(params))
        tokenizer = engine.tokenizer
    if as_json:
        import attrs

        payload = [attrs.asdict(r) for r in results]
        typer.echo(json.dumps(payload[0] if n == 1 else payload))
        return
    for i, result in enumerate(results):
        if n > 1:
            typer.echo(f"--- sample {i} ---")
        typer.echo(result.generated_text)
        if params.logprobs is not None:
            for lp in result.logprobs:
                alts = "  ".join(f"{tokenizer.decode([t])!r}:{v:.3f}" for t, v in lp.top)
                typer.echo(f"  {tokenizer.decode([lp.token_id])!r:>20} {lp.logprob:8.3f}   {alts}")
        typer.echo(stats_line(result.stats, result.finish_reason, templated))


@engine_options(exclude=("max_batch_size",))
@sampling_options(exclude=("n", "logprobs"))
def stream(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    engine_opts: EngineOptions = EngineOptions(), sampling: SamplingOptions = SamplingOptions(),
    chat: ChatOpt = None, system: SystemOpt = None,
) -> None:
    """Print tokens as they arrive, then one stats line."""
    _check_chat_flags(prompt, chat, system)
    cfg = engine_opts.to_config()
    params = sampling.to_params()
    with load_engine(cfg, engine_opts.log_level, engine_opts.adapter, engine_opts.adapter_name) as engine:
        source, templated = chat_prompt(engine, prompt, chat, system)
        final = None
        for chunk in engine.stream(source, **request_kwargs(params)):
            if not chunk.is_final:  # the final chunk has no text, only the finish reason and stats
                sys.stdout.write(chunk.token)
                sys.stdout.flush()
            else:
                final = chunk
    typer.echo("")
    if final is not None and final.stats is not None:
        typer.echo(stats_line(final.stats, final.finish_reason, templated))
