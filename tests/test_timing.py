"""Timing statistics, the anti-cheat rule functions and the roofline review, on synthetic
data and real CPU calls (the CUDA paths run on a GPU host: tests/test_adversarial.py
--device cuda, bench/fidelity.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kb_nano import roofline
from kb_nano.kernels import checks, guard, timing
from kb_nano.kernels.judge import batch_calls, hidden_ms
from kb_nano.kernels.worker_process import set_precision


def test_speedup_ci_brackets_the_ratio_and_is_deterministic():
    rng = np.random.default_rng(0)
    base = list(2.0 + rng.normal(0, 0.05, 200))
    cand = list(1.0 + rng.normal(0, 0.05, 200))
    lo, hi = timing.speedup_ci(base, cand, seed=7)
    assert lo < 2.0 < hi and hi - lo < 0.2
    assert (lo, hi) == timing.speedup_ci(base, cand, seed=7)


def test_speedup_ci_of_equal_sides_contains_one():
    rng = np.random.default_rng(1)
    same = list(1.0 + rng.normal(0, 0.1, 100))
    other = list(1.0 + rng.normal(0, 0.1, 100))
    lo, hi = timing.speedup_ci(same, other, seed=0)
    assert lo < 1.0 < hi


def test_speedup_ci_pairs_calls_so_shared_drift_cancels():
    """Both sides slow down together over the run (drift); paired resampling keeps the
    interval tight around the true ratio 1.25."""
    drift = np.linspace(1.0, 3.0, 100)
    lo, hi = timing.speedup_ci(list(1.25 * drift), list(drift), seed=0)
    assert lo <= 1.25 <= hi


def test_speedup_ci_rejects_unpaired_samples():
    with pytest.raises(ValueError, match="paired"):
        timing.speedup_ci([1.0, 2.0], [1.0], seed=0)


def test_time_calls_on_cpu_times_each_slot_and_keeps_outputs_untimed():
    kept = []

    def call(k):
        return torch.full((4,), float(k))

    times = timing.time_calls(call, range(2, 7), torch.device("cpu"), None, lambda k, out: kept.append((k, out)))
    assert len(times) == 5 and all(t >= 0 for t in times)
    assert [k for k, _ in kept] == [2, 3, 4, 5, 6] and all(float(out[0]) == k for k, out in kept)


def test_hidden_work_is_baseline_calibrated():
    assert timing.hidden_work_ms([0.030] * 5, [0.020] * 5, [0.110] * 5, [0.005] * 5) == pytest.approx(0.095)
    assert timing.hidden_work_ms([0.030] * 5, [0.020] * 5, [0.110] * 5, [0.005] * 5) > timing.hidden_work_limit_ms(0.005)
    honest = timing.hidden_work_ms([0.03] * 5, [0.02] * 5, [0.032] * 5, [0.021] * 5)
    assert honest < timing.hidden_work_limit_ms(0.021)
    assert timing.hidden_work_ms([], [], [], []) is None  # CPU: no device-wide pass


def test_judge_clock_cross_check_ignores_jitter_and_sees_hidden_work():
    """hidden_ms: the least per-batch overhead of each side; host jitter (spikes) only adds
    time, work moved out of the timed calls is in every batch."""
    base = {"judge_base": [11.0, 14.0, 11.1, 11.0, 16.0], "rep_base": [10.0] * 5}
    honest = {**base, "judge_cand": [6.0, 6.1, 9.5, 6.0, 6.05], "rep_cand": [5.0] * 5}
    assert hidden_ms(honest) == pytest.approx(0.0)
    forged = {**base, "judge_cand": [11.0, 11.2, 14.0, 11.1, 11.0], "rep_cand": [1.0] * 5}  # reports 10x less
    assert hidden_ms(forged) == pytest.approx(9.0)


def test_batch_size_follows_the_call_time_and_memory():
    cpu = torch.device("cpu")
    assert batch_calls(1.0, 1000, cpu) == 5  # 5 ms batches
    assert batch_calls(0.001, 1000, cpu) == 1000  # capped
    assert batch_calls(50.0, 1000, cpu) == 2  # at least two slots
    assert batch_calls(0.01, 1 << 30, cpu) == 2  # what the memory budget holds
    assert batch_calls(50.0, 1000, cpu, num_runs=100) == 10  # num_runs in MIN_BATCHES batches
    assert batch_calls(1.0, 1000, cpu, num_runs=20) == 5


def test_output_aliasing_rules():
    x = torch.zeros(8, 4)
    out = x[:, :2]
    assert checks.aliased_outputs(out, {"x": x}, ())[0] == "output_aliased"
    assert checks.aliased_outputs(out, {"x": x}, ("x",)) is None  # the contract lets it write x
    a = torch.zeros(16)
    assert checks.aliased_outputs((a[:8], a[4:12]), {}, ())[0] == "output_aliased"  # outputs overlap
    assert checks.aliased_outputs((a[:8], a[8:]), {}, ()) is None  # same storage, disjoint bytes
    assert "earlier call" in checks.aliased_outputs(a, {}, (), previous=[torch.zeros(2), a[3:5]])[1]
    assert checks.aliased_outputs(torch.zeros(3), {"x": x}, (), previous=torch.zeros(3)) is None


def test_mutation_rule_is_bitwise_and_nan_safe():
    x = torch.tensor([1.0, float("nan")])
    before = {"x": x.clone()}
    assert checks.mutated_inputs(before, {"x": x}, ()) is None  # NaN == NaN bitwise
    x[0] = -0.0 + 1.0 - 1.0  # 0.0: one element changed
    status, msg = checks.mutated_inputs(before, {"x": x}, ())
    assert status == "input_mutated" and "input 'x'" in msg
    assert checks.mutated_inputs(before, {"x": x}, ("x",)) is None


def test_invalid_output_rule():
    class Sub(torch.Tensor):
        pass

    assert checks.invalid_outputs(torch.zeros(2), torch.device("cpu")) is None
    assert checks.invalid_outputs(torch.zeros(2).as_subclass(Sub), torch.device("cpu"))[0] == "invalid_output"
    assert "layout" in checks.invalid_outputs(torch.eye(3).to_sparse(), torch.device("cpu"))[1]
    assert "conjugate" in checks.invalid_outputs(torch.zeros(2, dtype=torch.complex64).conj(), torch.device("cpu"))[1]
    assert checks.invalid_outputs(torch.zeros(2, device="meta"), torch.device("cpu"))[0] == "invalid_output"


def test_changed_after_return_and_thread_watch():
    out = torch.zeros(1000)
    snap = checks.snapshot(out)
    assert checks.changed_after_return(out, snap, torch.device("cpu"), 0.001) is None
    before = checks.thread_idents()

    def late_writer():
        time.sleep(0.005)
        out.fill_(1.0)
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:  # keep using CPU after the "call" returned
            pass

    t = threading.Thread(target=late_writer, name="late")
    t.start()
    watch = checks.ThreadWatch(before)  # the "call" returns here
    assert checks.changed_after_return(out, snap, torch.device("cpu"), 0.02)[0] == "unsynced_work"
    found = watch.check()
    t.join()
    assert found is not None and "'late'" in found[1]


def test_thread_watch_sees_raw_threads_and_passes_idle_and_exiting_ones():
    import _thread

    before = checks.thread_idents()
    done = threading.Event()

    def busy():
        time.sleep(0.002)  # the call "returns" first
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass
        done.set()

    _thread.start_new_thread(busy, ())  # invisible to threading.enumerate()
    watch = checks.ThreadWatch(before)
    found = watch.check()
    done.wait(1)
    assert found is not None and found[0] == "unsynced_work"
    time.sleep(0.01)
    before = checks.thread_idents()
    idle = threading.Thread(target=time.sleep, args=(0.3,), name="idle")
    idle.start()
    for _ in range(20):  # threads started and joined by the call: may linger while exiting
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
    watch = checks.ThreadWatch(before)
    assert watch.check() is None  # alive but blocked, or only exiting: allowed
    idle.join()


def test_namespaces_detect_replaced_clock_precision_and_hooks():
    g = guard.Namespaces()
    assert g.check("now") is None
    real = timing._perf_counter_ns
    try:
        timing._perf_counter_ns = lambda: 0
        status, msg = g.check("after timing")
        assert status == "tampered" and "kb_nano.kernels.timing._perf_counter_ns" in msg
        # a "wrapper" that claims torch's files and wraps the real clock is no exception
        import os

        def forged():
            return real() - 2500

        forged.__code__ = forged.__code__.replace(co_filename=os.path.join(os.path.dirname(torch.__file__), "_utils.py"))
        forged.__wrapped__ = real
        timing._perf_counter_ns = forged
        assert g.check("after the forged wrapper")[0] == "tampered"
        # nor does swapping the guard's own comparison rules blind it
        rules = guard._same, guard._exact
        try:
            guard._same = guard._exact = lambda *a: True
            assert "_perf_counter_ns" in g.check("after swapping the rules")[1]
        finally:
            guard._same, guard._exact = rules
    finally:
        timing._perf_counter_ns = real
    assert g.check("now") is None
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert "float32_matmul_precision" in g.check("x")[1]
    finally:
        torch.set_float32_matmul_precision(prev)
    import sys

    try:
        sys.setprofile(lambda *a: None)
        assert "sys.getprofile()" in g.check("x")[1]
    finally:
        sys.setprofile(None)
    mkldnn = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = not mkldnn
        assert "torch.backends.mkldnn.enabled" in g.check("x")[1]
    finally:
        torch.backends.mkldnn.enabled = mkldnn


def test_set_precision_fixes_tf32_for_both_switches():
    prev = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        assert set_precision("highest") is False and torch.backends.cudnn.allow_tf32 is False
        assert set_precision("high") is True and torch.backends.cudnn.allow_tf32 is True
        with pytest.raises(ValueError, match="float32_matmul_precision"):
            set_precision("fast")
    finally:
        torch.set_float32_matmul_precision(prev[0])
        torch.backends.cudnn.allow_tf32 = prev[1]


def test_roofline_bound_and_review():
    peak = {"copy_gbps": 1000.0, "matmul_tflops": 100.0}
    # 1 GB at 1000 GB/s = 1 ms; 1e11 flop at 100 TFLOP/s = 1 ms; the larger term wins
    assert roofline.bound_ms(10**9, 0, peak) == pytest.approx(1.0)
    assert roofline.bound_ms(10**9, 2 * 10**11, peak) == pytest.approx(2.0)
    assert roofline.bound_ms(None, None, peak) is None
    assert roofline.review(0.9, 1.0, peak) is None  # within the margin
    assert "implausible" in roofline.review(0.5, 1.0, peak)


def test_roofline_peaks_are_measured_once_and_overridable(tmp_path):
    first = roofline.peaks(torch.device("cpu"), "test-cpu", torch.float32, tmp_path)
    assert first["copy_gbps"] > 0 and first["matmul_tflops"] > 0
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = roofline.peaks(torch.device("cpu"), "test-cpu", torch.float32, tmp_path, {"copy_gbps": 5.0})
    assert again["copy_gbps"] == 5.0 and again["matmul_tflops"] == first["matmul_tflops"]


def test_lazy_imports_and_torch_wrappers_are_not_tampering_but_forged_wrappers_are():
    import functools
    import importlib

    g = guard.Namespaces()
    time.tzset()  # a new, equal time.tzname tuple
    importlib.import_module("torch._dynamo")  # re-binds torch.manual_seed to torch's own wrapper
    assert g.check("x") is None
    real = torch.randn

    @functools.wraps(real)  # copies __module__ and __wrapped__, but the code is not torch's
    def forged(*a, **k):
        return real(*a, **k)

    torch.randn = forged
    try:
        assert "torch.randn" in g.check("y")[1]
    finally:
        torch.randn = real


def test_cpu_copy_bandwidth_is_measured_at_the_working_set():
    small = roofline.copy_gbps_at(torch.device("cpu"), 64 * 1024)
    assert small > 0


def test_first_overlap_finds_reused_buffers_among_many_outputs():
    a = torch.zeros(64)
    older = [torch.zeros(4) for _ in range(50)]
    fresh = [torch.zeros(4) for _ in range(50)]
    assert checks.first_overlap(fresh, older) is None
    assert checks.first_overlap([*fresh, older[7]], older) is not None  # an older buffer returned again
    assert checks.first_overlap([fresh[3], fresh[3]], []) is not None  # the same buffer twice in one batch
    assert checks.first_overlap([a[0:64:2], a[1:64:2]], []) is None  # interleaved views share no byte
