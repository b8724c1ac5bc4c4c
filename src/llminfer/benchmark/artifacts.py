"""Writing and validating benchmark artifacts (JSON + CSV, described by JSON Schemas in ``schemas/``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import polars as pl


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf → None, tuples → lists, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write(payload: dict[str, Any], table: pl.DataFrame, directory: str | Path, stem: str,
          json_out: str | Path | None = None, csv_out: str | Path | None = None) -> dict[str, Path]:
    """Write ``<stem>.json`` (the whole payload) and ``<stem>.csv`` (``table``) and return their paths.

    Raises:
        OSError: the folder cannot be created or written.
    """
    directory = Path(directory)
    json_path = Path(json_out) if json_out else directory / f"{stem}.json"
    csv_path = Path(csv_out) if csv_out else directory / f"{stem}.csv"
    for p in (json_path, csv_path):
        p.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_clean(payload), indent=2, default=str))
    table.write_csv(csv_path)
    return {"json": json_path, "csv": csv_path}


def schema_dir() -> Path:
    """The ``schemas/`` folder: in a source checkout next to ``src/``, else the packaged copy."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[3] / "schemas", here.parent / "schemas"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("schemas/ folder not found")


def validate(payload: dict[str, Any], kind: str) -> None:
    """Validate an artifact payload against ``schemas/<kind>.schema.json``.

    Raises:
        jsonschema.ValidationError: the payload does not match.
    """
    import jsonschema

    schema = json.loads((schema_dir() / f"{kind}.schema.json").read_text())
    jsonschema.validate(_clean(payload), schema)
