"""llama.cpp as a benchmark peer on CPU: the bench model as GGUF, ``llama-bench`` and ``llama-server``
next to llminfer at matched precision. Not part of CI; see bench/llamacpp/README.md.

Steps (each skipped with one ``SKIP:`` line where it cannot run):

1. ``build.sh``: llama.cpp from the llama-cpp-python sdist into ``~/.cache/llminfer/llamacpp``;
2. convert the bench model (``bench/common.py``) with the vendored ``convert_hf_to_gguf.py`` to f32 (plus
   f16/bf16 where this CPU computes them natively), then Q8_0 and Q4_0 with ``llama-quantize``;
3. batch-1 decode: ``llama-bench -p 0 -n N`` (tg) per GGUF, and llminfer's batch-1 decode ms/token at the
   matched precision (fp32 vs f32; ``int8-wo`` vs Q8_0 and ``int4-wo`` vs Q4_0 where ``--quant`` has them;
   int4-wo with the 6-bit LM head, as Q4_0 files keep theirs at Q6_K: ``--int4-lm-head``);
   then llama.cpp's own top-1 agreement of Q8_0 and Q4_0 with f32 (``llama-perplexity --kl-divergence``),
   the yardstick for ``bench_quant.py``'s agreement on the same random-weight model;
4. with ``--serve``: ``llama-server -np 32`` and ``llminfer serve`` each under ``llminfer bench-serve`` (64
   requests, prompts 16..256, outputs 16..256, EOS ignored, 32 in flight).

Threads: the idle cores (measured from ``/proc/stat`` over one second, at least 1), because llama.cpp
spin-waits at every op and collapses when its threads are oversubscribed. The load average is recorded
before and after: figures from a loaded machine are not figures from a quiet one.

With ``--gguf PATH`` (a trained model's GGUF, e.g. the built-in SmolLM2-135M-Instruct Q4_1), no conversion of
the bench model: llama.cpp runs that file as it is, and llminfer runs what it loads from it (``--model``: the
same file by default, or the folder it was dequantized to). Rows: batch-1 decode of llama.cpp on the file
against llminfer fp32, int8-wo and int4-wo; top-1 agreement, where ``--model`` is a folder: the folder
converted to an f32 GGUF is the reference (it holds the GGUF's weights dequantized), llama.cpp's agreement
of the file itself with it (what llama.cpp's own quantized matmuls, with 8-bit activations, change), and of
Q8_0 / Q4_0 made from it with ``llama-quantize`` where built, over ``ENGLISH_PASSAGES`` of bench/common.py (the
text of ``bench_quant.py --model``'s agreement, but windowed as llama-perplexity does).

    python bench/llamacpp/peer.py [--tokens 64] [--backends eager,compiled] [--serve] [--json-out PATH]
    python bench/llamacpp/peer.py --gguf model.Q4_1.gguf [--model dequantized-folder] [--tokens 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
CACHE = Path(os.environ.get("LLAMACPP_CACHE", Path.home() / ".cache" / "llminfer" / "llamacpp"))
BIN = CACHE / "build" / "bin"  # build-avx2/bin with --isa avx2 (use_isa)
ISA = "native"
PAIRS = (("float32", "none", "f32"), ("float32", "int8-wo", "q8_0"), ("float32", "int4-wo", "q4_0"))


#: int4-wo's LM head in llminfer's rows (``--int4-lm-head``): matched to Q4_0's Q6_K head by default.
INT4_LM_HEAD = "int6"


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies summed over all CPUs from ``/proc/stat``, None where it cannot be read."""
    from llminfer.benchmark.environment import cpu_jiffies

    j = cpu_jiffies()
    return None if j is None else (j["idle"], j["total"])


def _fmt_pct(pct: float | None) -> str:
    return "n/a" if pct is None else f"{pct:.1f} %"


def idle_cores(sample_s: float = 1.0) -> int:
    """How many cores are idle, at least 1: the CPU count times the idle share of ``/proc/stat`` over
    ``sample_s`` seconds, rounded; else the CPU count less the 1-minute load average. The load average
    alone misleads on some VMs: a kernel thread in uninterruptible sleep keeps it near 1.0 on an idle
    machine."""
    cpus = os.cpu_count() or 1
    before = _cpu_times()
    if before is not None:
        time.sleep(sample_s)
        after = _cpu_times()
        if after is not None and after[1] > before[1]:
            idle_share = (after[0] - before[0]) / (after[1] - before[1])
            return max(1, round(cpus * idle_share))
    return max(1, int(cpus - os.getloadavg()[0]))


