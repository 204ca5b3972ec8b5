"""shardkit.run.verify: the plan of each case is decided and checked once, and a bad case is
named before anything compiles."""

from __future__ import annotations

import pytest

import vit_ref
from shardkit.mesh import Plan, PlanError
from shardkit.models.vit import plan as vit_plan
from shardkit.run import verify

CFG = vit_ref.ViTConfig(
    image=8, patch=4, channels=3, classes=5, dim=16, depth=2, heads=4, mlp_dim=32, pool="tok"
)


def test_each_case_checks_its_plan_once(monkeypatch) -> None:
    """Building the model, its contract (per pipeline stage too) and the run share one check."""
    checked = []
    real = vit_plan._model_checks

    def counting(cfg, plan):
        checked.append(plan)
        return real(cfg, plan)

    monkeypatch.setattr(vit_plan, "_model_checks", counting)
    cases = [
        verify.Case("DP×TP", Plan({"data": 2, "model": 2})),
        verify.Case("PP", Plan({"stage": 2, "data": 2}, pp="1f1b", microbatches=2)),
    ]
    lines = []
    assert verify.run_cases(CFG, cases, 4, echo=lambda *a, **_: lines.append(a))
    assert [p for p in checked] == [case.plan for case in cases]


def test_a_bad_case_is_named_before_anything_runs() -> None:
    cases = [
        verify.Case("DP", Plan({"data": 2})),
        verify.Case("TP over 3", Plan({"model": 3})),
    ]
    with pytest.raises(PlanError, match="heads=4 is not divisible by model=3"):
        verify.prepare(CFG, cases, 4)
