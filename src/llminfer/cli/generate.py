"""The generation commands: ``run`` (one prompt, then a stats line), ``stream`` (tokens as they arrive),
``chat`` (an interactive multi-turn loop), ``info`` (environment, model and KV capacity) and ``serve`` (the
OpenAI-compatible HTTP API). Without ``--model`` they load :func:`llminfer.models.default_model` (the
trained ``llminfer/smollm2-135m-instruct``, or ``$LLMINFER_DEFAULT_MODEL``).

The functions are plain; :mod:`llminfer.cli` registers them on the Typer app. Every flag is checked before
the model loads: bad values raise typer.BadParameter, ConfigError or InvalidRequestError; ``serve`` raises
BackendUnavailableError without the serve extra.

``run`` and ``stream`` send the prompt through the model's chat template (as one user message, after the
``--system`` message if given) when the tokenizer has one, as the HTTP server's chat endpoint does;
``--no-chat`` sends the raw text. The stats line says which (``chat template: on``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from llminfer.cli.options import (
    AdapterName,
    AdapterOpt,
    Assistant,
    AttnBackend,
    BackendOpt,
    BadWords,
    BatchSize,
    CacheDir,
    ChatOpt,
    ChoiceOpt,
    CompileMode,
    Device,
    Dtype,
    ForceWords,
    GrammarOpt,
    HFToken,
    IgnoreEos,
    JsonObjectOpt,
    JsonSchemaOpt,
    KVBytes,
    LocalOnly,
    LogLevel,
    Logprobs,
    MaxLen,
    MaxNew,
    MinP,
    Model,
    NoPrefix,
    NoRepeat,
    NSamples,
    PageSize,
    PPSize,
    QuantOpt,
    RegexOpt,
    RepPen,
    Revision,
    Seed,
    SpecC,
    SpecK,
    SpecLookupMax,
    SpecLookupMin,
    SpecMethod,
    Stop,
    SystemOpt,
    Temp,
    Threads,
    TopK,
    TopP,
    TPSize,
    TrustRemote,
    build_config,
    check_engine_flags,
    check_sampling,
    load_engine,
    sampling_kwargs,
)
from llminfer.config import Backend, QuantMode
from llminfer.models.trained import default_model


def _stats_line(stats, finish_reason: str | None = None, chat: bool | None = None) -> str:
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


def run(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: Model = None, max_new_tokens: MaxNew = 64, temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = None, stop: Stop = None, ignore_eos: IgnoreEos = False, min_p: MinP = 0.0,
    repetition_penalty: RepPen = 1.0, no_repeat_ngram_size: NoRepeat = 0, bad_words: BadWords = None,
    force_words: ForceWords = None, num_samples: NSamples = 1, logprobs: Logprobs = None,
    chat: ChatOpt = None, system: SystemOpt = None,
    json_schema: JsonSchemaOpt = None, json_object: JsonObjectOpt = False, regex: RegexOpt = None,
    choice: ChoiceOpt = None, grammar: GrammarOpt = None,
    assistant_model: Assistant = None, spec_num_assistant_tokens: SpecK = 5, spec_confidence_threshold: SpecC = 0.4,
    spec_method: SpecMethod = None, spec_prompt_lookup_max: SpecLookupMax = 4,
    spec_prompt_lookup_min: SpecLookupMin = 2,
    backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    max_batch_size: BatchSize = 16, page_size: PageSize = 16, no_prefix_cache: NoPrefix = False,
    kv_cache_bytes: KVBytes = None, max_model_len: MaxLen = None, revision: Revision = None,
    hf_token: HFToken = None, local_files_only: LocalOnly = False, cache_dir: CacheDir = None,
    trust_remote_code: TrustRemote = False, tp_size: TPSize = 1, pp_size: PPSize = 1,
    quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None, adapter_name: AdapterName = None,
    compile_mode: CompileMode = "default", attention_backend: AttnBackend = "auto",
    threads: Threads = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object (a list with "
                                          "--num-samples > 1).")] = False,
    log_level: LogLevel = "warning",
) -> None:
    """Generate for one prompt; print the text, then one stats line."""
    n = num_samples
    _check_chat_flags(prompt, chat, system)
    model = model or default_model()
    check_engine_flags(model=model, device=device, log_level=log_level, adapter=adapter, adapter_name=adapter_name)
    cfg = build_config(model=model, backend=backend, dtype=dtype, device=device, max_batch_size=max_batch_size,
                       page_size=page_size, no_prefix_cache=no_prefix_cache, kv_cache_bytes=kv_cache_bytes,
                       max_model_len=max_model_len, revision=revision, hf_token=hf_token,
                       local_files_only=local_files_only, cache_dir=cache_dir, trust_remote_code=trust_remote_code,
                       tp_size=tp_size, pp_size=pp_size, quant=quant,
                       assistant_model=assistant_model, spec_num_assistant_tokens=spec_num_assistant_tokens,
                       spec_confidence_threshold=spec_confidence_threshold, compile_mode=compile_mode,
                       speculative_method=spec_method, speculative_prompt_lookup_max=spec_prompt_lookup_max,
                       speculative_prompt_lookup_min=spec_prompt_lookup_min,
                       attention_backend=attention_backend, threads=threads)
    kw = sampling_kwargs(max_new_tokens=max_new_tokens, temp=temp, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                         ignore_eos=ignore_eos, min_p=min_p, repetition_penalty=repetition_penalty,
                         no_repeat_ngram_size=no_repeat_ngram_size, bad_words=bad_words, force_words=force_words,
                         logprobs=logprobs, json_schema=json_schema, json_object=json_object, regex=regex,
                         choice=choice, grammar=grammar)
    check_sampling(kw, n)
    with load_engine(cfg, log_level, adapter, adapter_name) as engine:
        source, templated = chat_prompt(engine, prompt, chat, system)
        results = engine.run_n(source, n=n, **kw)
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
        if logprobs is not None:
            for lp in result.logprobs:
                alts = "  ".join(f"{tokenizer.decode([t])!r}:{v:.3f}" for t, v in lp.top)
                typer.echo(f"  {tokenizer.decode([lp.token_id])!r:>20} {lp.logprob:8.3f}   {alts}")
        typer.echo(_stats_line(result.stats, result.finish_reason, templated))


def stream(
    prompt: Annotated[str, typer.Argument(help="The prompt text.")],
    model: Model = None, max_new_tokens: MaxNew = 64, temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = None, stop: Stop = None, ignore_eos: IgnoreEos = False, min_p: MinP = 0.0,
    repetition_penalty: RepPen = 1.0, no_repeat_ngram_size: NoRepeat = 0, bad_words: BadWords = None,
    force_words: ForceWords = None, json_schema: JsonSchemaOpt = None, json_object: JsonObjectOpt = False,
    regex: RegexOpt = None, choice: ChoiceOpt = None, grammar: GrammarOpt = None,
    chat: ChatOpt = None, system: SystemOpt = None,
    assistant_model: Assistant = None, spec_num_assistant_tokens: SpecK = 5, spec_confidence_threshold: SpecC = 0.4,
    spec_method: SpecMethod = None, spec_prompt_lookup_max: SpecLookupMax = 4,
    spec_prompt_lookup_min: SpecLookupMin = 2,
    backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    page_size: PageSize = 16, no_prefix_cache: NoPrefix = False, kv_cache_bytes: KVBytes = None,
    max_model_len: MaxLen = None, revision: Revision = None, hf_token: HFToken = None,
    local_files_only: LocalOnly = False, cache_dir: CacheDir = None, trust_remote_code: TrustRemote = False,
    tp_size: TPSize = 1, pp_size: PPSize = 1, quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None,
    adapter_name: AdapterName = None, compile_mode: CompileMode = "default", attention_backend: AttnBackend = "auto",
    threads: Threads = None,
    log_level: LogLevel = "warning",
) -> None:
    """Print tokens as they arrive, then one stats line."""
    _check_chat_flags(prompt, chat, system)
    model = model or default_model()
    check_engine_flags(model=model, device=device, log_level=log_level, adapter=adapter, adapter_name=adapter_name)
    cfg = build_config(model=model, backend=backend, dtype=dtype, device=device, max_batch_size=16,
                       page_size=page_size, no_prefix_cache=no_prefix_cache, kv_cache_bytes=kv_cache_bytes,
                       max_model_len=max_model_len, revision=revision, hf_token=hf_token,
                       local_files_only=local_files_only, cache_dir=cache_dir, trust_remote_code=trust_remote_code,
                       tp_size=tp_size, pp_size=pp_size, quant=quant,
                       assistant_model=assistant_model, spec_num_assistant_tokens=spec_num_assistant_tokens,
                       spec_confidence_threshold=spec_confidence_threshold, compile_mode=compile_mode,
                       speculative_method=spec_method, speculative_prompt_lookup_max=spec_prompt_lookup_max,
                       speculative_prompt_lookup_min=spec_prompt_lookup_min,
                       attention_backend=attention_backend, threads=threads)
    kw = sampling_kwargs(max_new_tokens=max_new_tokens, temp=temp, top_p=top_p, top_k=top_k, seed=seed,
                         stop=stop, ignore_eos=ignore_eos, min_p=min_p, repetition_penalty=repetition_penalty,
                         no_repeat_ngram_size=no_repeat_ngram_size, bad_words=bad_words,
                         force_words=force_words, json_schema=json_schema, json_object=json_object,
                         regex=regex, choice=choice, grammar=grammar)
    check_sampling(kw)
    with load_engine(cfg, log_level, adapter, adapter_name) as engine:
        source, templated = chat_prompt(engine, prompt, chat, system)
        final = None
        for chunk in engine.stream(source, **kw):
            if not chunk.is_final:  # the final chunk has no text, only the finish reason and stats
                sys.stdout.write(chunk.token)
                sys.stdout.flush()
            else:
                final = chunk
    typer.echo("")
    if final is not None and final.stats is not None:
        typer.echo(_stats_line(final.stats, final.finish_reason, templated))


CHAT_HELP = "/exit (or Ctrl-D) quits, /reset forgets the conversation, Ctrl-C stops a reply"


def chat(
    model: Model = None, max_new_tokens: MaxNew = 512, temp: Temp = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    seed: Seed = None, min_p: MinP = 0.0, repetition_penalty: RepPen = 1.0, system: SystemOpt = None,
    backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    page_size: PageSize = 16, kv_cache_bytes: KVBytes = None, max_model_len: MaxLen = None,
    revision: Revision = None, hf_token: HFToken = None, local_files_only: LocalOnly = False,
    cache_dir: CacheDir = None, trust_remote_code: TrustRemote = False, quant: QuantOpt = QuantMode.NONE,
    adapter: AdapterOpt = None, adapter_name: AdapterName = None, attention_backend: AttnBackend = "auto",
    verbose: Annotated[bool, typer.Option("--verbose", help="Print a stats line after each reply.")] = False,
    log_level: LogLevel = "warning",
) -> None:
    """Chat interactively: each line you type is a user message, the reply streams back through the model's
    chat template, and the conversation carries over (multi-turn; the prefix cache reuses its KV). /exit or
    Ctrl-D quits, /reset starts over, Ctrl-C stops a reply (and quits at the prompt)."""
    model = model or default_model()
    check_engine_flags(model=model, device=device, log_level=log_level, adapter=adapter, adapter_name=adapter_name)
    cfg = build_config(model=model, backend=backend, dtype=dtype, device=device, max_batch_size=4,
                       page_size=page_size, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
                       revision=revision, hf_token=hf_token, local_files_only=local_files_only, cache_dir=cache_dir,
                       trust_remote_code=trust_remote_code, quant=quant, attention_backend=attention_backend)
    kw = sampling_kwargs(max_new_tokens=max_new_tokens, temp=temp, top_p=top_p, top_k=top_k, seed=seed, stop=None,
                         ignore_eos=False, min_p=min_p, repetition_penalty=repetition_penalty)
    check_sampling(kw)
    interactive = sys.stdin.isatty()
    with load_engine(cfg, log_level, adapter, adapter_name) as engine:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise typer.BadParameter(f"--model: {model!r} has no chat template, which chat needs (use run --no-chat)")
        if interactive:
            typer.echo(f"llminfer chat with {model}: {CHAT_HELP}", err=True)
        chat_loop(engine, kw, system=system, interactive=interactive, verbose=verbose)


def chat_loop(engine, kw: dict, *, system: str | None = None, interactive: bool = False,
              verbose: bool = False, read_line=None) -> list[dict[str, str]]:
    """``llminfer chat``'s loop on a loaded engine: read a line, stream the reply to stdout, remember both.

    Args:
        kw: sampling keyword arguments (:func:`~llminfer.cli.options.sampling_kwargs`).
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
            for chunk in engine.stream(ids, **kw):
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
            typer.echo(_stats_line(final.stats, final.finish_reason, True), err=True)