def quant_modes() -> set[str]:
    """The ``--quant`` values this llminfer has (``QuantMode``)."""
    from llminfer.config import QuantMode

    return {m.value for m in QuantMode}


def use_isa(isa: str) -> None:
    """Measure the ``isa`` class on this machine: ``avx2`` runs llama.cpp's second build (``ISA=avx2
    build.sh``: no AVX-512, no VNNI) and llminfer's AVX2 kernels (``LLMINFER_CPU_KERNEL_ISA=avx2``, set
    before any kernel loads, and inherited by the servers); ``native`` is each engine's own choice."""
    global BIN, ISA
    ISA = isa
    if isa == "avx2":
        from llminfer.kernels.build import ISA_ENV

        BIN = CACHE / "build-avx2" / "bin"
        os.environ[ISA_ENV] = "avx2"



def build() -> bool:
    out = subprocess.run(["bash", str(HERE / "build.sh")], capture_output=True, text=True,
                         env={**os.environ, "PIP": os.environ.get("PIP", f"{sys.executable} -m pip"), "ISA": ISA})
    lines = out.stdout.strip().splitlines()
    print(lines[-1] if lines else out.stderr.strip()[-500:])
    return out.returncode == 0 and (BIN / "llama-bench").exists()


def convert(model_dir: Path) -> dict[str, Path]:
    """GGUF files of the bench model by type: f32, f16/bf16 where native, q8_0, q4_0.

    Raises:
        SystemExit: a file is to be converted and ``sentencepiece`` (which the vendored converter imports) is
            not installed.
    """
    import importlib.util

    from llminfer.models.loading import cpu_half_support

    out_dir = CACHE / "models"
    out_dir.mkdir(parents=True, exist_ok=True)
    native = cpu_half_support()["native"]
    kinds = ["f32"] + [k for k, half in (("bf16", "bfloat16"), ("f16", "float16")) if native[half]]
    files = {}
    env = {**os.environ, "PYTHONPATH": str(CACHE / "llama.cpp" / "gguf-py")}
    for kind in kinds:
        dest = out_dir / f"{model_dir.name}-{kind}.gguf"
        if not dest.exists():
            if importlib.util.find_spec("sentencepiece") is None:
                raise SystemExit("peer.py: llama.cpp's convert_hf_to_gguf.py needs sentencepiece: "
                                 "pip install 'llminfer[llamacpp-peer]'")
            subprocess.run([sys.executable, str(CACHE / "llama.cpp" / "convert_hf_to_gguf.py"), str(model_dir),
                            "--outtype", kind, "--outfile", str(dest)], check=True, env=env,
                           stdout=subprocess.DEVNULL)
        files[kind] = dest
    print(f"half-precision GGUF: {', '.join(kinds[1:]) or 'none (this CPU has no native bf16/fp16)'}")
    for kind, qtype in (("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        dest = out_dir / f"{model_dir.name}-{kind}.gguf"
        if not dest.exists():
            subprocess.run([str(BIN / "llama-quantize"), str(files["f32"]), str(dest), qtype], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        files[kind] = dest
    return files


_REPACK_CRASHES: dict[Path, bool] = {}


def repack_crashes(gguf: Path) -> bool:
    """Whether llama.cpp's repacked CPU weights (its AMX and interleaved matmuls) crash on a batched step
    of ``gguf`` here: a 16-token ``llama-bench`` prompt pass that dies on a signal. Seen on a Sapphire Rapids
    VM: ``ggml_backend_amx_mul_mat`` takes a general protection fault on Q8_0 and Q4_0 (llama-server and
    llama-perplexity die with it), while batch-1 decode works. Where it crashes, every llama.cpp run of that
    file gets ``--repack 0`` / ``--no-repack`` (printed once)."""
    if gguf not in _REPACK_CRASHES:
        try:
            probe = subprocess.run([str(BIN / "llama-bench"), "-m", str(gguf), "-p", "16", "-n", "0", "-r", "1",
                                    "-t", "1"], capture_output=True, text=True)
        except OSError:  # no llama-bench: nothing to probe with, keep llama.cpp's default
            _REPACK_CRASHES[gguf] = False
            return False
        _REPACK_CRASHES[gguf] = probe.returncode < 0
        if _REPACK_CRASHES[gguf]:
            print(f"note: llama.cpp's repacked weights crash here on {gguf.name} (signal {-probe.returncode} on a "
                  "batched step); running it with --no-repack")
    return _REPACK_CRASHES[gguf]


def llama_bench(gguf: Path, tokens: int, threads: int) -> dict[str, Any]:
    """``llama-bench`` text generation (tg) of ``tokens`` tokens at batch 1: ms per token."""
    repack = ["--repack", "0"] if repack_crashes(gguf) else []
    out = subprocess.run([str(BIN / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens),
                          "-t", str(threads), "-r", "3", "-o", "json", *repack], capture_output=True, text=True,
                         check=True)
    row = json.loads(out.stdout)[0]
    tps = float(row["avg_ts"])
    return {"tok_per_s": tps, "ms_per_token": 1e3 / tps, "threads": threads, "gguf": gguf.name,
            "repack": not repack}


def _no_repack(gguf: Path) -> list[str]:
    return ["--no-repack"] if repack_crashes(gguf) else []


_AGREEMENT_CHUNKS, _AGREEMENT_CTX = 8, 128  # llama-perplexity scores the second half of each chunk


def llamacpp_top1_agreement(base: Path, quant: Path, threads: int, work: Path,
                            text_body: str | None = None) -> dict[str, Any] | None:
    """llama.cpp's own accuracy yardstick for a quantized GGUF: ``llama-perplexity --kl-divergence`` against
    the f32 GGUF over this repository's README (8 chunks of 128 tokens; each chunk scores its second half,
    512 positions; ``text_body`` replaces the README). ``same_top1_pct`` is its "Same top p" (the share of
    positions whose argmax matches f32),
    with the standard error it prints. None (after one ``SKIP:`` line) where ``llama-perplexity`` was not built
    or failed."""
    exe = BIN / "llama-perplexity"
    if not exe.exists():
        print("SKIP: llama.cpp top-1 agreement: llama-perplexity is not built (rerun build.sh)")
        return None
    text = work / "agreement_text.txt"
    text.write_text(text_body if text_body is not None else (HERE.parent.parent / "README.md").read_text() * 2)
    base_kld = work / f"{base.stem}.kld"
    common = ["-f", str(text), "-c", str(_AGREEMENT_CTX), "--chunks", str(_AGREEMENT_CHUNKS), "-t", str(threads),
              "--kl-divergence-base", str(base_kld)]
    try:
        if not base_kld.exists():
            try:
                subprocess.run([str(exe), "-m", str(base), *common, *_no_repack(base)], check=True,
                               capture_output=True)
            except subprocess.CalledProcessError:
                base_kld.unlink(missing_ok=True)  # a partial base file would poison every later comparison
                raise
        out = subprocess.run([str(exe), "-m", str(quant), *common, "--kl-divergence", *_no_repack(quant)],
                             check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        # Seen on a Sapphire Rapids VM (AVX-512, AMX) before repack_crashes(): the --kl-divergence pass over
        # Q8_0 and Q4_0 died with SIGSEGV in llama.cpp's AMX matmul; whatever else fails, the batch-1 rows stay.
        print(f"SKIP: llama.cpp top-1 agreement for {quant.name}: llama-perplexity exited with {exc.returncode}")
        return None
    match = re.search(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)", out.stdout + out.stderr)
    if match is None:
        print("SKIP: llama.cpp top-1 agreement: no 'Same top p' line in llama-perplexity's output")
        return None
    return {"same_top1_pct": float(match.group(1)), "stderr_pct": float(match.group(2)),
            "positions": _AGREEMENT_CHUNKS * _AGREEMENT_CTX // 2, "gguf": quant.name}


def llminfer_decode(model_dir: Path, quant: str, tokens: int, threads: int, backend: str = "eager") -> dict[str, Any]:
    """llminfer's batch-1 decode ms per token (median of 3 runs, fp32), in this process, on ``backend``
    (``eager`` or ``compiled``: the same step under ``torch.compile``, which removes the per-op Python of
    the HF modules; its warm-up run compiles the two shapes a batch-1 run uses)."""
    import statistics

    import torch

    from common import BENCH_VOCAB, random_prompts
    from llminfer import EngineConfig, InferenceEngine
    from llminfer.config import QuantConfig, QuantMode

    torch.set_num_threads(threads)
    head = {"int4_lm_head": INT4_LM_HEAD} if quant == "int4-wo" else {}
    cfg = EngineConfig(model_name=str(model_dir), dtype="float32", device="cpu", max_batch_size=1,
                       batch_timeout_ms=0, quant=QuantConfig(mode=QuantMode(quant), **head), backend=backend)
    tpot = []
    with InferenceEngine(cfg) as engine:
        # Within the model's vocabulary (a --gguf model's may be smaller than the bench model's).
        prompt = random_prompts(1, 8, min(BENCH_VOCAB, len(engine.tokenizer)), seed=1)[0]
        engine.run(prompt, max_new_tokens=4, ignore_eos=True)  # warm-up
        for _ in range(3):
            st = engine.run(prompt, max_new_tokens=tokens, ignore_eos=True).stats
            tpot.append((st.total_latency_ms - st.ttft_ms) / max(1, st.completion_tokens - 1))
    return {"ms_per_token": statistics.median(tpot), "threads": threads, "quant": quant, "backend": backend}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def bench_serve(base_url: str, out: Path) -> dict[str, Any]:
    """The mixed workload through ``llminfer bench-serve``; returns its JSON artifact."""
    subprocess.run([sys.executable, "-m", "llminfer", "bench-serve", "--base-url", base_url, "--num-requests", "64",
                    "--concurrency", "32", "--prompt-len", "16,256", "--output-len", "16,256", "--ignore-eos",
                    "--json-out", str(out), "--overwrite"], check=True)
    return json.loads(out.read_text())


def _output_tokens_per_s(artifact: dict[str, Any]) -> float | None:
    """Output tok/s of a ``bench-serve`` artifact's (only) load point; None for a failed run."""
    points = artifact.get("points") or [{}]
    return points[0].get("summary", {}).get("output_tokens_per_s")


def serve_pair(model_dir: Path, gguf: Path, quant: str, threads: int, work: Path,
               llminfer_first: bool = False) -> dict[str, Any]:
    """``llama-server -np 32`` and ``llminfer serve`` at matched precision, one after the other (llama-server
    first unless ``llminfer_first``)."""
    from llminfer.benchmark.environment import StealMeter

    results = {}
    servers = {
        "llama_server": [str(BIN / "llama-server"), "-m", str(gguf), "-np", "32", "-c", str(32 * 640),
                         "-t", str(threads), "--host", "127.0.0.1", *_no_repack(gguf)],
        "llminfer": [sys.executable, "-m", "llminfer", "serve", "--model", str(model_dir), "--dtype", "float32",
                     "--max-batch-size", "32", "--quant", quant, "--host", "127.0.0.1",
                     *(["--int4-lm-head", INT4_LM_HEAD] if quant == "int4-wo" else [])],
    }
    order = ["llminfer", "llama_server"] if llminfer_first else ["llama_server", "llminfer"]
    for name, cmd in ((n, servers[n]) for n in order):
        port = _free_port()
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)}, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", proc)
            meter = StealMeter()
            results[name] = bench_serve(f"http://127.0.0.1:{port}", work / f"serve_{name}_{quant}_{ISA}.json")
            results[name]["steal_pct"] = meter.pct()
        except (RuntimeError, subprocess.CalledProcessError) as exc:  # the server died, or the workload failed
            print(f"SKIP: serving {quant} on {name}: {exc}")
            results[name] = {"error": str(exc)}
        finally:
            with contextlib.suppress(ProcessLookupError):  # already gone if it crashed
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per batch-1 run")
    ap.add_argument("--backends", type=lambda v: v.split(","), default=["eager", "compiled"],
                    help="llminfer backends for the batch-1 rows, comma-separated (default eager,compiled)")
    ap.add_argument("--serve", action="store_true", help="also the 64-request serving workload on both servers")
    ap.add_argument("--rounds", type=int, default=2, help="with --serve: rounds per pair, the servers' order "
                    "alternating (default 2)")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native", help="avx2: llama.cpp built for "
                    "AVX2/FMA/F16C only and llminfer's AVX2 kernels, to measure that class on a newer CPU")
    ap.add_argument("--no-agreement", action="store_true", help="skip llama.cpp's top-1 agreement rows")
    ap.add_argument("--int4-lm-head", choices=("int6", "int8", "int4"), default="int6",
                    help="int4-wo's LM head (default int6: the 6-bit head of llama.cpp's Q4_0 files, Q6_K)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--gguf", type=Path, default=None, help="a trained model's GGUF: llama.cpp runs this file, "
                    "llminfer what it loads from it (see --model)")
    ap.add_argument("--model", default=None, help="with --gguf: what llminfer loads (default: the GGUF itself; "
                    "a folder of the same weights dequantized also enables the agreement rows)")
    args = ap.parse_args(argv)
    global INT4_LM_HEAD
    INT4_LM_HEAD = args.int4_lm_head
    use_isa(args.isa)
    from llminfer.benchmark.environment import StealMeter

    whole_run = StealMeter()
    payload: dict[str, Any] = {"benchmark": "llamacpp_peer", "loadavg_before": loadavg(), "isa": args.isa,
                               "int4_lm_head": INT4_LM_HEAD}
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        print("SKIP: llama.cpp peer benchmark: cmake or a C++ compiler is missing")
        return {"skipped": "no cmake/compiler"}
    if not build():
        return {"skipped": "build failed"}
    if args.gguf is not None:
        return gguf_main(args, payload)
    from common import bench_model_path, environment

    model_dir = bench_model_path()
    files = convert(model_dir)
    threads = idle_cores()
    have = quant_modes()
    rows = []
    for _dtype, quant, kind in PAIRS:
        if quant not in have:
            print(f"SKIP: llminfer {quant} vs llama.cpp {kind.upper()}: this llminfer has no --quant {quant}")
            continue
        meter = StealMeter()
        peer = llama_bench(files[kind], args.tokens, threads)
        peer["steal_pct"] = meter.pct()
        for backend in args.backends:
            meter.restart()
            ours = llminfer_decode(model_dir, quant, args.tokens, threads, backend)
            ours["steal_pct"] = meter.pct()
            row = {"llminfer": ours, "llamacpp": peer, "kind": kind, "backend": backend,
                   "ratio_llminfer_over_llamacpp_ms": ours["ms_per_token"] / peer["ms_per_token"]}
            rows.append(row)
            print(f"batch-1 decode {quant} ({backend}) vs {kind}: llminfer {ours['ms_per_token']:.1f} ms/token, "
                  f"llama.cpp {peer['ms_per_token']:.1f} ms/token, ratio "
                  f"{row['ratio_llminfer_over_llamacpp_ms']:.2f} ({threads} threads, load {loadavg()}, steal "
                  f"{_fmt_pct(ours['steal_pct'])} of llminfer's run, {_fmt_pct(peer['steal_pct'])} of llama.cpp's)")
    payload["batch1_decode"] = rows
    from llminfer.kernels.build import vector_isa

    payload["llminfer_kernel_isa"] = vector_isa()  # what the runs above used (AVX2 with --isa avx2)
    print(f"llminfer's CPU kernels: {payload['llminfer_kernel_isa']} build; llama.cpp: {BIN.parent.name}")
    work = CACHE / "serve"
    work.mkdir(exist_ok=True)
    agreement = {} if args.no_agreement else {
        kind: llamacpp_top1_agreement(files["f32"], files[kind], threads, work) for kind in ("q8_0", "q4_0")}
    payload["llamacpp_top1_agreement"] = agreement
    for kind, a in agreement.items():
        if a:
            print(f"llama.cpp {kind.upper()} vs f32 top-1 agreement: {a['same_top1_pct']:.1f} ± "
                  f"{a['stderr_pct']:.1f} % over {a['positions']} positions (compare bench_quant.py's)")
    if args.serve:
        payload["serving"] = {}
        for rnd in range(args.rounds):
            for _dtype, quant, kind in PAIRS:
                if quant not in have:
                    continue
                res = serve_pair(model_dir, files[kind], quant, threads, work, llminfer_first=rnd % 2 == 1)
                payload["serving"].setdefault(quant, []).append(res)
                ours, peer = (_output_tokens_per_s(res.get(name, {})) for name in ("llminfer", "llama_server"))
                if ours and peer:
                    print(f"serving {quant}, round {rnd + 1}: llminfer {ours:.1f} output tok/s, llama-server "
                          f"{peer:.1f}, ratio {ours / peer:.2f} (steal {_fmt_pct(res['llminfer']['steal_pct'])} / "
                          f"{_fmt_pct(res['llama_server']['steal_pct'])}, load {loadavg()})")
    payload.update({"loadavg_after": loadavg(), "threads": threads, "environment": environment(),
                    "build_seconds": _build_seconds(), "steal_pct": whole_run.pct()})
    print(f"load average before {payload['loadavg_before']}, after {payload['loadavg_after']}; CPU time stolen "
          f"by the hypervisor over the run: {_fmt_pct(payload['steal_pct'])}")
    if args.json_out:
        args.json_out.write_text(json.dumps(payload, indent=2, default=str))
        print(f"-> {args.json_out}")
    return payload


def _plain_folder(model: Path, work: Path) -> Path:
    """``model`` as convert_hf_to_gguf.py reads it: a folder saved from a dequantized GGUF keeps transformers'
    ``quantization_config`` (``quant_method: gguf``) in config.json, which the converter refuses although the
    weights are plain floats; this links the other files into ``work`` beside a config.json without it."""
    config = json.loads((model / "config.json").read_text())
    if "quantization_config" not in config:
        return model
    plain = work / f"{model.name}-plain"
    plain.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json" and not (plain / f.name).exists():
            (plain / f.name).symlink_to(f.resolve())
    config.pop("quantization_config")
    (plain / "config.json").write_text(json.dumps(config, indent=2))
    return plain


def gguf_main(args: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any]:
    """``--gguf``: llama.cpp on the file as it is, llminfer on what it loads from it (module docstring)."""
    from common import ENGLISH_PASSAGES, environment

    gguf = args.gguf.resolve()
    if not gguf.is_file():
        raise SystemExit(f"--gguf: {gguf} is not a file")
    model = args.model or str(gguf)
    threads = idle_cores()
    peer = llama_bench(gguf, args.tokens, threads)
    rows = []
    for quant in ("none", "int8-wo", "int4-wo"):
        ours = llminfer_decode(Path(model), quant, args.tokens, threads, "eager")
        rows.append({"llminfer": ours, "llamacpp": peer, "kind": gguf.name,
                     "ratio_llminfer_over_llamacpp_ms": ours["ms_per_token"] / peer["ms_per_token"]})
        print(f"batch-1 decode llminfer {quant} vs llama.cpp on {gguf.name}: {ours['ms_per_token']:.1f} vs "
              f"{peer['ms_per_token']:.1f} ms/token ({threads} threads, load {loadavg()})")
    payload["batch1_decode"] = rows
    agreement: dict[str, Any] = {}
    if Path(model).is_dir():
        work = CACHE / "gguf"
        work.mkdir(parents=True, exist_ok=True)
        f32 = work / f"{Path(model).name}-f32.gguf"
        if not f32.exists():
            env = {**os.environ, "PYTHONPATH": str(CACHE / "llama.cpp" / "gguf-py")}
            subprocess.run([sys.executable, str(CACHE / "llama.cpp" / "convert_hf_to_gguf.py"),
                            str(_plain_folder(Path(model), work)),
                            "--outtype", "f32", "--outfile", str(f32)], check=True, env=env,
                           stdout=subprocess.DEVNULL)
        files = {gguf.name: gguf}
        for kind, qtype in (("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
            dest = work / f"{Path(model).name}-{kind}.gguf"
            if not dest.exists() and (BIN / "llama-quantize").exists():
                subprocess.run([str(BIN / "llama-quantize"), str(f32), str(dest), qtype], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if dest.exists():
                files[kind] = dest
        text = "\n\n".join(ENGLISH_PASSAGES) * 3
        for name, file in files.items():
            agreement[name] = llamacpp_top1_agreement(f32, file, threads, work, text)
            if agreement[name]:
                print(f"llama.cpp {name} vs the f32 GGUF of {Path(model).name}: top-1 agreement "
                      f"{agreement[name]['same_top1_pct']:.1f} ± {agreement[name]['stderr_pct']:.1f} % "
                      "(compare bench_quant.py --model's rows)")
    else:
        print("SKIP: llama.cpp top-1 agreement: --model is not a folder of the dequantized weights")
    payload.update({"gguf": str(gguf), "llminfer_model": model, "llamacpp_top1_agreement": agreement,
                    "loadavg_after": loadavg(), "threads": threads, "environment": environment()})
    if args.json_out:
        args.json_out.write_text(json.dumps(payload, indent=2, default=str))
        print(f"-> {args.json_out}")
    return payload


def _build_seconds() -> float | None:
    try:
        return float((BIN.parent / "build_seconds.txt").read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    main()
