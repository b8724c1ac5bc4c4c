"""Who serves and who measures, for a serving benchmark's artifact: :func:`probe_server` asks the server
about itself (models, kind, version) and :func:`client_environment` describes the load generator.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


def _kind_from(*hints: str | None) -> str | None:
    """The server's kind from ``owned_by`` / the ``server`` header / an ``/info`` router name (lower case)."""
    text = " ".join(str(h).lower() for h in hints if h)
    for needle, kind in _KINDS:
        if needle in text:
            return kind
    return None


# Substrings of what each server puts in ``owned_by``, its ``server`` header or ``/info`` (first match wins).
_KINDS = (("llminfer", "llminfer"), ("vllm", "vllm"), ("llamacpp", "llama.cpp"), ("llama.cpp", "llama.cpp"),
          ("text-generation", "tgi"), ("tgi", "tgi"), ("sglang", "sglang"), ("ollama", "ollama"))


async def _json_get(client: Any, path: str) -> tuple[Any, Any]:
    """``(json, response)`` of ``GET path``; ``(None, response or None)`` on any failure (a probe, never fatal)."""
    try:
        resp = await client.get(path, timeout=5.0)
    except Exception:  # noqa: BLE001 - an optional endpoint
        return None, None
    if resp.status_code != 200:
        return None, resp
    try:
        return resp.json(), resp
    except ValueError:
        return None, resp


async def probe_server(client: Any, base_url: str, model: str | None) -> dict[str, Any]:
    """What the server says about itself: its models (``GET /v1/models``), the model to benchmark, its
    ``server`` header, and its kind and version where an endpoint tells (``/version``: vLLM, llminfer;
    ``/info``: TGI; ``/props``: llama.cpp). Unknown fields are None.

    Raises:
        httpx.HTTPError: ``model`` is None and ``/v1/models`` cannot be read.
        ValueError: ``model`` is None and the server lists no model.
    """
    info: dict[str, Any] = {"base_url": base_url, "model": model, "models": [], "owned_by": None,
                            "server_header": None, "kind": None, "version": None}
    if model is None:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        listing = resp.json()
    else:
        listing, resp = await _json_get(client, "/v1/models")
    if resp is not None:
        info["server_header"] = resp.headers.get("server")
    cards = [c for c in (listing or {}).get("data") or () if isinstance(c, dict) and "id" in c] \
        if isinstance(listing, dict) else []
    info["models"] = [str(c["id"]) for c in cards]
    if model is None:
        if not cards:
            raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
        info["model"] = str(cards[0]["id"])
    card = next((c for c in cards if c["id"] == info["model"]), cards[0] if cards else {})
    info["owned_by"] = card.get("owned_by")
    info["kind"] = _kind_from(info["owned_by"], info["server_header"])
    version, _ = await _json_get(client, "/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        info["version"] = version["version"]
    if info["version"] is None and info["kind"] in (None, "tgi"):
        tgi, _ = await _json_get(client, "/info")
        if isinstance(tgi, dict) and isinstance(tgi.get("version"), str):
            info["version"] = tgi["version"]
            if info["kind"] is None and ("model_id" in tgi or "router" in tgi):  # TGI's /info fields
                info["kind"] = "tgi"
    if info["version"] is None and info["kind"] == "llama.cpp":
        props, _ = await _json_get(client, "/props")
        if isinstance(props, dict) and props.get("build_info"):
            info["version"] = str(props["build_info"])
    info["kind"] = info["kind"] or "unknown"
    return info

def client_environment() -> dict[str, Any]:
    """The load generator's environment, in the fields of :func:`llminfer.benchmark.environment.environment`
    without importing torch or transformers (the client uses neither: their versions come from the
    installed packages' metadata, and ``cuda`` / ``gpu`` are None). ``side`` says it is the client's."""
    import os
    import platform
    import subprocess
    from importlib import metadata

    import llminfer

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.lower().startswith("model name")), cpu)
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {"side": "client", "python": platform.python_version(), "platform": platform.platform(),
            "torch": version("torch"), "cuda": None, "gpu": None, "cpu": cpu, "cpu_count": os.cpu_count(),
            "transformers": version("transformers"), "llminfer": llminfer.__version__, "git_revision": rev}
