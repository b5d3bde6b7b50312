"""Kernel time by Nsight Compute for the fidelity bench (bench/fidelity.py): ``ncu_ms`` runs
this file under ``ncu`` as the child that calls every row's modules.

    ncu ... python bench/fidelity_ncu.py JOBS.json     # the child (ncu_ms builds the command)
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from fidelity_rows import input_sets, modules

NCU_CALLS = 5


def ncu_child(spec_path: str) -> None:
    """Runs under ncu: every module of the rows, ``NCU_CALLS`` calls each, a marker kernel
    and kb-nano's flush before each call; profiling only around those calls."""
    from kb_nano.kernels.timing import L2Flush

    device = torch.device("cuda")
    jobs = json.loads(Path(spec_path).read_text())
    flush = L2Flush(device)
    built = []
    with torch.inference_mode():
        for scenario, candidate in jobs:
            mods = modules(scenario, candidate, device)
            inputs = input_sets(scenario, device, 1)[0]
            for who in ("baseline", "candidate"):
                for _ in range(3):
                    mods[who](*inputs)
                built.append((mods[who], inputs))
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for module, inputs in built:
            for _ in range(NCU_CALLS):
                torch.cuda._sleep(100)
                flush()
                module(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def each_median(calls: list[dict]) -> list[float] | None:
    """Per kernel position, the median of its time (ms) over ``calls`` (each with
    ``each_ms``); None when the calls ran different kernel counts."""
    if len({len(c["each_ms"]) for c in calls}) != 1:
        return None
    return [statistics.median(c["each_ms"][j] for c in calls) for j in range(len(calls[0]["each_ms"]))]


def ncu_ms(jobs: list, out_dir: Path) -> list[tuple[dict, dict]] | str:
    """Per job, (baseline, candidate): ``{"ms": median ncu time of one call, "kernels": its
    kernel count, "names": its kernels' names, "each_ms": each kernel's median time}``; or
    why not."""
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists():
        return "ncu not found"
    spec = out_dir / "ncu_jobs.json"
    spec.write_text(json.dumps(jobs))
    cmd = [
        ncu,
        "--profile-from-start",
        "off",
        "--cache-control",
        "none",
        "--clock-control",
        "none",
        "--metrics",
        "gpu__time_duration.sum",
        "--csv",
        "--page",
        "raw",
        sys.executable,
        str(Path(__file__).resolve()),
        str(spec),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ})
    (out_dir / "ncu.log").write_text(proc.stdout[-200000:] + "\n--- stderr ---\n" + proc.stderr[-20000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('"')]
    if proc.returncode != 0 or not lines:
        return f"ncu failed (exit {proc.returncode}); see {out_dir / 'ncu.log'}"
    table = list(csv.DictReader(io.StringIO("\n".join(lines))))
    kernels = [(r["Kernel Name"], r["gpu__time_duration.sum"]) for r in table if r.get("gpu__time_duration.sum")]
    units = table[0].get("gpu__time_duration.sum") if table and not (table[0].get("ID") or "").isdigit() else "nsecond"
    scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}[units]
    calls, cur = [], None
    for name, value in kernels:
        try:
            v = float(value.replace(",", ""))
        except ValueError:
            continue
        if "spin" in name:  # the marker: a new call; the next kernel is the flush
            cur = {"skip": 1, "ms": 0.0, "names": [], "each_ms": []}
            calls.append(cur)
        elif cur is not None and cur["skip"]:
            cur["skip"] = 0
        elif cur is not None:
            cur["ms"] += v * scale
            cur["names"].append(name)
            cur["each_ms"].append(v * scale)
    if len(calls) != 2 * NCU_CALLS * len(jobs):
        return f"ncu gave {len(calls)} calls, expected {2 * NCU_CALLS * len(jobs)}; see {out_dir / 'ncu.log'}"
    med = [
        {
            "ms": statistics.median(c["ms"] for c in calls[i : i + NCU_CALLS]),
            "kernels": len(calls[i]["names"]),
            "names": calls[i]["names"],
            "each_ms": each_median(calls[i : i + NCU_CALLS]),
        }
        for i in range(0, len(calls), NCU_CALLS)
    ]
    return [(med[2 * j], med[2 * j + 1]) for j in range(len(jobs))]


if __name__ == "__main__":
    ncu_child(sys.argv[1])
