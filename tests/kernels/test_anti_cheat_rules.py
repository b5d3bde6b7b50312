"""The anti-cheat rule functions on real CPU tensors, threads and processes: output aliasing,
mutation and invalid outputs, late writers and threads, replaced namespaces, precision
switches, reused buffers, the heap of held outputs and process tampering."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kb_nano.kernels import checks, guard, timing
from kb_nano.kernels.worker_process import set_precision


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


def test_dense_outputs_and_flatten_treat_tuple_subclasses_as_tuples():
    """A namedtuple (or any tuple/list subclass) of outputs gets the same dense-output rule
    as a tuple: its strided views are made contiguous inside the call, and the later rules
    walk its items through tuple's own iterator, not an override of the subclass."""
    import collections

    pair = collections.namedtuple("Pair", "x residual")
    x = torch.zeros(4, 6).t()  # a transposed view: not contiguous
    for out in (pair(x, x), (x, x), [x, x]):
        dense = checks.dense_outputs(out)
        assert type(dense) in (tuple, list) and all(o.is_contiguous() for o in dense), type(out)
        assert all(torch.equal(o, x) for o in dense)

    class Lying(tuple):
        def __iter__(self):  # what a rule would see if it used the subclass's iterator
            return iter(())

        def __len__(self):
            return 0

    lying = Lying((x, x))
    assert len(checks.flatten_outputs(lying)) == 2
    assert [o.is_contiguous() for o in checks.dense_outputs(lying)] == [True, True]
    assert checks.invalid_outputs(Lying((x.to_sparse(),)), torch.device("cpu"))[0] == "invalid_output"


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


def test_first_overlap_finds_reused_buffers_among_many_outputs():
    a = torch.zeros(64)
    older = [torch.zeros(4) for _ in range(50)]
    fresh = [torch.zeros(4) for _ in range(50)]
    assert checks.first_overlap(fresh, older) is None
    assert checks.first_overlap([*fresh, older[7]], older) is not None  # an older buffer returned again
    assert checks.first_overlap([fresh[3], fresh[3]], []) is not None  # the same buffer twice in one batch
    assert checks.first_overlap([a[0:64:2], a[1:64:2]], []) is None  # interleaved views share no byte


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


@pytest.mark.parametrize(
    "policy",
    [("SCHED_FIFO",), ("SCHED_FIFO", "SCHED_RESET_ON_FORK"), ("SCHED_RR", "SCHED_RESET_ON_FORK"), ("SCHED_IDLE",)],
)
def test_any_policy_but_time_sharing_is_an_elevated_priority(policy):
    """A real-time policy is found with its reset-on-fork flag too (``sched_getscheduler``
    returns it or-ed in); the time-sharing policies below the default are not raised."""
    import os
    import subprocess
    import sys

    from kb_nano.kernels.procs import elevated_threads

    value = sum(getattr(os, name) for name in policy)
    realtime = policy[0] in ("SCHED_FIFO", "SCHED_RR")
    param = os.sched_param(1 if realtime else 0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        try:
            os.sched_setscheduler(proc.pid, value, param)
        except PermissionError:
            pytest.skip("setting a real-time policy needs root or RLIMIT_RTPRIO")
        assert bool(elevated_threads(proc.pid)) == realtime
    finally:
        proc.kill()
        proc.wait()
