"""The CPU decode step's pieces: NumPy argmax == torch argmax, the oneDNN-prepacked fp32 LM head (or the
column-major fallback), the step
profile's arithmetic (bench/bench_step_profile.py) and the llama.cpp peer script's skip path."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llminfer.kernels.build import skinny_linear_available
from llminfer.kernels.prepack import (
    FP32_HEAD_KERNEL_MAX_ROWS,
    PrepackedLinear,
    prepack_lm_head,
    prepack_supported,
    transpose_linear_weight,
)
from llminfer.sampling.sampler import argmax_rows

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_argmax_rows_matches_torch_on_ties_infinities_and_nan():
    torch.manual_seed(0)
    x = torch.randn(6, 1000)
    x[1, 10] = x[1, 700] = 50.0          # a tie: the first index wins in both
    x[2] = float("-inf")
    x[2, 999] = 0.0                       # everything else banned
    x[3, 5] = float("nan")                # NaN counts as the maximum in both
    x[4, :] = 1.0                         # all equal
    cols = x[:, ::2]                      # a strided view
    for t in (x, cols, x.to(torch.bfloat16), x[:, :1]):
        assert argmax_rows(t) == t.argmax(dim=-1).tolist()


def _tied_head():
    torch.manual_seed(0)
    emb = nn.Embedding(300, 16)
    head = nn.Linear(16, 300, bias=False)
    head.weight = emb.weight                      # tied, like Qwen2-0.5B

    class Tiny(nn.Module):
        def get_output_embeddings(self):
            return head

        def set_output_embeddings(self, new):
            nonlocal head
            head = new

    return emb, head, Tiny()


def test_column_major_head_keeps_values_and_ties():
    emb, head, _ = _tied_head()
    x, ids = torch.randn(3, 16), torch.tensor([0, 7, 299])
    before, rows = F.linear(x, head.weight), emb(ids)
    param = head.weight
    assert transpose_linear_weight(head)
    assert head.weight is param and emb.weight is param and param.t().is_contiguous()
    torch.testing.assert_close(F.linear(x, head.weight), before)
    assert torch.equal(emb(ids), rows)
    assert not transpose_linear_weight(head)      # already column-major: left alone


@pytest.mark.skipif(not prepack_supported(torch.float32, torch.device("cpu")), reason="no oneDNN")
def test_fp32_head_is_prepacked_for_onednn_and_keeps_values_and_ties():
    emb, head, model = _tied_head()
    x, ids = torch.randn(3, 16), torch.tensor([0, 7, 299])
    before, rows = F.linear(x, head.weight), emb(ids)
    assert prepack_lm_head(model)
    packed = model.get_output_embeddings()
    assert isinstance(packed, PrepackedLinear) and packed.weight is emb.weight
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), before)
    assert packed._packed is not None             # the oneDNN path ran, not the F.linear fallback
    assert torch.equal(emb(ids), rows)


def test_fp32_head_without_onednn_falls_back_to_column_major(monkeypatch):
    import llminfer.kernels.prepack as prepack

    monkeypatch.setattr(prepack, "prepack_supported", lambda dtype, device: False)
    _, head, model = _tied_head()
    assert prepack_lm_head(model)
    assert model.get_output_embeddings() is head and head.weight.t().is_contiguous()


def test_fp32_engine_prepacks_its_head(qwen2_dir):
    from helpers import make_engine

    with make_engine(qwen2_dir) as engine:  # float32 on CPU
        head = engine.model.get_output_embeddings()
        if prepack_supported(torch.float32, torch.device("cpu")):
            assert isinstance(head, PrepackedLinear) and engine.runtime.lm_head_prepacked
            # one or two rows (batch-1 decode) read the plain weight on llminfer's kernel
            assert head.kernel_rows == (FP32_HEAD_KERNEL_MAX_ROWS if skinny_linear_available() else 0)
        else:
            assert head.weight.t().is_contiguous()


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bandwidth_floor_and_step_split_arithmetic():
    prof = _load("bench_step_profile")
    assert prof.bandwidth_floor_ms(458e6, 10e9) == pytest.approx(45.8)
    with pytest.raises(ValueError, match="positive"):
        prof.bandwidth_floor_ms(1.0, 0.0)
    parts = {"forward": 0.040, "linear_attn": 0.005, "linear_mlp": 0.010, "lm_head": 0.015, "attention": 0.004,
             "metadata": 0.001, "sampling": 0.002}
    split = prof.split_from_timings(parts, execute_s=0.045, period_s=0.050)
    assert split["model_other"] == pytest.approx(6.0) and split["backend_other"] == pytest.approx(2.0)
    assert split["overhead"] == pytest.approx(5.0)
    assert sum(split[k] for k in prof.PARTS) == pytest.approx(50.0)  # the parts add up to the period


def test_step_profile_times_every_part_of_a_real_step():
    """The profile's timers sit where the eager step calls them (metadata in ``backends.packing``, sampling in
    ``backends.base``, attention through transformers' registry): a module move that leaves a timer
    unhooked shows as a zero part here, and removing the timers restores the originals."""
    from llminfer import EngineConfig, InferenceEngine
    from llminfer.backends import base, packing
    from llminfer.backends.decoder_loop import uses_decoder_loop
    from llminfer.models.builtin import builtin_model_path

    prof = _load("bench_step_profile")
    originals = (packing.build_metadata, packing.forward_logits, base.sample)
    cfg = EngineConfig(model_name=str(builtin_model_path()), dtype="float32", max_batch_size=2, batch_timeout_ms=0)
    with InferenceEngine(cfg) as engine:
        for loop in (True, False):  # llminfer's decoder loop, then transformers' forward (--before-after)
            with (prof.without_decoder_loop(engine) if not loop else nullcontext()), prof.timers(engine, True) as t:
                assert uses_decoder_loop(engine.backend.model) is loop
                engine.run_batch_continuous(["a b c", "d e"], max_new_tokens=4, ignore_eos=True)
                rows = t.decode_rows(2)
            assert rows, "no decode step of two sequences was timed"
            for part in ("linear_attn", "linear_mlp", "lm_head", "attention", "metadata", "sampling", "model_other"):
                assert all(r[part] > 0 for r in rows), (loop, part, rows)
        assert uses_decoder_loop(engine.backend.model)
    assert (packing.build_metadata, packing.forward_logits, base.sample) == originals


def test_llamacpp_script_skips_with_one_line_without_cmake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "env", "dirname", "cut", "ls"):  # what the script needs before its cmake check
        real = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if real:
            os.symlink(real, bin_dir / tool)
    proc = subprocess.run([str(bin_dir / "bash"), str(BENCH / "llamacpp" / "build.sh")], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(bin_dir), "LLAMACPP_CACHE": str(tmp_path / "c")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("SKIP: llama.cpp peer benchmark: 'cmake' not found"), proc.stdout
    assert not (tmp_path / "c").exists()  # nothing downloaded or built


def test_llamacpp_agreement_reads_same_top_p(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("peer", BENCH / "llamacpp" / "peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    monkeypatch.setattr(peer, "BIN", tmp_path)
    base, quant = tmp_path / "m-f32.gguf", tmp_path / "m-q8_0.gguf"
    assert peer.llamacpp_top1_agreement(base, quant, 1, tmp_path) is None  # llama-perplexity not built
    fake = tmp_path / "llama-perplexity"  # writes the base file when asked for it, else prints the statistics
    fake.write_text('#!/bin/bash\nfor a in "$@"; do [[ $a == --kl-divergence ]] && { '
                    'echo "Same top p: 92.262 ± 1.191 %"; exit 0; }; done\n'
                    'while [[ $1 != --kl-divergence-base ]]; do shift; done; touch "$2"\n')
    fake.chmod(0o755)
    got = peer.llamacpp_top1_agreement(base, quant, 1, tmp_path)
    assert got == {"same_top1_pct": 92.262, "stderr_pct": 1.191, "positions": 512, "gguf": "m-q8_0.gguf"}
    assert (tmp_path / "m-f32.kld").exists()


def test_llamacpp_repack_probe(tmp_path, monkeypatch, capsys):
    """A GGUF whose batched prompt pass dies on a signal (llama.cpp's AMX matmul on some VMs) runs with
    ``--no-repack``; one that passes, or no llama-bench at all, keeps llama.cpp's default."""
    spec = importlib.util.spec_from_file_location("peer", BENCH / "llamacpp" / "peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    monkeypatch.setattr(peer, "BIN", tmp_path)
    assert not peer.repack_crashes(tmp_path / "absent.gguf")
    fake = tmp_path / "llama-bench"
    fake.write_text('#!/bin/bash\n[[ $2 == *q8_0* ]] && kill -SEGV $$\nexit 0\n')
    fake.chmod(0o755)
    assert peer._no_repack(tmp_path / "m-q8_0.gguf") == ["--no-repack"]
    assert "crash here on m-q8_0.gguf (signal 11" in capsys.readouterr().out
    assert peer._no_repack(tmp_path / "m-f32.gguf") == []


def test_llamacpp_peer_isa_avx2_uses_the_second_build_and_the_avx2_kernels(monkeypatch, tmp_path):
    """``peer.py --isa avx2``: llama.cpp from ``build-avx2`` (``ISA=avx2 build.sh``) and llminfer's kernels
    forced to AVX2 through the environment its servers inherit."""
    from llminfer.kernels.build import ISA_ENV

    spec = importlib.util.spec_from_file_location("peer", BENCH / "llamacpp" / "peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    monkeypatch.delenv(ISA_ENV, raising=False)
    peer.use_isa("native")
    assert peer.BIN.parent.name == "build" and ISA_ENV not in os.environ
    monkeypatch.setenv(ISA_ENV, "")  # restored (removed) after the test
    peer.use_isa("avx2")
    assert peer.BIN.parent.name == "build-avx2" and os.environ[ISA_ENV] == "avx2" and peer.ISA == "avx2"
    bad = subprocess.run(["bash", str(BENCH / "llamacpp" / "build.sh")], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "ISA": "sse2", "LLAMACPP_CACHE": str(tmp_path / "c")})
    if "SKIP:" not in bad.stdout:  # without cmake the script stops at its first check
        assert bad.returncode == 2 and "ISA must be native or avx2" in bad.stderr
    assert not (tmp_path / "c").exists()  # refused before anything was downloaded or built


def test_steal_meter_reports_the_stolen_share(monkeypatch):
    """``StealMeter`` (recorded by the CPU benchmarks): steal jiffies over all jiffies between two reads of
    ``/proc/stat``, None where it cannot be read or no time passed; ``cpu_jiffies`` parses the real file."""
    from llminfer.benchmark import environment as env

    real = env.cpu_jiffies()
    if os.path.exists("/proc/stat"):
        assert real is not None and real["total"] >= real["idle"] + real["steal"] >= 0
    reads = iter([{"idle": 0, "steal": 10, "total": 1000}, {"idle": 0, "steal": 40, "total": 1200},
                  {"idle": 0, "steal": 40, "total": 1200}, None])
    monkeypatch.setattr(env, "cpu_jiffies", lambda: next(reads))
    meter = env.StealMeter()
    assert meter.pct() == pytest.approx(15.0)  # 30 of 200 ticks
    meter.restart()
    assert meter.pct() is None  # no time passed (and then unreadable)
