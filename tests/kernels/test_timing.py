"""Timing statistics, the anti-cheat rule functions and the roofline review, on synthetic
data and real CPU calls (the CUDA paths run on a GPU host: tests/kernels/test_adversarial.py
--device cuda, bench/fidelity.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kb_nano import roofline, stats
from kb_nano.kernels import checks, guard, timing
from kb_nano.kernels.blocks import batch_calls, hidden_ms, overhead_noise_ms
from kb_nano.kernels.worker_process import set_precision


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


def test_time_calls_on_cpu_times_each_slot_and_keeps_outputs_untimed():
    kept = []

    def call(k):
        return torch.full((4,), float(k))

    times = timing.time_calls(call, range(2, 7), torch.device("cpu"), None, lambda k, out: kept.append((k, out)))
    assert len(times) == 5 and all(t >= 0 for t in times)
    assert [k for k, _ in kept] == [2, 3, 4, 5, 6] and all(float(out[0]) == k for k, out in kept)


FLUSH = frozenset({"Memset (Device)", "reduce_kernel"})


def _flush(t0):  # the flush's two records on stream 13: a memset, then the 65 us read
    return [(13, "Memset (Device)", t0, t0 + 700), (13, "reduce_kernel", t0 + 1000, t0 + 66_000)]


def test_kernel_records_are_split_into_calls_at_the_flushes():
    """Each call gets the records that start after its flush ends and before the next
    flush ends, on any stream; concurrent records count once, gaps not at all; records
    before the first flush ended are hidden work."""
    recs = (
        _flush(0)
        + _flush(100_000)
        + [
            (7, "early", 500, 2_500),  # before flush 1 ended: hidden
            (7, "k1", 70_000, 72_000),
            (7, "k2", 80_000, 81_000),  # call 1: with "side", 4 us busy, 12 us span
            (9, "side", 80_500, 82_000),  # call 1, another stream, overlapping k2
            (7, "k3", 170_000, 174_000),  # call 2
        ]
    )
    per_call, hidden = cupti_attribute(recs, calls=2)
    assert per_call[0] == pytest.approx((0.004, 0.012, 3))
    assert per_call[1] == pytest.approx((0.004, 0.004, 1))
    assert hidden == pytest.approx(0.002)


def test_kernel_records_refuse_foreign_work_on_the_flush_stream():
    from kb_nano.kernels.cupti import KernelTimeError

    with pytest.raises(KernelTimeError, match="flush stream"):
        cupti_attribute(_flush(0) + [(13, "candidate_kernel", 70_000, 80_000)], calls=1)
    with pytest.raises(KernelTimeError, match="3 flush records for 2 calls"):
        cupti_attribute(_flush(0) + [(13, "reduce_kernel", 70_000, 80_000)], calls=2)


def cupti_attribute(records, calls):
    from kb_nano.kernels.cupti import attribute

    return attribute(records, 13, FLUSH, calls)


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


def test_judge_clock_cross_check_ignores_jitter_and_sees_hidden_work():
    """hidden_ms: the median per-batch overhead of each side; host jitter (spikes) in a few
    batches moves neither median, work moved out of the timed calls is in every batch,
    and one honest batch among forged ones does not vouch for them."""
    base = {"judge_base": [11.0, 14.0, 11.1, 11.0, 16.0], "rep_base": [10.0] * 5}
    honest = {**base, "judge_cand": [6.0, 6.1, 9.5, 6.0, 6.05], "rep_cand": [5.0] * 5}
    assert abs(hidden_ms(honest)) < 0.1
    forged = {**base, "judge_cand": [11.0, 11.2, 14.0, 11.1, 11.0], "rep_cand": [1.0] * 5}  # reports 10x less
    assert hidden_ms(forged) == pytest.approx(9.0, abs=0.15)
    but_one = {**base, "judge_cand": [11.0, 11.2, 6.0, 11.1, 11.0], "rep_cand": [1.0, 1.0, 5.0, 1.0, 1.0]}
    assert hidden_ms(but_one) == pytest.approx(9.0, abs=0.15)


def test_overhead_noise_ignores_a_minority_of_slow_batches_and_shrinks_with_blocks():
    """overhead_noise_ms (the chance movement of hidden_ms): a loaded host's slow batches
    on the baseline's side, under a third of them, hardly widen it (their IQR did: a
    forged clock hiding 2.4 ms per batch then passed on a loaded CI machine); it shrinks
    as blocks are added, and it reads the baseline's batches only."""
    rng = np.random.default_rng(1)
    tight = 1.2 + 0.1 * rng.standard_normal(20)
    spiky = tight.copy()
    spiky[::3] += 4.0  # 7 of 20 batches preempted
    s = {"judge_base": list(spiky + 2.4), "rep_base": [2.4] * 20}
    iqr = float(np.subtract(*np.percentile(spiky, [75, 25])))
    assert iqr > 3.0 and overhead_noise_ms(s) < 1.0
    more = np.concatenate([spiky, 1.2 + 0.1 * rng.standard_normal(40)])
    assert overhead_noise_ms({"judge_base": list(more + 2.4), "rep_base": [2.4] * 60}) < overhead_noise_ms(s)
    assert overhead_noise_ms({**s, "judge_cand": [100.0] * 20, "rep_cand": [1.0] * 20}) == overhead_noise_ms(s)
    assert overhead_noise_ms({"judge_base": [1.0, 2.0, 3.0], "rep_base": [0.0] * 3}) == 0.0


