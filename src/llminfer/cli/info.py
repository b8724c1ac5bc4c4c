"""``llminfer info``: the environment, the model (architecture, parameters, dtype, weight bytes before and
after quantization) and the KV capacity, as a table or one JSON object.

The command is plain; :mod:`llminfer.cli` registers it on the Typer app.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from llminfer.cli.engine_options import SPEC_FLAGS, EngineOptions, engine_options
from llminfer.cli.options import load_engine


@engine_options(exclude=("no_prefix_cache", "compile_mode", *SPEC_FLAGS))
def info(
    engine_opts: EngineOptions = EngineOptions(),
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Print the environment, the model (architecture, parameters, dtype, weight bytes before and after
    quantization) and KV capacity."""
    cfg = engine_opts.to_config()
    engine = load_engine(cfg, engine_opts.log_level, engine_opts.adapter, engine_opts.adapter_name)
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
