"""Per-kernel floor of three GPU timers on tiny kernels (bench/FIDELITY.md, "Kernel time").

    python bench/ncu_floor.py          # needs CUDA, Triton and ncu (/usr/local/cuda/bin/ncu)

For each workload (an empty Triton kernel; one-element ``add_``; SiLU of one 14336-wide
bf16 row; the 8-kernel unfused RMSNorm of one 4096-wide bf16 row, kb-nano's baseline form)
it prints the time of one call, and per kernel, by

- ncu: ``gpu__time_duration.sum`` (``--cache-control none --clock-control none``), 20
  calls, each after a marker kernel (``torch.cuda._sleep``);
- CUPTI activity records (kb-nano's kernel timer, :class:`kb_nano.kernels.cupti_lib.ActivityTrace`),
  each kernel's end minus start: ``isolated`` (the device synchronized and idle for 0.5 ms
  before each call, as ncu runs them) and ``queued`` (200 calls launched back to back);
- a CUDA graph of 200 calls replayed 20 times (events around each replay, divided by 200):
  what the calls cost on the device when nothing else limits them.

If ncu's time per kernel exceeds both CUPTI's and the graph's by a constant, that constant
is ncu's own (its serialised, instrumented launch), not time the kernel takes when it runs.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

CALLS, GRAPH_CALLS, REPLAYS = 20, 200, 20


def workloads(device: torch.device) -> dict:
    """name -> zero-argument call."""
    import triton

    @triton.jit
    def nop(x_ptr):
        pass

    one = torch.zeros(1, dtype=torch.bfloat16, device=device)
    row = torch.randn(1, 14336, dtype=torch.bfloat16, device=device)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)
    w = torch.randn(4096, dtype=torch.bfloat16, device=device)

    def rms_norm():  # 8 kernels: to, pow, mean, add, rsqrt, mul, to, mul
        h = x.to(torch.float32)
        v = h.pow(2).mean(-1, keepdim=True)
        return w * (h * torch.rsqrt(v + 1e-6)).to(torch.bfloat16)

    return {
        "empty Triton kernel": lambda: nop[(1,)](one),
        "add_ on 1 element": lambda: one.add_(1.0),
        "SiLU of 1x14336 bf16": lambda: torch.nn.functional.silu(row),
        "unfused RMSNorm 1x4096 bf16": rms_norm,
    }


def child(out_path: str) -> None:
    """Under ncu: CALLS calls of each workload, a marker kernel before each."""
    device = torch.device("cuda")
    work = workloads(device)
    for call in work.values():
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in work.values():
        for _ in range(CALLS):
            torch.cuda._sleep(100)
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    Path(out_path).write_text(json.dumps(list(work)))


def ncu_us(names: list[str]) -> dict:
    """workload -> (median us per call, kernels per call) by ncu."""
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--profile-from-start", "off", "--cache-control", "none", "--clock-control", "none"]
    cmd += ["--metrics", "gpu__time_duration.sum", "--csv", "--page", "raw"]
    cmd += [sys.executable, __file__, "--child", "/tmp/ncu_floor_names.json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('"')]
    table = list(csv.DictReader(io.StringIO("\n".join(lines))))
    unit = table[0]["gpu__time_duration.sum"] if not (table[0].get("ID") or "").isdigit() else "nsecond"
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit]
    calls = []
    for r in table:
        try:
            v = float(r["gpu__time_duration.sum"].replace(",", "")) * scale
        except ValueError:
            continue
        if "spin" in r["Kernel Name"]:
            calls.append([])
        elif calls:
            calls[-1].append(v)
    if len(calls) != CALLS * len(names):
        raise SystemExit(f"ncu gave {len(calls)} calls, expected {CALLS * len(names)}:\n{proc.stderr[-2000:]}")
    return {
        n: (statistics.median(sum(c) for c in calls[i * CALLS : (i + 1) * CALLS]), len(calls[i * CALLS]))
        for i, n in enumerate(names)
    }


def cupti_us(call, trace, isolated: bool) -> tuple[float, int]:
    """Median us per call (sum of its kernels' end - start) and kernels per call."""
    torch.cuda.synchronize()
    trace.start()
    n = CALLS if isolated else GRAPH_CALLS
    for _ in range(n):
        if isolated:
            torch.cuda.synchronize()
            time.sleep(0.0005)
        call()
    torch.cuda.synchronize()
    recs = sorted(trace.stop(), key=lambda r: r[2])
    per = len(recs) // n
    durs = [(e - s) / 1e3 for _, _, s, e in recs]
    return statistics.median(sum(durs[i * per : (i + 1) * per]) for i in range(n)), per


def graph_us(call) -> float:
    """Median us per call over REPLAYS replays of a graph of GRAPH_CALLS calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            call()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / GRAPH_CALLS)
    return statistics.median(times)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    from kb_nano.kernels.cupti_lib import ActivityTrace

    device = torch.device("cuda")
    work = workloads(device)
    trace = ActivityTrace()
    rows = {}
    for name, call in work.items():
        for _ in range(3):
            call()
        iso, k = cupti_us(call, trace, True)
        queued, _ = cupti_us(call, trace, False)
        rows[name] = {"kernels": k, "cupti_isolated": iso, "cupti_queued": queued, "graph": graph_us(call)}
    for name, (us, k) in ncu_us(list(work)).items():
        rows[name].update(ncu=us, ncu_kernels=k)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    print(f"{smi}, torch {torch.__version__}; python bench/ncu_floor.py; us per call (per kernel)\n")
    print(
        "| workload | kernels | ncu | CUPTI isolated | CUPTI queued | CUDA graph | ncu - CUPTI isolated, per kernel |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        k = r["kernels"]
        cells = [f"{r[c]:.2f} ({r[c] / k:.2f})" for c in ("ncu", "cupti_isolated", "cupti_queued", "graph")]
        kernels = f"{k}" if r["ncu_kernels"] == k else f"{k} (ncu {r['ncu_kernels']})"
        diff = (r["ncu"] - r["cupti_isolated"]) / k
        print(f"| {name} | {kernels} | " + " | ".join(cells) + f" | {diff:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
