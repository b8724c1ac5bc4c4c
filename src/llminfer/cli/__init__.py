"""The ``llminfer`` command line (Typer): the app, its commands and :func:`main`, the console entry point.

The commands live in :mod:`llminfer.cli.generate` (run, stream), :mod:`llminfer.cli.chat`,
:mod:`llminfer.cli.info`, :mod:`llminfer.cli.serve`, :mod:`llminfer.cli.bench` (bench, compare, bench-serve) and
:mod:`llminfer.cli.report` (bench-report); the engine flags they share, and how those become an
``EngineConfig``, in :mod:`llminfer.cli.engine_options` (their option types and checks in
:mod:`llminfer.cli.options`); the sampling flags, and how those become ``SamplingParams``, in
:mod:`llminfer.cli.sampling`. This module registers the commands, in the order ``--help`` lists them, and
maps the old spellings of renamed flags to the new ones (:data:`ALIASES`; they work but ``--help`` no longer
shows them).

Importing it costs no torch, transformers, polars or litestar: the commands import those in their bodies,
so ``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import sys

import typer

try:  # typer >= 0.20 vendors its own click; older versions use click itself
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

from llminfer.cli import bench, chat, generate, info, report, serve
from llminfer.errors import LLMInferError

__all__ = ["app", "main"]

app = typer.Typer(
    name="llminfer",
    help="llminfer: a compact LLM inference and benchmarking engine. Without --model, run, stream, chat, info and "
    "serve use llminfer/smollm2-135m-instruct (a trained chat model, fetched once with pip).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"llminfer {version('llminfer')}")
        except PackageNotFoundError:  # pragma: no cover - a source tree without an install
            typer.echo("llminfer (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="Print the version and exit."),
) -> None:
    """llminfer: a compact LLM inference and benchmarking engine. Without --model, run, stream, chat, info and
    serve use llminfer/smollm2-135m-instruct (a trained chat model, fetched once with pip)."""


app.command()(generate.run)
app.command()(generate.stream)
app.command()(chat.chat)
app.command()(info.info)
app.command()(serve.serve)
app.command()(bench.bench)
app.command()(bench.compare)
app.command("bench-serve")(bench.bench_serve)
app.command("bench-report")(report.bench_report)


ALIASES: dict[str, dict[str, str]] = {
    "run": {"--n": "--num-samples", "--page-size-tokens": "--page-size"},
    "stream": {"--page-size-tokens": "--page-size"},
    "chat": {"--page-size-tokens": "--page-size"},
    "info": {"--page-size-tokens": "--page-size"},
    "serve": {"--page-size-tokens": "--page-size"},
}
"""Per command, old flag spelling → its current name (hidden from ``--help``, still accepted)."""


def resolve_aliases(argv: list[str]) -> list[str]:
    """``argv`` with each old flag spelling of :data:`ALIASES` (``--n 3`` or ``--n=3``) replaced by the
    current one; the command is the first word, nothing after a ``--`` is touched."""
    if not argv or argv[0] not in ALIASES:
        return argv
    table = ALIASES[argv[0]]
    out = [argv[0]]
    for i, arg in enumerate(argv[1:], 1):
        if arg == "--":
            return out + argv[i:]
        name, eq, value = arg.partition("=")
        out.append(table[name] + eq + value if name in table else arg)
    return out


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the Typer app; any user error becomes one line on stderr and exit code 1 or 2."""
    argv = resolve_aliases(list(sys.argv[1:] if argv is None else argv))
    try:
        rc = app(args=argv, standalone_mode=False)  # returns the code of a typer.Exit
        if rc == 130:  # typer turns Ctrl-C inside a command into a silent return of 130
            typer.echo("error: interrupted", err=True)
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except click_exc.NoArgsIsHelpError as exc:  # pragma: no cover - typer prints help itself
        typer.echo(exc.ctx.get_help() if exc.ctx else "", err=True)
        sys.exit(2)
    except click_exc.UsageError as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(2)
    except click_exc.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code or 1)
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except LLMInferError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
