"""Compare llminfer's eager backend with vLLM on the same prompts and settings.

Where vLLM is not installed (or there is no GPU), the vLLM row is reported as skipped with the reason and
the eager numbers are still printed — the script never fails for that.

    python examples/benchmark_vs_vllm.py --model M --batch-sizes 1,2,4,8 --runs 5 --continuous --outdir DIR

MODEL defaults to the built-in tiny model; with a GPU and `pip install 'llminfer[vllm]'`, try
`Qwen/Qwen2.5-0.5B-Instruct`. Latency percentiles are over every request of every measured run, throughput
is the median over runs with its min and max, memory is per backend and batch size (its kind is printed).
With --outdir, DIR gets comparison.json, comparison.csv and comparison.png (a fresh timestamped subfolder
of DIR when those exist there already, unless --overwrite).
"""

from __future__ import annotations

import argparse
import sys

from llminfer import EngineConfig
from llminfer.benchmark import BackendComparison
from llminfer.benchmark.artifacts import fresh_folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="same as --model")
    ap.add_argument("--model", "-m", default=None, help="Hugging Face model id or local folder")
    ap.add_argument("--backends", default="eager,vllm", help="comma-separated: eager,compiled,vllm")
    ap.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--runs", type=int, default=2, help="measured runs per batch size (after warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up runs per batch size (not measured)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens per synthetic prompt")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--continuous", dest="continuous", action="store_true", default=True,
                      help="continuous batching (the default)")
    mode.add_argument("--static", dest="continuous", action="store_false", help="static batches")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--revision", default=None, help="model revision (branch, tag or commit)")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub")
    ap.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (vllm only)")
    ap.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel size (vllm only)")
    ap.add_argument("--outdir", "--artifacts-dir", dest="outdir", default=None,
                    help="write comparison.json / .csv / .png here")
    ap.add_argument("--overwrite", action="store_true", help="replace files in --outdir")
    args = ap.parse_args(argv)
    if args.model and args.model_arg and args.model != args.model_arg:
        ap.error(f"two models given: {args.model_arg!r} and --model {args.model!r}")
    args.model = args.model or args.model_arg
    try:
        args.sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    return args


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    config = EngineConfig(dtype=args.dtype, device=args.device, max_batch_size=max(args.sizes or [1]),
                          hf_revision=args.revision, hf_trust_remote_code=args.trust_remote_code,
                          tp_size=args.tp_size, pp_size=args.pp_size)
    comparison = BackendComparison(args.model, args.backends.split(","), config)
    results = comparison.run(batch_sizes=args.sizes, num_runs=args.runs, max_new_tokens=args.max_new_tokens,
                             warmup=args.warmup, prompt_len=args.prompt_len, continuous=args.continuous,
                             progress=lambda label: print(f"... {label}", file=sys.stderr, flush=True))
    BackendComparison.print_table(results)
    if args.outdir and results.results:
        names = ["comparison.json", "comparison.csv", "comparison.png"]
        folder = fresh_folder(args.outdir, names, overwrite=args.overwrite)  # never replaces earlier results
        paths = results.save_artifacts(folder, overwrite=True)
        png = BackendComparison.plot(results, folder / "comparison.png")
        print("wrote:", *paths.values(), png)
    return results


if __name__ == "__main__":
    main()
