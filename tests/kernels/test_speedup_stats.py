"""Speedup statistics on synthetic data: the rerun interval of the speedup, the timer columns
and their agreement, the speedup basis and stopping rule, the planned blocks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kb_nano import stats


def test_speedup_interval_is_a_rerun_interval_around_the_estimate():
    """Student's t over the blocks' log ratios, widened for a rerun's estimate (sqrt(2/n)
    instead of sqrt(1/n)) and for medians (sqrt(pi/2)), centred on the reported speedup."""
    base, cand = [2.0, 2.1, 1.9, 2.05, 1.95], [1.0] * 5
    lo, hi = stats.speedup_interval(base, cand, 2.0)
    logs = np.log(base)
    half = 2.776 * np.sqrt(np.pi / 2) * np.std(logs, ddof=1) * np.sqrt(2 / 5)  # t_{0.975, 4}
    assert (lo, hi) == pytest.approx((2.0 * np.exp(-half), 2.0 * np.exp(half)))
    assert lo < 2.0 < hi
    assert stats.speedup_interval([2.0] * 5, [1.0] * 5, 2.0) == pytest.approx((2.0, 2.0))  # no spread, no width
    assert (
        stats.t975(30) == 2.042
        and abs(stats.t975(31) - 2.0395) < 0.001
        and stats.t975(10**6) == pytest.approx(1.96, abs=1e-4)
    )


def test_speedup_interval_covers_a_rerun():
    """Simulated reruns of the same measurement (blocks drawn from one distribution):
    the second run's speedup falls inside the first run's interval about 95% of the time;
    the plain confidence interval of the mean would cover far fewer."""
    rng = np.random.default_rng(7)

    def run(n=5):
        b, c = 2.0 * np.exp(rng.normal(0, 0.02, n)), np.exp(rng.normal(0, 0.02, n))
        est = float(np.median(b) / np.median(c))
        return est, stats.speedup_interval(list(b), list(c), est)

    inside = 0
    for _ in range(2000):
        _, (lo, hi) = run()
        est2, _ = run()
        inside += lo <= est2 <= hi
    assert 0.93 <= inside / 2000 <= 0.995


def test_a_between_run_spread_is_covered_by_run_sd_and_missed_without_it():
    """Runs whose log speedup moves by a run-level N(0, 0.004) that no block samples (the
    H200's fitted ``RUN_TO_RUN_SD``) on top of tight blocks: the block-only interval
    misses about half of the reruns; with ``run_sd`` about 95% land inside."""
    from kb_nano.kernels.blocks import RUN_TO_RUN_SD

    rng = np.random.default_rng(11)
    sd = RUN_TO_RUN_SD["cuda"]

    def run(run_sd, n=5):
        shift = rng.normal(0, sd)
        b, c = 2.0 * np.exp(shift + rng.normal(0, 0.002, n)), np.exp(rng.normal(0, 0.002, n))
        est = float(np.median(b) / np.median(c))
        return est, stats.speedup_interval(list(b), list(c), est, run_sd)

    for run_sd, low, high in ((0.0, 0.3, 0.8), (sd, 0.93, 0.995)):
        inside = 0
        for _ in range(2000):
            _, (lo, hi) = run(run_sd)
            est2, _ = run(run_sd)
            inside += lo <= est2 <= hi
        assert low <= inside / 2000 <= high, (run_sd, inside)


def test_speedup_interval_of_equal_sides_contains_one():
    rng = np.random.default_rng(1)
    b, c = list(1.0 + rng.normal(0, 0.1, 10)), list(1.0 + rng.normal(0, 0.1, 10))
    lo, hi = stats.speedup_interval(b, c, float(np.median(b) / np.median(c)))
    assert lo < 1.0 < hi


def test_speedup_interval_pairs_blocks_so_shared_drift_cancels():
    """Both sides slow down together over the run (drift); the per-block ratio stays 1.25."""
    drift = np.linspace(1.0, 3.0, 10)
    assert stats.speedup_interval(list(1.25 * drift), list(drift), 1.25) == pytest.approx((1.25, 1.25))


def test_speedup_interval_rejects_unpaired_samples():
    with pytest.raises(ValueError, match="paired"):
        stats.speedup_interval([1.0, 2.0], [1.0], 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        stats.speedup_interval([1.0], [1.0], 1.0)


def _samples(**timers):
    from kb_nano.kernels.blocks import new_samples

    s = new_samples()
    for timer, (base, cand) in timers.items():
        s[timer]["base"], s[timer]["cand"] = [base] * 10, [cand] * 10
        s[timer]["block_base"], s[timer]["block_cand"] = [base] * 5, [cand] * 5
    return s


def test_timer_columns_and_agreement():
    from kb_nano.kernels.agreement import timer_fields

    cuda = torch.device("cuda")
    s = _samples(eager=(0.030, 0.012), kernel=(0.010, 0.004), graph=(0.012, 0.005))
    s["kernel"].update(
        kernels_base=[5] * 10, kernels_cand=[1] * 10, span_base=[0.02] * 10, span_cand=[0.004] * 10, hidden=[0.0]
    )
    out = timer_fields(s, cuda)
    assert out["kernel_speedup"] == pytest.approx(2.5) and out["launch_overhead_ms"] == pytest.approx(0.008)
    assert out["timer_check"] is None and out["candidate_kernels"] == 1
    # a candidate that computes on the host between two tiny kernels: the kernel time misses it
    s = _samples(eager=(0.030, 0.400), kernel=(0.010, 0.002), graph=(0.012, 0.003))
    s["kernel"].update(kernels_base=[5] * 10, kernels_cand=[2] * 10, span_base=[0.2] * 10, span_cand=[0.390] * 10)
    check = timer_fields(s, cuda)["timer_check"]
    assert check.startswith("candidate: the device waited") and "baseline" not in check  # host-bound baseline gaps pass
    # graph replays slower than the kernels the records show: records miss work
    s = _samples(eager=(0.03, 0.03), kernel=(0.010, 0.002), graph=(0.012, 0.020))
    s["kernel"].update(kernels_base=[5] * 10, kernels_cand=[1] * 10)
    assert "graph time" in timer_fields(s, cuda)["timer_check"]
    cpu = timer_fields(_samples(eager=(1.0, 0.5)), torch.device("cpu"))
    assert cpu["eager_speedup"] == 2.0 and cpu["candidate_kernel_ms"] is None and "timer_check" not in cpu


def test_speedup_basis_and_stopping_rule():
    from kb_nano.kernels.blocks import basis, stop_reason

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert basis("auto", cuda, {}) == "kernel" and basis("auto", cpu, {}) == "eager"
    assert basis("graph", cuda, {"graph": "capture failed"}) == "eager"
    assert basis("kernel", cuda, {"kernel": "no CUPTI"}) == "graph"
    s = _samples(kernel=(2.0, 1.0))
    s["kernel"]["block_base"], s["kernel"]["block_cand"] = [2.0] * 4, [1.0] * 4
    s["blocks"], s["started"] = 4, time.monotonic()
    settings = {"ci_target": 0.01, "max_timing_s": 60}
    assert stop_reason(s, "kernel", cuda, settings) is None  # fewer than 5 blocks
    s["blocks"] = 5
    s["kernel"]["block_base"], s["kernel"]["block_cand"] = [2.0] * 5, [1.0] * 5
    assert stop_reason(s, "kernel", cuda, settings) == "ci_target"
    s["planned"] = None  # a new measurement
    s["kernel"]["block_base"] = [1.0, 3.0, 1.5, 2.6, 2.0]  # noisy blocks: the interval is wide
    assert stop_reason(s, "kernel", cuda, settings) is None
    planned = s["planned"][1]
    assert planned > 5
    assert stop_reason(s, "kernel", cuda, {**settings, "max_timing_s": 1e-9}) == "max_timing_s"
    # the first stage fixed the count: blocks that tighten the interval later do not stop it early
    s["blocks"] = planned - 1
    s["kernel"]["block_base"] += [2.0] * (planned - 6)
    s["kernel"]["block_cand"] = [1.0] * (planned - 1)
    assert stop_reason(s, "kernel", cuda, settings) is None and s["planned"][1] == planned
    s["blocks"] = planned
    assert stop_reason(s, "kernel", cuda, settings) == "ci_target"
    s["blocks"] = 10
    assert stop_reason(s, "eager", cpu, settings) == "fixed"


def test_planned_blocks_reach_the_target_from_the_first_stage_spread():
    """planned_blocks: the least block count whose rerun interval, at the first stage's
    spread, is within the target; more for a noisier first stage or a tighter target."""
    import numpy as np

    from kb_nano import stats
    from kb_nano.kernels.blocks import planned_blocks

    base, cand = [2.0, 2.1, 1.9, 2.05, 1.95], [1.0] * 5
    n = planned_blocks(base, cand, 0.02, 5)
    spread = float(np.std(np.log(base), ddof=1))
    half = lambda k: stats.t975(k - 1) * np.sqrt(np.pi / 2) * spread * np.sqrt(2 / k)  # noqa: E731
    assert np.sinh(half(n)) <= 0.02 < np.sinh(half(n - 1))
    assert planned_blocks(base, cand, 0.01, 5) > n > planned_blocks(base, cand, 0.05, 5) >= 5
    assert planned_blocks([2.0] * 5, cand, 0.02, 5) == 5  # no spread: the first stage is enough
    assert planned_blocks([1.0, 9.0] * 3, [1.0] * 6, 0.001, 5, most=50) == 50
