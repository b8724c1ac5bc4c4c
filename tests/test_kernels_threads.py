"""llminfer's own worker threads for the kernels' parallel loops (``csrc/thread_pool.h``): the same bits as
torch's OpenMP team, correct when two threads call at once, after the workers fall asleep, and in a forked
child; and the switch between the two (:func:`llminfer.kernels.build.use_kernel_thread_pool`)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kernels_common import kernel_loaded, pytestmark  # noqa: F401  (the skip and the autouse fixture)
from llminfer.kernels import build
from llminfer.kernels.linear import int8_linear, skinny_linear


@pytest.fixture
def pool_on():
    previous = build.use_kernel_thread_pool(True)
    yield
    build.use_kernel_thread_pool(previous)


def _cases(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for m in (1, 3, 8, 33):
        # 4096 x 512 fp32 is 8 MiB: enough tiles for every thread
        yield (torch.randn(m, 512, generator=g), torch.randn(4096, 512, generator=g), torch.randn(4096, generator=g))


def test_the_workers_give_the_same_bits_as_openmp(pool_on):
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # the loops must really split, even on a 1-core runner
    try:
        for x, w, b in _cases():
            q = (w * 20).round().clamp(-127, 127).to(torch.int8)
            scale = torch.rand(w.shape[0]) / 50
            build.use_kernel_thread_pool(False)
            openmp = (skinny_linear(x, w, None, b), int8_linear(x, q, scale, b))
            build.use_kernel_thread_pool(True)
            ours = (skinny_linear(x, w, None, b), int8_linear(x, q, scale, b))
            for a, c in zip(openmp, ours):
                assert torch.equal(a, c)
            assert build.kernel_threads() == "llminfer"
    finally:
        torch.set_num_threads(threads)


def test_two_threads_calling_at_once_both_get_their_own_results(pool_on):
    cases = list(_cases(1))
    expected = [skinny_linear(x, w, None, b) for x, w, b in cases]
    errors: list[str] = []

    def work(offset: int) -> None:
        for i in range(60):
            j = (i + offset) % len(cases)
            x, w, b = cases[j]
            if not torch.equal(skinny_linear(x, w, None, b), expected[j]):
                errors.append(f"thread {offset} call {i}")

    runners = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in runners:
        t.start()
    for t in runners:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in runners), "a kernel call hung"
    assert errors == []


def test_loops_after_the_workers_fell_asleep_still_run(pool_on):
    x, w, b = next(_cases(2))
    expected = skinny_linear(x, w, None, b)
    for _ in range(5):
        time.sleep(0.005)  # longer than the workers' 2 ms of spinning: each call must wake them
        assert torch.equal(skinny_linear(x, w, None, b), expected)


def test_a_forked_child_runs_the_loops_on_workers_of_its_own(pool_on):
    x, w, b = next(_cases(3))
    expected = skinny_linear(x, w, None, b)  # the parent's workers exist now
    pid = os.fork()
    if pid == 0:  # the child: its parent's workers are gone
        ok = False
        try:
            outs = []
            for _ in range(3):
                # torch sets a forked child to 1 thread; 2 make the loop split onto the pool's workers
                torch.set_num_threads(2)
                outs.append(skinny_linear(x, w, None, b))
                torch.set_num_threads(1)  # torch's own ops stay off the parent's OpenMP team here
            ok = all(torch.equal(out, expected) for out in outs)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's kernel call hung (it waited for its parent's workers)")
    assert os.WEXITSTATUS(done[1]) == 0


def test_the_switch_reports_and_restores_its_setting(pool_on):
    assert build.use_kernel_thread_pool(False) is True
    assert build.kernel_threads() == "openmp"
    assert build.use_kernel_thread_pool(True) is False
    assert build.kernel_threads() == "llminfer"
