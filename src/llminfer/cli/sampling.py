"""The sampling flags of ``run``, ``stream`` and ``chat``, declared and parsed once.

:class:`SamplingOptions` declares every sampling flag: one attrs field each, whose type carries its Typer
option (name, help). :func:`sampling_options` puts those flags into a command's signature in place of the
command's one ``sampling: SamplingOptions`` parameter, and calls the command with one ``SamplingOptions``.
:meth:`SamplingOptions.to_params` is the one place the flags become
:class:`~llminfer.sampling.params.SamplingParams` (a bad value is ``--flag: message``, before the model
loads), and :func:`request_kwargs` spreads those params into ``InferenceEngine.run`` / ``stream`` keywords.

A field named like a ``SamplingParams`` field reaches it as is. So a new sampling control needs, in the
CLI, one field here (its type ``Annotated[T, typer.Option("--flag", help=...)]``, its default the
``SamplingParams`` default); every command that takes ``sampling`` then shows and forwards it. Only a flag
whose text is not the field's value (a comma-separated list, say) needs a converter as well.

Nothing here imports torch: ``--help`` and every flag error answer at once.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Annotated, Any

import attrs
import typer

from llminfer.cli.option_group import first_flag, option_group
from llminfer.cli.options import MaxNew, Seed, split_csv

if typing.TYPE_CHECKING:
    from llminfer.sampling.params import SamplingParams
    from llminfer.sampling.structured import StructuredOutput

Temp = Annotated[float, typer.Option("--temp", "--temperature", help="0 = greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold in (0, 1].")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p x the top probability.")]
Stop = Annotated[str | None, typer.Option("--stop", help='Comma-separated stop strings, e.g. "a,b"; '
                                          r'\n and \t stand for a newline and a tab.')]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past EOS.")]
RepPen = Annotated[float, typer.Option("--repetition-penalty", help="> 0; 1 = off (HF semantics).")]
NoRepeat = Annotated[int, typer.Option("--no-repeat-ngram-size", help="Never repeat an n-gram of this size.")]
BadWords = Annotated[str | None, typer.Option("--bad-words", help='Comma-separated words never generated.')]
ForceWords = Annotated[str | None, typer.Option("--force-words", help='Comma-separated phrases that must appear.')]
Logprobs = Annotated[int | None, typer.Option("--logprobs", help="Show each token's logprob and top-N.")]
NSamples = Annotated[int, typer.Option("--num-samples", help="Number of samples of the prompt (their prompt KV "
                                        "blocks are shared).")]
JsonSchemaOpt = Annotated[str | None, typer.Option("--json-schema", help="Constrain the output to this JSON "
                                                 "Schema: JSON text, or @path to a .json file.")]
JsonObjectOpt = Annotated[bool, typer.Option("--json-object", help="Constrain the output to any JSON object.")]
RegexOpt = Annotated[str | None, typer.Option("--regex", help="Constrain the output to match this regex.")]
ChoiceOpt = Annotated[list[str] | None, typer.Option("--choice", help="The output is one of these strings "
                                                     "(repeat the flag once per choice).")]
GrammarOpt = Annotated[str | None, typer.Option("--grammar", help="Constrain the output to this EBNF grammar "
                                                "(xgrammar's, root rule 'root'): text, or @path to a file.")]


def _comma_list(flag: str, *, escapes: bool = False) -> typing.Callable[[str | tuple | list | None], tuple[str, ...]]:
    """The converter of a comma-separated flag: its text as strings (a sequence, from Python, as is).

    With ``escapes``, ``\\n`` and ``\\t`` stand for a newline and a tab (``--stop``). The converter raises
    typer.BadParameter when the flag was given with nothing in it (``""``, ``","``): left as it is, that
    would silently mean "none".
    """

    def convert(value: str | tuple | list | None) -> tuple[str, ...]:
        if not isinstance(value, str):
            return () if value is None else tuple(value)
        items = split_csv(value)
        if not items:
            raise typer.BadParameter(f"{flag}: nothing in {value!r} (give one or more, comma-separated)")
        return tuple(x.replace("\\n", "\n").replace("\\t", "\t") for x in items) if escapes else tuple(items)

    return convert


#: the structured-output flags: together they make ``SamplingParams.structured_output``
STRUCTURED_FLAGS = ("json_schema", "json_object", "regex", "choice", "grammar")


@attrs.frozen(kw_only=True)
class SamplingOptions:
    """Every sampling flag as given on the command line (see the module docstring for how one is added).

    Fields named like a :class:`~llminfer.sampling.params.SamplingParams` field carry its value and unit
    (``stop_sequences``, ``bad_words`` and ``force_words`` arrive comma-separated and are split here);
    :data:`STRUCTURED_FLAGS` make ``structured_output`` together. Values are checked by :meth:`to_params`,
    not here.
    """

    max_new_tokens: MaxNew = 64
    temperature: Temp = 0.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    seed: Seed = None
    stop_sequences: Stop = attrs.field(default=None, converter=_comma_list("--stop", escapes=True))
    ignore_eos: IgnoreEos = False
    repetition_penalty: RepPen = 1.0
    no_repeat_ngram_size: NoRepeat = 0
    bad_words: BadWords = attrs.field(default=None, converter=_comma_list("--bad-words"))
    force_words: ForceWords = attrs.field(default=None, converter=_comma_list("--force-words"))
    logprobs: Logprobs = None
    n: NSamples = 1
    json_schema: JsonSchemaOpt = None
    json_object: JsonObjectOpt = False
    regex: RegexOpt = None
    choice: ChoiceOpt = None
    grammar: GrammarOpt = None

    def structured_output(self) -> StructuredOutput | None:
        """The structured-output flags as one constraint, or None when none is given (``@path`` values
        are read here).

        Raises:
            typer.BadParameter: more than one given, an invalid value or an ``@path`` that cannot be read,
                naming the flag.
        """
        from llminfer.errors import InvalidRequestError
        from llminfer.sampling.grammar_compiler import check_grammar_syntax
        from llminfer.sampling.structured import StructuredOutput

        if self.json_schema is None and not self.json_object and self.regex is None and not self.choice \
                and self.grammar is None:
            return None
        given = [f"--{name.replace('_', '-')}" for name in STRUCTURED_FLAGS
                 if getattr(self, name) not in (None, False, [], ())]
        if len(given) > 1:
            raise typer.BadParameter(f"{' and '.join(given)}: give exactly one structured-output flag")
        try:
            spec = StructuredOutput(json_schema=_text_or_file(self.json_schema, "--json-schema"),
                                    json_object=self.json_object, regex=self.regex, choice=self.choice or None,
                                    grammar=_text_or_file(self.grammar, "--grammar"))
            check_grammar_syntax(spec)  # before the model loads: a bad --regex fails in a second, not after it
        except InvalidRequestError as exc:
            raise typer.BadParameter(f"{given[0]}: {exc}") from None
        return spec

    def to_params(self) -> SamplingParams:
        """The :class:`SamplingParams` these flags describe: every field named like one of its fields, and
        ``structured_output`` from :data:`STRUCTURED_FLAGS`.

        Raises:
            typer.BadParameter: a value out of range, as ``--flag: message`` (the flag that sets the field).
            InvalidRequestError: an invalid structured-output constraint.
        """
        from llminfer.errors import InvalidRequestError
        from llminfer.sampling.params import SamplingParams

        names = {a.name for a in attrs.fields(SamplingParams)}
        values = {a.name: getattr(self, a.name) for a in attrs.fields(SamplingOptions) if a.name in names}
        constraint = self.structured_output()
        try:
            return SamplingParams(**values, structured_output=constraint)
        except InvalidRequestError as exc:
            param = exc.param or ""
            raise typer.BadParameter(f"{option_flag(param)}: {exc}" if param else str(exc)) from None


def option_flag(field: str) -> str:
    """The flag that sets ``field`` (its first ``--`` name); ``--field-name`` for a field with no flag."""
    flag = first_flag(SamplingOptions, field) if field in attrs.fields_dict(SamplingOptions) else None
    return flag or "--" + field.replace("_", "-")


def request_kwargs(params: SamplingParams) -> dict[str, Any]:
    """``params`` as ``InferenceEngine.run`` / ``stream`` / ``run_n`` keyword arguments: every field but
    ``n`` (``run_n`` takes the sample count itself; one request is one sample)."""
    return {a.name: getattr(params, a.name) for a in attrs.fields(type(params)) if a.name != "n"}


def sampling_options(*, exclude: tuple[str, ...] = (), **defaults: Any) -> Callable:
    """Decorator: replace a command's ``sampling: SamplingOptions`` parameter by one Typer option per
    :class:`SamplingOptions` field (in field order), and call the command with ``sampling`` built from them
    (:func:`llminfer.cli.option_group.option_group`).

    Args:
        exclude: fields this command does not offer (they keep their defaults).
        defaults: per-command defaults, e.g. ``max_new_tokens=512``.

    Raises:
        TypeError: (at import) the command has no ``sampling`` parameter, a field name clashes with one of
            its parameters, or ``exclude`` / ``defaults`` name no field.
    """
    return option_group(SamplingOptions, "sampling", exclude=exclude, **defaults)


def _text_or_file(value: str | None, flag: str) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise typer.BadParameter(f"{flag}: cannot read {value[1:]!r}: {exc.strerror}") from None