def test_estimates_are_batch_totals_so_work_shifted_between_calls_gains_nothing():
    """A candidate that does the next calls' work ahead (one long call, two short ones per
    three) has a short median call but the same batch totals: the estimate is the same."""
    from kb_nano.kernels.blocks import estimate, new_pass

    p = new_pass()
    p["block_base"] = [3.0 / 3] * 5
    shifted = [2.4, 0.3, 0.3]  # total 3.0 per three calls, median 0.3
    p["block_cand"] = [sum(shifted) / 3] * 5
    b, c = estimate(p)
    assert b / c == pytest.approx(1.0)


def test_batch_size_follows_the_call_time_and_memory():
    cpu = torch.device("cpu")
    assert batch_calls(1.0, 1000, cpu) == 5  # 5 ms batches
    assert batch_calls(0.001, 1000, cpu) == 1000  # capped
    assert batch_calls(50.0, 1000, cpu) == 2  # at least two slots
    assert batch_calls(0.01, 1 << 30, cpu) == 2  # what the memory budget holds
    assert batch_calls(50.0, 1000, cpu, num_runs=100) == 10  # num_runs in ten batches
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

        forged.__code__ = forged.__code__.replace(
            co_filename=os.path.join(os.path.dirname(torch.__file__), "_utils.py")
        )
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


def test_sm_clock_fields_name_the_throttle_reasons():
    from kb_nano.kernels.blocks import SmClock

    clock = SmClock(torch.device("cpu"))
    assert clock.handle is None and clock.fields() == {}  # a CPU row says nothing about clocks
    clock.samples = [(1980, 0), (1755, 0x4), (1980, 0x1)]  # idle bit (0x1) is not throttling
    assert clock.fields() == {
        "sm_clock_mhz": 1980.0,
        "sm_clock_min_mhz": 1755.0,
        "throttled": True,
        "throttle_reasons": "sw_power_cap",
    }
    clock.samples = [(1980, 0x1)]
    assert clock.fields()["throttled"] is False and clock.fields()["throttle_reasons"] is None


def test_kernel_timer_without_cupti_says_why(monkeypatch):
    """No libcupti: the timer is off with a one-line reason, and every batch reports it."""
    import torch

    from kb_nano.kernels import cupti, cupti_lib

    def missing() -> str:
        raise cupti_lib.CuptiError("no libcupti.so beside torch")

    monkeypatch.setattr(cupti_lib, "find_library", missing)
    timer = cupti.KernelTimer(torch.device("cpu"), flush=None)
    assert timer.error == "CUPTI kernel timing unavailable: CuptiError: no libcupti.so beside torch"
    assert timer.time_calls(lambda i: None, range(2), lambda i, out: None) == {"kernel_error": timer.error}


HEAP_PROBE = """
import resource, sys, torch
from kb_nano.kernels import heap
if sys.argv[1] == "on":
    assert heap.configure() is None
    assert heap.reserve(128 << 20) > 120 << 20 and heap.reserve(128 << 20) < 1 << 20  # the second finds it free
x = torch.randn(64, 2048)
held = []
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    held.append(x * 2)  # 512 KiB each, all held: 100 MiB
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_held_cpu_outputs_land_on_faulted_heap():
    """A CPU worker's held outputs do not page-fault (kb_nano.kernels.heap): with glibc's
    defaults each 512 KiB output is a fresh mmap (128 faults); after configure + reserve,
    almost none."""
    import subprocess
    import sys

    faults = {
        mode: int(
            subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True, check=True).stdout
        )
        for mode in ("off", "on")
    }
    assert faults["off"] > 200 * 100 and faults["on"] < 200 * 5, faults


def test_process_tampering_sees_changed_limits_and_raised_priority():
    """The judge's check before every batch (kb_nano.kernels.procs.process_tampering): a
    lowered resource limit of the baseline worker is found and restored; a candidate at a
    lower niceness than the judge is found (needs the privilege to lower it: root)."""
    import os
    import resource
    import subprocess
    import sys

    from kb_nano.kernels.procs import elevated_threads, process_tampering, restore_limits

    base = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    cand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_tampering(base.pid, cand.pid) is None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.prlimit(base.pid, resource.RLIMIT_NOFILE, (min(soft, 64), hard))
        assert "RLIMIT_NOFILE" in process_tampering(base.pid, cand.pid)
        assert resource.prlimit(base.pid, resource.RLIMIT_NOFILE) == (soft, hard)  # restored
        assert restore_limits(base.pid) == []
        if os.geteuid() == 0:
            os.setpriority(os.PRIO_PROCESS, cand.pid, os.getpriority(os.PRIO_PROCESS, 0) - 1)
            assert elevated_threads(cand.pid) and "priority" in process_tampering(base.pid, cand.pid)
    finally:
        base.kill()
        cand.kill()