def info(
    model: Model = None, backend: BackendOpt = Backend.EAGER, dtype: Dtype = "auto", device: Device = "auto",
    max_batch_size: BatchSize = 16, page_size: PageSize = 16, kv_cache_bytes: KVBytes = None,
    max_model_len: MaxLen = None, revision: Revision = None, hf_token: HFToken = None,
    local_files_only: LocalOnly = False, cache_dir: CacheDir = None, trust_remote_code: TrustRemote = False,
    tp_size: TPSize = 1, pp_size: PPSize = 1, quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None,
    adapter_name: AdapterName = None, attention_backend: AttnBackend = "auto",
    threads: Threads = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    log_level: LogLevel = "warning",
) -> None:
    """Print the environment, the model (architecture, parameters, dtype, weight bytes before and after
    quantization) and KV capacity."""
    model = model or default_model()
    check_engine_flags(model=model, device=device, log_level=log_level, adapter=adapter, adapter_name=adapter_name)
    cfg = build_config(model=model, backend=backend, dtype=dtype, device=device, max_batch_size=max_batch_size,
                       page_size=page_size, no_prefix_cache=False, kv_cache_bytes=kv_cache_bytes,
                       max_model_len=max_model_len, revision=revision, hf_token=hf_token,
                       local_files_only=local_files_only, cache_dir=cache_dir, trust_remote_code=trust_remote_code,
                       tp_size=tp_size, pp_size=pp_size, quant=quant, attention_backend=attention_backend,
                       threads=threads)
    engine = load_engine(cfg, log_level, adapter, adapter_name)
    facts = engine.info()
    if as_json:
        typer.echo(json.dumps(facts))
        return
    width = max(len(k) for k in facts)
    for key, value in facts.items():
        if (key.endswith("_bytes") or "_bytes_" in key) and isinstance(value, int):
            value = f"{value:,} bytes ({value / 2**20:.1f} MiB)"
        elif key == "parameters":
            value = f"{value:,}"
        typer.echo(f"{key:<{width}}  {value}")


