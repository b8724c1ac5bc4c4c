"""Compare llminfer's eager backend with vLLM on the same prompts and settings.

Where vLLM is not installed (or there is no GPU), the vLLM row is reported as skipped with the reason and
the eager numbers are still printed — the script never fails for that.

    python examples/benchmark_vs_vllm.py [MODEL] [--artifacts-dir DIR]

MODEL defaults to the built-in tiny model; with a GPU and `pip install 'llminfer[vllm]'`, try
`Qwen/Qwen2.5-0.5B-Instruct`.
"""

from __future__ import annotations

import argparse

from llminfer import EngineConfig
from llminfer.benchmark import BackendComparison


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--artifacts-dir", default=None)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    comparison = BackendComparison(args.model, ["eager", "vllm"], EngineConfig(max_batch_size=max(sizes)))
    results = comparison.run(batch_sizes=sizes, num_runs=1, max_new_tokens=args.max_new_tokens)
    BackendComparison.print_table(results)
    if args.artifacts_dir:
        print(results.save_artifacts(args.artifacts_dir))
    return results


if __name__ == "__main__":
    main()
