"""GPU leasing (kb_nano.gpus) with fake device ids on the CPU: real concurrent processes
holding leases, a SIGKILLed holder, and real Snakemake runs of GPU-declared jobs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import pytest
from workflow_helpers import copy_workflow, kb_nano, snakemake

from kb_nano import gpus
from kb_nano.errors import KbNanoError
from kb_nano.kernels.schema import SCHEMA_VERSION

HOLDER = """
import json, sys, time
from pathlib import Path
from kb_nano import gpus
lock_dir, n, hold_s, record = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
with gpus.lease(n, Path(lock_dir), timeout_s=60, ids=sys.argv[5].split(",")) as ids:
    start = time.time()
    Path(record + ".ready").write_text(",".join(ids))
    time.sleep(hold_s)
    end = time.time()
Path(record).write_text(json.dumps({"ids": ids, "start": start, "end": end}))
"""


def _holder(tmp_path: Path, name: str, n: int, hold_s: float, pool: str) -> tuple[subprocess.Popen, Path]:
    record = tmp_path / f"{name}.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "locks"), str(n), str(hold_s), str(record), pool]
    )
    return proc, record


def _assert_no_overlap(intervals: list[tuple[str, float, float]]) -> dict[str, int]:
    """Per device id, no two [start, end] intervals overlap; returns uses per id."""
    by_id = defaultdict(list)
    for device, start, end in intervals:
        by_id[device].append((start, end))
    for device, spans in by_id.items():
        spans.sort()
        for (s1, e1), (s2, e2) in zip(spans, spans[1:]):
            assert s2 >= e1, f"device {device} leased twice at once: [{s1}, {e1}] and [{s2}, {e2}]"
    return {d: len(s) for d, s in by_id.items()}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"KB_NANO_GPU_IDS": "0,1,2"}, ["0", "1", "2"]),
        ({"CUDA_VISIBLE_DEVICES": "4,6"}, ["4", "6"]),
        ({"CUDA_VISIBLE_DEVICES": "4,6", "KB_NANO_GPU_IDS": "6"}, ["6"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        ({"CUDA_VISIBLE_DEVICES": "2,-1,3"}, ["2"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5fd1a2b3, GPU-77aa"}, ["GPU-5fd1a2b3", "GPU-77aa"]),
    ],
)
def test_pool_respects_cuda_visible_devices_and_the_fake_pool(env, expected):
    assert gpus.pool(env) == expected


def test_pool_rejects_ids_outside_cuda_visible_devices_and_repeats():
    with pytest.raises(KbNanoError, match="ids 0 are not in CUDA_VISIBLE_DEVICES=4,6"):
        gpus.pool({"CUDA_VISIBLE_DEVICES": "4,6", "KB_NANO_GPU_IDS": "0,6"})
    with pytest.raises(KbNanoError, match="listed twice"):
        gpus.pool({"KB_NANO_GPU_IDS": "1,1"})


def test_lease_exports_ids_and_refuses_more_than_the_pool(tmp_path):
    with gpus.lease(2, tmp_path, timeout_s=1, ids=["3", "5", "7"]) as ids:
        assert ids == ["3", "5"]
        with gpus.lease(1, tmp_path, timeout_s=1, ids=["3", "5", "7"]) as more:
            assert more == ["7"]
    with gpus.lease(0, tmp_path, timeout_s=1, ids=[]) as none:
        assert none == []
    with pytest.raises(KbNanoError, match="needs 4 device"):
        with gpus.lease(4, tmp_path, timeout_s=1, ids=["0", "1"]):
            pass


def test_concurrent_processes_never_share_a_device(tmp_path):
    """Six processes, a pool of two ids: each holds one id for 0.4 s; per id, no two
    holding intervals overlap, and both ids are used."""
    procs = [_holder(tmp_path, f"h{i}", 1, 0.4, "0,1") for i in range(6)]
    intervals = []
    for proc, record in procs:
        assert proc.wait(timeout=60) == 0
        rec = json.loads(record.read_text())
        intervals.append((rec["ids"][0], rec["start"], rec["end"]))
    assert set(_assert_no_overlap(intervals)) == {"0", "1"}


def test_two_device_leases_do_not_deadlock_or_overlap(tmp_path):
    """Jobs that each need two devices (a TP-2 job) on a pool of three: never sharing."""
    procs = [_holder(tmp_path, f"tp{i}", 2, 0.3, "0,1,2") for i in range(4)]
    intervals = []
    for proc, record in procs:
        assert proc.wait(timeout=60) == 0
        rec = json.loads(record.read_text())
        assert len(rec["ids"]) == 2
        intervals += [(d, rec["start"], rec["end"]) for d in rec["ids"]]
    _assert_no_overlap(intervals)


def test_a_killed_holders_lease_is_free_at_once(tmp_path):
    proc, record = _holder(tmp_path, "victim", 1, 600, "0")
    ready = Path(str(record) + ".ready")
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(gpus.LeaseTimeout, match="1 of the 1 device"):
        with gpus.lease(1, tmp_path / "locks", timeout_s=0.3, ids=["0"]):
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    with gpus.lease(1, tmp_path / "locks", timeout_s=5, ids=["0"]) as ids:
        assert ids == ["0"]
    assert time.monotonic() - t0 < 1.0


SLEEPY = '''"""Test candidate: records which device it was given and when, holding it {hold} s
(printed: a candidate's stdout goes to its job log, the only place it may write)."""

import json
import os
import time

from kb_nano.operators.activations import SiluAndMul


class Sleepy{i}(SiluAndMul):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        start = time.time()
        time.sleep({hold})
        print("LEASE " + json.dumps({{"id": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time()}}),
              flush=True)
'''


def _gpu_workflow(tmp_path: Path, count: int) -> Path:
    work = copy_workflow(tmp_path, {"targets": ["silu_and_mul"], "candidates": ["silu_and_mul/sleepy"]})
    for i in range(count):
        (work / f"candidates/silu_and_mul/sleepy{i}.py").write_text(SLEEPY.format(i=i, hold=1.0))
    return work


def _lease_log(work: Path) -> list[tuple[str, float, float]]:
    lines = [
        ln[len("LEASE ") :]
        for log in sorted((work / "results/logs/kernels/silu_and_mul").glob("sleepy*/*.log"))
        for ln in log.read_text().splitlines()
        if ln.startswith("LEASE ")
    ]
    return [(r["id"], r["start"], r["end"]) for r in map(json.loads, lines)]


@pytest.mark.slow
def test_snakemake_gpu_jobs_lease_distinct_devices_even_when_over_admitted(tmp_path, monkeypatch):
    """Four GPU-declared jobs, a fake pool of two ids, and --resources gpu=4 (Snakemake would
    start all four at once): the leases alone keep two jobs off one device."""
    work = _gpu_workflow(tmp_path, 4)
    monkeypatch.setenv("KB_NANO_GPU_IDS", "0,1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    snakemake(work, "--cores", "4", "--resources", "gpu=4")
    log = _lease_log(work)
    assert len(log) == 4
    assert set(_assert_no_overlap(log)) == {"0", "1"}
    df = pd.read_parquet(work / "results/kernels.parquet")
    assert len(df) == 4 and set(df.gpu_ids) == {"0", "1"}
    assert (df.schema_version == SCHEMA_VERSION).all()


@pytest.mark.slow
def test_gpu_pool_flag_bounds_jobs_and_devices(tmp_path, monkeypatch):
    """`kb_nano kernels --gpu-pool 2` on a pool of three ids: jobs use only the first two,
    never one device twice at once."""
    work = _gpu_workflow(tmp_path, 3)
    monkeypatch.setenv("KB_NANO_GPU_IDS", "5,6,7")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = kb_nano(work, "kernels", "--configfile", "small.yaml", "--gpu-pool", "2", "--cores", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    log = _lease_log(work)
    assert len(log) == 3
    assert set(_assert_no_overlap(log)) <= {"5", "6"}
    df = pd.read_parquet(work / "results/kernels.parquet")
    assert set(df.gpu_ids) <= {"5", "6"} and df.gpu_ids.notna().all()
    too_many = kb_nano(work, "kernels", "--configfile", "small.yaml", "--gpu-pool", "4", "--dry-run")
    assert too_many.returncode == 2
    # (the --candidate prefix note comes first: sleepy selects sleepy0..2)
    assert [ln for ln in too_many.stderr.strip().splitlines() if not ln.startswith("note: ")] == [
        "error: --gpu-pool 4: only 3 (5,6,7) visible here (CUDA_VISIBLE_DEVICES / KB_NANO_GPU_IDS / nvidia-smi); "
        "pass at most that many"
    ]


@pytest.mark.slow
def test_cpu_jobs_lease_nothing(tmp_path, monkeypatch):
    work = copy_workflow(
        tmp_path, {"targets": ["silu_and_mul"], "candidates": ["silu_and_mul/inplace"], "device": "cpu"}
    )
    monkeypatch.setenv("KB_NANO_GPU_IDS", "0")
    snakemake(work)
    df = pd.read_parquet(work / "results/kernels.parquet")
    assert df.gpu_ids.isna().all() and (df.status == "passed").all()
    assert not list((work / "results/.locks").glob("gpu-*.lock"))
