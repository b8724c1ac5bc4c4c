"""The backend registry (one spec per backend, its builders resolvable, its capability flags) and the
step-backend envelope (StepBackend.execute) on a stand-in model: no model is loaded here."""

from __future__ import annotations

import pytest
import torch

from llminfer.backends import base as base_mod
from llminfer.backends.base import StepBackend, StepResult
from llminfer.backends.packing import PackedStep
from llminfer.backends.registry import BACKENDS, Backend, backend_spec, backends_with, resolve
from llminfer.config import Backend as ConfigBackend
from llminfer.protocols.messages import NewRequestData, ScheduledSequence, SchedulerOutput
from llminfer.sampling.params import SamplingParams


def test_every_backend_has_one_spec_whose_builders_resolve():
    assert ConfigBackend is Backend  # the config's enum is the registry's
    assert set(BACKENDS) == set(Backend)
    for backend, spec in BACKENDS.items():
        assert spec.backend is backend and backend_spec(backend.value) is spec
        assert callable(spec.build) and callable(spec.build_core)
        if spec.availability is not None:
            assert callable(resolve(spec.availability))


def test_capabilities_are_read_from_the_specs():
    assert backends_with("multi_device") == ["vllm"]
    assert backends_with("speculative") == ["eager"]
    assert backends_with("cpu_fast_path") == ["eager", "compiled"]
    assert backends_with("compiles") == ["compiled"]
    assert backend_spec("vllm").external_engine and not backend_spec("vllm").needs_kv_manager
    assert backend_spec(Backend.EAGER).needs_kv_manager
    with pytest.raises(ValueError):
        backend_spec("no-such-backend")


def test_resolve_names_a_module_and_an_attribute_path():
    assert resolve("llminfer.backends.registry:BackendSpec.needs_kv_manager") is not None
    with pytest.raises(AttributeError):
        resolve("llminfer.backends.registry:NoSuchThing")


def test_packed_step_rows_with_drafts():
    plan = SchedulerOutput(1, (ScheduledSequence("a", (1, 2, 3), 0, (0,), sample=True),
                               ScheduledSequence("b", (7,), 5, (1,), sample=True, num_lookahead=2),
                               ScheduledSequence("c", (4, 4), 0, (2,), sample=False)))
    step = PackedStep.from_plan(plan, {}, {"b": [8, 9]})
    assert step.tokens == ((1, 2, 3), (7, 8, 9), (4, 4)) and step.num_tokens == 8
    assert step.sample_rows == (2, 3, 4, 5)  # a's last row; b's scheduled row and its two drafts
    assert not step.is_pure_decode and step.keep_rows == [2, 3, 4, 5]


class _Echo(StepBackend):
    """Samples each sequence's last token back; fails the step on demand."""

    name = "echo"

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(1, 1), cache=None)
        self.fail_step = False
        self.seen: list[tuple[str, ...]] = []

    def run_step(self, plan: SchedulerOutput) -> StepResult:
        self.seen.append(tuple(s.request_id for s in plan.sequences))
        if self.fail_step:
            raise RuntimeError("the forward pass failed")
        return StepResult(sampled={s.request_id: s.token_ids[-1] for s in plan.sequences if s.sample})


def _plan(step_id: int, *ids: str) -> SchedulerOutput:
    seqs = tuple(ScheduledSequence(rid, (i + 1,), 0, (i,), sample=True) for i, rid in enumerate(ids))
    news = tuple(NewRequestData(rid, SamplingParams(), (i + 1,)) for i, rid in enumerate(ids))
    return SchedulerOutput(step_id, seqs, news)


def test_execute_leaves_out_a_request_whose_state_cannot_be_built(monkeypatch):
    real = base_mod.SamplingState

    def state(params, device, prompt, *rest):
        if prompt == (2,):
            raise ValueError("no matcher for this grammar")
        return real(params, device, prompt, *rest)

    monkeypatch.setattr(base_mod, "SamplingState", state)
    backend = _Echo()
    out = backend.execute(_plan(1, "ok", "bad"))
    assert out.error is None and out.sampled == {"ok": 1}
    assert isinstance(out.failed["bad"], ValueError) and backend.seen == [("ok",)]
    assert set(backend.states) == {"ok"} and backend.num_steps == 1


def test_execute_returns_a_failed_step_as_its_error_and_never_raises():
    backend = _Echo()
    backend.fail_step = True
    out = backend.execute(_plan(3, "x"))
    assert isinstance(out.error, RuntimeError) and out.sampled == {} and out.step_id == 3
    backend.fail_step = False
    out = backend.execute(SchedulerOutput(4, (), finished_request_ids=("x",)))
    assert out.error is None and backend.states == {}  # released; an empty plan runs no step
