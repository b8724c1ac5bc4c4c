"""A group of CLI flags declared once, as one attrs class, and put into any command's signature.

An option group is an attrs class whose fields are typed ``Annotated[T, typer.Option("--flag", help=...)]``
(:class:`llminfer.cli.sampling.SamplingOptions`, :class:`llminfer.cli.engine_options.EngineOptions`).
:func:`option_group` turns a command that takes one parameter of that class into a command Typer sees with
one option per field in its place, and calls it with the group built from those options. Typer reads
``__signature__``, so the command's own parameters and the group's flags list together in ``--help``.

Nothing here imports torch.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import attrs


@functools.cache
def option_types(group: type) -> dict[str, Any]:
    """Field name → its ``Annotated[type, typer.Option(...)]`` (the string annotations, evaluated)."""
    return typing.get_type_hints(group, include_extras=True)


def first_flag(group: type, field: str) -> str | None:
    """The first ``--`` name of ``field``'s option in ``group``, or None when it has none."""
    for meta in typing.get_args(option_types(group).get(field))[1:]:
        # Inside Annotated, typer.Option's first name sits in its `default` slot (typer moves it later).
        names = [getattr(meta, "default", None), *(getattr(meta, "param_decls", None) or ())]
        flags = [name for name in names if isinstance(name, str) and name.startswith("--")]
        if flags:
            return flags[0]
    return None


def option_group(group: type, param: str, *, exclude: tuple[str, ...] = (), **defaults: Any) -> Callable:
    """Decorator: replace a command's ``param`` parameter (an instance of ``group``) by one Typer option per
    ``group`` field (in field order), and call the command with ``param`` built from them.

    Args:
        group: the attrs class of options.
        param: the command's parameter that receives the group.
        exclude: fields this command does not offer (they keep their defaults, or ``defaults``' value).
        defaults: per-command defaults, e.g. ``max_new_tokens=512``.

    Raises:
        TypeError: (at import) the command has no ``param`` parameter, a field name clashes with one of its
            parameters, or ``exclude`` / ``defaults`` name no field.
    """
    fields = attrs.fields_dict(group)
    unknown = (set(exclude) | set(defaults)) - set(fields)
    if unknown:
        raise TypeError(f"no {group.__name__} option named {sorted(unknown)}")
    offered = [name for name in fields if name not in exclude]

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        params = list(signature.parameters.values())
        names = [p.name for p in params]
        if param not in names or set(offered) & set(names):
            raise TypeError(f"{command.__name__} needs one `{param}` parameter and no parameter named like a "
                            f"{group.__name__} field")
        types = option_types(group)
        flags = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=types[name],
                                   default=defaults.get(name, fields[name].default)) for name in offered]
        at = names.index(param)
        signature = signature.replace(parameters=params[:at] + flags + params[at + 1:])

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if param not in kwargs:
                given = {name: kwargs.pop(name) for name in offered if name in kwargs}
                kwargs[param] = group(**{**defaults, **given})
            return command(*args, **kwargs)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]  # what Typer reads
        wrapper.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return wrapper

    return decorate
