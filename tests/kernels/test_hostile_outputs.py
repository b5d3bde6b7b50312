"""Hostile candidates the judge must catch, measured with the judge directly: int8-quantized
expert weights (fused_moe; the tolerance scales with the output's rms), a forged clock that
reports NaN, and outputs returned as a namedtuple (the dense-output rule walks tuple
subclasses too). The files of the fused_moe candidates are under ``tests/kernels/hostile/``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from candidate_helpers import check_row, measure, write
from workflow_helpers import REPO

from kb_nano.kernels.manifest import generate

pytestmark = pytest.mark.usefixtures("_worker_pool")

HOSTILE = Path(__file__).resolve().parent / "hostile"


@pytest.fixture(scope="module")
def moe_scenario() -> dict:
    """Qwen3-30B-A3B's fused_moe at TP 4 and 4 tokens: real shapes (128 experts, 2048 x 192
    per rank), a 300 MB block."""
    (s,) = generate(["qwen3-30b-a3b"], [4], [4], "auto", REPO, targets=["fused_moe"])["scenarios"]
    return s


def test_int8_quantized_moe_weights_are_incorrect_and_the_shipped_candidate_passes(tmp_path, moe_scenario, settings):
    """An absolute atol of 0.02 was half the rms of fused_moe's outputs (~0.04): weights
    quantized to int8 passed. The atol now scales with the reference's rms."""
    tol = {**settings, "atol": None, "rtol": None}  # the operator's own tolerance
    row = check_row(
        measure(moe_scenario, "fused_moe/int8_weights", HOSTILE / "fused_moe/int8_weights.py", tol, tmp_path),
        "incorrect",
    )
    assert "min(1, rms(ref))" in row["error"], row["error"]
    shipped = sorted((REPO / "candidates/fused_moe").glob("[!_]*.py"))
    assert shipped
    for path in shipped:
        check_row(measure(moe_scenario, f"fused_moe/{path.stem}", path, tol, tmp_path), "passed")


def test_nan_times_from_a_forged_clock_are_unsynced_work(tmp_path, scenarios, settings):
    """A candidate that switches its worker's guard off and makes the clock its worker reads
    return NaN: every statistic and the clock cross-check compare with NaN (always false),
    so the row passed. Times that are not finite and non-negative end the measurement."""
    path = write(
        tmp_path / "candidates/rms_norm/nan_clock.py",
        """
        import gc
        import sys

        import torch
        import torch.nn.functional as F
        from torch import nn

        for obj in gc.get_objects():
            if type(obj).__name__ == "Side" and type(obj).__module__ == "kb_nano.kernels.worker":
                obj.guard = None
        sys.modules["kb_nano.kernels.timing"]._perf_counter_ns = lambda: float("nan")


        class NanClock(nn.Module):
            def __init__(self, hidden_size, eps=1e-6):
                super().__init__()
                self.hidden_size, self.variance_epsilon = hidden_size, eps
                self.weight = nn.Parameter(torch.ones(hidden_size))

            def forward(self, x, residual=None):
                return F.rms_norm(x.float(), (self.hidden_size,), None, self.variance_epsilon).to(x.dtype) * self.weight
        """,
    )
    scenario = scenarios["rms_norm__llama32-1b__tp1__n4"]
    row = check_row(measure(scenario, "rms_norm/nan_clock", path, settings, tmp_path), "unsynced_work")
    assert "nan" in row["error"] and "finite" in row["error"], row["error"]
    assert row["speedup"] is None


NAMEDTUPLE_CANDIDATE = """
import collections

import torch
import torch.nn.functional as F
from torch import nn

Out = collections.namedtuple("Out", "x residual")


class TransposedPair(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.hidden_size, self.variance_epsilon = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, residual=None):
        s = x.float() + residual.float()
        y = F.rms_norm(s, (self.hidden_size,), None, self.variance_epsilon).to(x.dtype) * self.weight
        # column-major copies: right values, not row-major (a namedtuple, not a tuple)
        return Out(y.t().contiguous().t(), s.to(x.dtype).t().contiguous().t())
"""


def test_namedtuple_outputs_are_made_dense_inside_the_call(tmp_path, scenarios, settings):
    """The worker's call makes a namedtuple's strided outputs contiguous, as a tuple's (in
    the timed call, not in the untimed copy to the judge's slot), and the row passes."""
    from kb_nano.kernels.worker import Side

    path = write(tmp_path / "candidates/fused_add_rms_norm/transposed_pair.py", NAMEDTUPLE_CANDIDATE)
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    side = Side({"role": "candidate", "device": "cpu"})
    side.module = namespace["TransposedPair"](64)
    side.inputs = [[torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)]]
    raw = side.module(*side.inputs[0])
    assert not raw.x.is_contiguous()
    out = side.call(0)
    assert all(o.is_contiguous() for o in out) and torch.equal(out[0], raw.x) and torch.equal(out[1], raw.residual)
    scenario = scenarios["fused_add_rms_norm__llama32-1b__tp1__n4"]
    check_row(measure(scenario, "fused_add_rms_norm/transposed_pair", path, settings, tmp_path), "passed")
