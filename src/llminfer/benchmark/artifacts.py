"""Writing and validating benchmark artifacts (JSON + CSV, described by JSON Schemas in ``schemas/``)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from collections.abc import Iterable
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


def timestamp() -> str:
    """The UTC time now as a folder name (``20261201-210305``)."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


def fresh_folder(directory: str | Path, names: Iterable[str], overwrite: bool = False,
                 stamp: str | None = None) -> Path:
    """``directory`` when none of ``names`` exists in it (or ``overwrite``), else a new timestamped
    subfolder of it (``<directory>/<stamp>``, ``<stamp>-2``, ... where that exists too); nothing is created.

    Args:
        stamp: the subfolder's name (default :func:`timestamp`); pass the same one to put several outputs
            of one run into the same subfolder.
    """
    directory = Path(directory)
    if overwrite or not any((directory / n).exists() for n in names):
        return directory
    stamp = stamp or timestamp()
    out, k = directory / stamp, 1
    while out.exists() and any((out / n).exists() for n in names):
        k += 1
        out = directory / f"{stamp}-{k}"
    return out


def check_new(path: str | Path, overwrite: bool = False, flag: str | None = None) -> Path:
    """``path`` as a Path, when it may be written.

    Raises:
        FileExistsError: it exists and ``overwrite`` is False (the message names ``flag`` and ``--overwrite``).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        what = f"{flag} {path}" if flag else str(path)
        raise FileExistsError(f"{what} exists; pass --overwrite to replace it")
    return path


#: File types matplotlib writes (``--plot`` paths must end in one of them).
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".eps", ".ps")


def check_plot_path(path: str | Path, flag: str = "--plot") -> Path:
    """``path`` as a Path when matplotlib can write that file type.

    Raises:
        ValueError: its suffix is not one of :data:`PLOT_SUFFIXES`.
    """
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"{flag} {path}: the file type must be one of {', '.join(PLOT_SUFFIXES)}")
    return path


def check_writable_folder(folder: str | Path, flag: str) -> Path:
    """Create ``folder`` (and its parents) if needed and check this process may write there, so a run never
    ends in a write error after its measurements.

    Raises:
        OSError: it cannot be created, is not a folder, or is not writable (the message names ``flag``).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"{flag} {folder}: cannot create it ({exc.strerror or exc})") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(f"{flag} {folder}: not a writable folder")
    return folder


def save(payload: dict[str, Any], table: pl.DataFrame, directory: str | Path | None, stem: str,
         json_out: str | Path | None = None, csv_out: str | Path | None = None,
         overwrite: bool = False) -> dict[str, Path]:
    """Write the artifacts asked for, never replacing a file unless ``overwrite``.

    ``<stem>.json`` (the whole payload) and ``<stem>.csv`` (``table``) go into ``directory`` (None: none
    there), or into a fresh timestamped subfolder of it when either exists there already (see
    :func:`fresh_folder`); ``json_out`` / ``csv_out`` are explicit paths instead, refused when they exist.
    Returns ``{"json": path, "csv": path}`` for what was written.

    Raises:
        FileExistsError: an explicit path exists and ``overwrite`` is False (nothing is written then).
        OSError: a folder cannot be created or a file written.
    """
    paths: dict[str, Path] = {}
    names = [f"{stem}.{ext}" for ext, explicit in (("json", json_out), ("csv", csv_out)) if not explicit]
    folder = fresh_folder(directory, names, overwrite) if directory is not None and names else None
    for ext, explicit in (("json", json_out), ("csv", csv_out)):
        if explicit:
            paths[ext] = check_new(explicit, overwrite)
        elif folder is not None:
            paths[ext] = folder / f"{stem}.{ext}"
    return write_files(payload, table, paths.get("json"), paths.get("csv"))


def write(payload: dict[str, Any], table: pl.DataFrame, directory: str | Path, stem: str,
          json_out: str | Path | None = None, csv_out: str | Path | None = None) -> dict[str, Path]:
    """Write ``<stem>.json`` (the whole payload) and ``<stem>.csv`` (``table``), replacing what is there, and
    return their paths (the serving benchmark's writer; the offline ones use :func:`save`).

    Raises:
        OSError: the folder cannot be created or written.
    """
    directory = Path(directory)
    return write_files(payload, table, Path(json_out) if json_out else directory / f"{stem}.json",
                       Path(csv_out) if csv_out else directory / f"{stem}.csv")


def write_files(payload: dict[str, Any], table: pl.DataFrame, json_path: str | Path | None,
                csv_path: str | Path | None) -> dict[str, Path]:
    """Write ``payload`` as JSON to ``json_path`` and ``table`` as CSV to ``csv_path`` (each when not None;
    folders are created; existing files are replaced). Returns the paths written.

    Raises:
        OSError: a folder cannot be created or a file written.
    """
    out: dict[str, Path] = {}
    if json_path is not None:
        out["json"] = Path(json_path)
        out["json"].parent.mkdir(parents=True, exist_ok=True)
        out["json"].write_text(json.dumps(_clean(payload), indent=2, default=str))
    if csv_path is not None:
        out["csv"] = Path(csv_path)
        out["csv"].parent.mkdir(parents=True, exist_ok=True)
        table.write_csv(out["csv"])
    return out


def schema_dir() -> Path:
    """The JSON Schemas, shipped in the package (``llminfer/benchmark/schemas``; the repository's top-level
    ``schemas/`` links there), so an installed wheel validates too."""
    here = Path(__file__).resolve().parent / "schemas"
    if not here.is_dir():
        raise FileNotFoundError(f"the packaged JSON Schemas are missing ({here})")
    return here


def validate(payload: dict[str, Any], kind: str) -> None:
    """Validate an artifact payload against ``schemas/<kind>.schema.json``.

    Raises:
        jsonschema.ValidationError: the payload does not match.
    """
    import jsonschema

    schema = json.loads((schema_dir() / f"{kind}.schema.json").read_text())
    jsonschema.validate(_clean(payload), schema)
