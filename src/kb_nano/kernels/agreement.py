"""The three timers' columns of a row, and the checks that they tell one consistent story.

Columns (ms per call, medians over blocks of each block's mean call time, as
:func:`kb_nano.kernels.blocks.estimate`; None where a timer has no samples):
``baseline_eager_ms`` / ``candidate_eager_ms`` / ``eager_speedup`` (CPU: host clock
around the call; CUDA: an event pair around it, host launch included),
``baseline_kernel_ms`` / ``candidate_kernel_ms`` / ``kernel_speedup`` (CUDA: CUPTI, the
GPU time of the call's kernels, L2 cold), ``baseline_graph_ms`` / ``candidate_graph_ms``
/ ``graph_speedup`` (CUDA: K calls per graph replay, divided by K), the kernel-record
counts per call, ``launch_overhead_ms`` (the candidate's eager minus kernel time) and
``hidden_work_ms``.

Agreement (CUDA; ``timer_check`` says what disagrees, None when all agree). The kernel
time is the floor of the other two: a call cannot take less than its kernels. Beyond
that:

- **graph vs kernel**: a replayed call may exceed its kernels' time only by the gaps the
  device leaves between a graph's kernels (:data:`GRAPH_GAP_MS` per kernel) plus
  :data:`TOLERANCE`; more means the kernel records miss work the graph runs;
- **gaps inside the candidate's call**: from its first record's start to its last
  record's end, a call may exceed its kernels' time by :data:`LAUNCH_GAP_MS` per record
  plus :data:`TOLERANCE`; more means the device waited inside the call (host work or a
  synchronize between its kernels), which the kernel time leaves out and the eager time
  counts. (The baseline's gaps are not checked: an unfused PyTorch baseline launches
  several kernels from Python, and under the profiler the host is slower than the GPU.)

Host launch time alone is not a disagreement: ``launch_overhead_ms`` shows it (a Triton
kernel's Python launcher costs tens of microseconds), and the kernel and graph timers
leave it out by design.

The allowances come from the H200 runs in bench/FIDELITY.md: a graph's kernels start about
1 us apart; under the profiler a PyTorch op's host launch took up to ~12 us.
"""

from __future__ import annotations

import torch

from kb_nano.kernels import timing

GRAPH_GAP_MS = 0.002  # per kernel of a call: the device's gap between a graph's kernels, with margin
LAUNCH_GAP_MS = 0.03  # per record of a call: a launch gap under the profiler on a busy host, with margin
TOLERANCE = 0.10  # relative slack of every comparison


def _median(xs: list) -> float | None:
    return timing.summarize(xs)[0] if xs else None


def timer_fields(s: dict, device: torch.device) -> dict:
    """The row's per-timer columns and ``timer_check`` from the samples ``s``
    (:func:`kb_nano.kernels.blocks.new_samples`)."""
    out: dict = {}
    for timer in ("eager", "kernel", "graph"):
        p = s[timer]
        b, c = _median(p["block_base"]), _median(p["block_cand"])
        out[f"baseline_{timer}_ms"], out[f"candidate_{timer}_ms"] = b, c
        out[f"{timer}_speedup"] = b / c if b is not None and c else None
    k = s["kernel"]
    out["baseline_kernels"] = int(_median(k["kernels_base"])) if k["kernels_base"] else None
    out["candidate_kernels"] = int(_median(k["kernels_cand"])) if k["kernels_cand"] else None
    if s["errors"].get("graph") not in (None, "CPU", "cuda_graph: false"):
        out["graph_error"] = s["errors"]["graph"]
    if device.type != "cuda":
        return out
    out["hidden_work_ms"] = max(k["hidden"]) if k["hidden"] else None
    ce, ck = out["candidate_eager_ms"], out["candidate_kernel_ms"]
    out["launch_overhead_ms"] = ce - ck if ce is not None and ck is not None else None
    notes = [f"kernel timer: {s['errors']['kernel']}"] if "kernel" in s["errors"] else []
    notes += disagreements(out, k)
    out["timer_check"] = "; ".join(notes) or None
    return out


def disagreements(out: dict, k: dict) -> list[str]:
    """The agreement checks of the module docstring over the row's columns ``out`` and the
    kernel timer's samples ``k``; one message per failed check."""
    notes = []
    for side, name in (("candidate", "cand"), ("baseline", "base")):
        kern, graph = out[f"{side}_kernel_ms"], out[f"{side}_graph_ms"]
        count = out[f"{side}_kernels"] or 1
        if kern is not None and graph is not None and graph > kern * (1 + TOLERANCE) + count * GRAPH_GAP_MS:
            notes.append(
                f"{side}: graph time {graph:.4g} ms per call exceeds its kernel time {kern:.4g} ms by more "
                f"than {count} kernel gap(s): the kernel records miss work the graph runs"
            )
        spans = k[f"span_{name}"]
        if side == "candidate" and kern is not None and spans:
            span = _median(spans)
            if span > kern * (1 + TOLERANCE) + count * LAUNCH_GAP_MS:
                notes.append(
                    f"{side}: the device waited {span - kern:.4g} ms inside each call between its kernels "
                    "(host work or a synchronize), which the kernel time leaves out"
                )
    return notes
