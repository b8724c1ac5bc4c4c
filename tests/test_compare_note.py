"""``compare``: a row where the compiled backend is slower than eager at the same batch gets a printed note."""

from __future__ import annotations

from types import SimpleNamespace

from llminfer.benchmark.runner import ComparisonResult, slower_than_eager


def _result(tps: dict[int, float]) -> SimpleNamespace:
    return SimpleNamespace(configs=[{"batch_size": b, "output_tokens_per_s": v} for b, v in tps.items()])


def test_a_note_for_each_batch_where_compiled_is_slower():
    res = ComparisonResult({"eager": _result({1: 40.0, 8: 280.0, 32: 550.0}),
                            "compiled": _result({1: 50.0, 8: 30.0, 32: 549.0})}, {}, {})
    notes = slower_than_eager(res)
    assert len(notes) == 2
    assert notes[0].startswith("compiled is slower than eager at batch 8 (30.0 vs 280.0") and "x0.11" in notes[0]
    assert "batch 32" in notes[1]
    assert slower_than_eager(ComparisonResult({"compiled": _result({1: 1.0})}, {}, {})) == []
