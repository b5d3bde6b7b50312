"""bench/multi_gpu.sh and bench/multi_gpu_report.py on a fake pool of four GPU ids: a real
(tiny) pair of sweeps on the CPU, the report over its rows and a synthetic nvidia-smi CSV,
and the double-booking check both ways (the real rows pass; a doctored overlap fails)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest
import yaml
from workflow_helpers import REPO

from kb_nano.kernels.schema import SCHEMA_VERSION

TINY = {
    "models": ["llama32-1b"],
    "num_tokens": [1, 16],
    "targets": ["rms_norm", "silu_and_mul"],
    "device": "auto",  # the CPU; the jobs still lease the fake ids
    "num_warmup": 1,
    "num_runs": 5,
    "timeout_s": 120,
}


def _report(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "bench/multi_gpu_report.py"), "--runs", str(out / "runs.tsv"), *extra],
        capture_output=True,
        text=True,
    )


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _fake_smi(out: Path) -> Path:
    """An nvidia-smi CSV (its exact format) over both sweeps: a sample every 200 ms for ids
    0-3, utilization 37 % while a row of the sweep held that id, else 0 %."""
    runs = pd.read_csv(out / "runs.tsv", sep="\t")
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB]"]
    for run in runs.itertuples():
        rows = pd.read_parquet(out / run.parquet)
        spans = [
            (g, pd.Timestamp(r.started_at).timestamp(), pd.Timestamp(r.ended_at).timestamp())
            for r in rows.itertuples()
            for g in r.gpu_ids.split(",")
        ]
        t = run.start_epoch
        while t <= run.end_epoch:
            t_ms = math.floor(t * 1000) / 1000  # the sample's time as its (ms) stamp says, so the report sees the same
            stamp = datetime.fromtimestamp(t_ms).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]  # local time, ms
            for gpu in "0123":
                held = any(g == gpu and s <= t_ms <= e for g, s, e in spans)
                lines.append(f"{stamp}, {gpu}, {37 if held else 0} %, {2048 if held else 1} MiB")
            t += 0.2
    lines.append("2026/11/29 20:06:0")  # a line cut off when the sampler was killed
    path = out / "nvidia_smi.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_multi_gpu_run_and_report_on_a_fake_pool(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "KB_NANO_GPU_IDS": "0,1,2,3",
        "PYTHON": sys.executable,
        "KB_NANO_SWEEP_CONFIGS": f"config/sweeps/multi_gpu.yaml {tmp_path / 'tiny.yaml'}",
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(
        ["bash", "bench/multi_gpu.sh", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "MULTI_GPU.md",
        "kernels_gpu1.parquet",
        "kernels_gpu4.parquet",
        "logs.tar.gz",
        "machine.txt",
        "runs.tsv",
    ]
    runs = pd.read_csv(out / "runs.tsv", sep="\t")
    assert runs["gpus"].tolist() == [4, 1] and (runs["exit_code"] == 0).all() and (runs["complete"] == 1).all()
    assert (runs["planned_jobs"] == 8).all()
    parallel, serial = (pd.read_parquet(out / p) for p in runs["parquet"])
    for rows in (parallel, serial):
        assert len(rows) == 8 and rows["gpu_ids"].notna().all() and (rows["schema_version"] == SCHEMA_VERSION).all()
        assert (pd.to_datetime(rows["ended_at"]) > pd.to_datetime(rows["started_at"])).all()
    assert set(serial["gpu_ids"]) == {"0"}  # one job at a time: always the first free id
    assert set(parallel["gpu_ids"]) <= {"0", "1", "2", "3"}
    md = (out / "MULTI_GPU.md").read_text()
    assert "Wall-time ratio gpu=1 / gpu=4" in md
    assert "gpu=4: 8 device leases checked: no two overlapping" in md
    summary = [
        _cells(line) for line in md.split("## Sweeps")[1].split("Wall-time")[0].splitlines() if line.startswith("|")
    ]
    sweeps = {cells[0]: dict(zip(summary[0], cells)) for cells in summary[2:]}
    # --cores all on CI's 2 cores: two jobs at once on distinct ids, so the check above is not vacuous
    assert int(sweeps["--resources gpu=4"]["max concurrent jobs"]) >= 2
    assert sweeps["--resources gpu=1"]["max concurrent jobs"] == "1"
    assert sweeps["--resources gpu=4"]["double-booked"] == sweeps["--resources gpu=1"]["double-booked"] == "NO"

    # the report with nvidia-smi samples: busy exactly while leased, on the right GPU
    smi = _fake_smi(out)
    ok = _report(out, "--smi", str(smi), "--machine", str(out / "machine.txt"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""
    section = ok.stdout.split("During the gpu=1 sweep")[1].split("## Jobs")[0]
    cells = {c[0]: c for c in (_cells(line) for line in section.splitlines() if line.startswith("|"))}
    assert cells["GPU"][2:5] == ["util > 0", "util > 0 while leased", "util > 0 while not leased"]
    assert cells["0"][3].startswith("100% of ") and cells["0"][4].startswith("0% of ") and cells["0"][6] == "2048"
    assert cells["3"][2:5] == ["0%", "no lease", f"0% of {cells['3'][1]}"] and cells["3"][6] == "1"

    # doctored: two jobs moved to device 7, the second starting inside the first's interval
    doctored = parallel.sort_values("started_at").reset_index(drop=True)
    a_start, a_end = pd.Timestamp(doctored.at[0, "started_at"]), pd.Timestamp(doctored.at[0, "ended_at"])
    doctored.loc[[0, 1], "gpu_ids"] = "7"
    doctored.at[1, "started_at"] = (a_start + (a_end - a_start) / 2).isoformat()
    doctored.at[1, "ended_at"] = (a_end + pd.Timedelta(seconds=1)).isoformat()
    doctored.to_parquet(out / "kernels_gpu4.parquet")
    bad = _report(out)
    assert bad.returncode == 1
    assert len(bad.stderr.strip().splitlines()) == 1
    assert bad.stderr.startswith("error: double-booked: kernels_gpu4.parquet: device 7 held by two jobs at once: ")
    assert "gpu=4: 8 device leases checked: FAILED: kernels_gpu4.parquet: device 7" in bad.stdout

    # touching intervals (one job starts the instant the other ended) are no double booking
    doctored.at[1, "started_at"] = a_end.isoformat()
    doctored.to_parquet(out / "kernels_gpu4.parquet")
    assert _report(out).returncode == 0

    # rows of an older schema (no lease timestamps): one line naming the file and the fix
    doctored.drop(columns=["started_at", "ended_at"]).to_parquet(out / "kernels_gpu4.parquet")
    old = _report(out)
    assert old.returncode == 2 and old.stdout == ""
    assert old.stderr.strip().splitlines() == [
        f"error: {out / 'kernels_gpu4.parquet'}: no column(s) started_at, ended_at (kernel rows of schema_version >= 3 "
        "have them); rerun the sweep with this kb_nano"
    ]