def serve(
    model: Model = None, backend: BackendOpt = Backend.EAGER,
    host: Annotated[str, typer.Option("--host", help="Address to bind (default: loopback only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.", min=0, max=65535)] = 8000,
    max_batch_size: BatchSize = 16,
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
    dtype: Dtype = "auto", device: Device = "auto", page_size: PageSize = 16, no_prefix_cache: NoPrefix = False,
    kv_cache_bytes: KVBytes = None, max_model_len: MaxLen = None, revision: Revision = None,
    hf_token: HFToken = None, local_files_only: LocalOnly = False, cache_dir: CacheDir = None,
    trust_remote_code: TrustRemote = False, tp_size: TPSize = 1, pp_size: PPSize = 1,
    quant: QuantOpt = QuantMode.NONE, adapter: AdapterOpt = None, adapter_name: AdapterName = None,
    compile_mode: CompileMode = "default", attention_backend: AttnBackend = "auto",
    threads: Threads = None,
    compile_warmup: Annotated[bool, typer.Option("--compile-warmup/--no-compile-warmup", help="With --backend "
                              "compiled: compile every step shape before accepting requests, so no client waits "
                              "for a compile.")] = True,
    log_level: LogLevel = "info",
    reject_unknown_fields: Annotated[bool, typer.Option(
        "--reject-unknown-fields", help="Answer request fields the API does not define with HTTP 400 naming "
        "them (default: ignore them and log a warning, as vLLM does).")] = False,
    sse_keepalive_s: Annotated[float, typer.Option("--sse-keepalive-s", min=0.0, help="Send an SSE comment "
                               "(': keep-alive') on a stream quiet for this many seconds, so idle-timeout proxies "
                               "keep it open; 0 disables.")] = 15.0,
) -> None:
    """Serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models,
    /health, /healthz, /metrics) with uvicorn until Ctrl-C."""
    model = model or default_model()
    check_engine_flags(model=model, device=device, log_level=log_level, adapter=adapter, adapter_name=adapter_name)
    cfg = build_config(model=model, backend=backend, dtype=dtype, device=device, max_batch_size=max_batch_size,
                       page_size=page_size, no_prefix_cache=no_prefix_cache, kv_cache_bytes=kv_cache_bytes,
                       max_model_len=max_model_len, revision=revision, hf_token=hf_token,
                       local_files_only=local_files_only, cache_dir=cache_dir, trust_remote_code=trust_remote_code,
                       tp_size=tp_size, pp_size=pp_size, quant=quant, compile_mode=compile_mode,
                       batch_timeout_ms=batch_timeout_ms, served_model_name=served_model_name,
                       attention_backend=attention_backend, threads=threads)
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
        engine = load_engine(cfg, log_level, adapter, adapter_name)
        if compile_warmup and hasattr(engine.backend, "warmup"):  # the compiled backend
            warm_up(engine)
        asgi_app = create_app(engine, api_key=key, max_queue_size=max_queue_size,
                              max_prompt_chars=max_prompt_chars, reject_unknown_fields=reject_unknown_fields,
                              sse_keepalive_s=sse_keepalive_s or None)
        limits = ServerLimits(read_timeout_s=read_timeout_s, keep_alive_timeout_s=keep_alive_timeout_s,
                              limit_concurrency=limit_concurrency or max_batch_size + max_queue_size + 64,
                              shutdown_grace_s=shutdown_grace_s)
        try:
            run_server(asgi_app, host=host, port=port, log_level=log_level, limits=limits, sock=sock)
        finally:
            engine.close()  # vLLM's engine processes exit with the server, not at interpreter teardown


def warm_up(engine) -> int:
    """Compile the compiled backend's graph for every step shape before serving (a status line on a
    terminal; one stderr line with the count and the seconds after). Returns the graphs compiled."""
    import time

    from llminfer.logging import status

    start = time.perf_counter()
    with status("compiling the model step for every batch shape (warm-up before serving) ..."):
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
