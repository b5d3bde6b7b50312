"""Kernel by kernel for the fidelity bench (bench/fidelity.py): each GPU record of a call
timed by CUPTI (kb-nano's activity trace and flush, in the bench's process) next to the
same kernel's ncu time (bench/fidelity_ncu.py), with the call table's agreement rule
applied to each kernel."""

from __future__ import annotations

import statistics

import torch

KERNEL_REL, KERNEL_ABS_MS = 0.05, 0.001  # agreement: 5 % from 10 us up, 1 us below


_TRACE = []


def activity_trace():
    """This process's one :class:`~kb_nano.kernels.cupti_lib.ActivityTrace` (kb-nano's CUPTI
    reader), made at the first call. The bench reads every CUPTI time through it and never
    through ``torch.profiler``: measured on the H200 (2026-12-03, bench/FIDELITY.md), a trace made after a ``torch.profiler`` session in the same process
    reads each kernel about 2.1x longer (rms_norm 4096 x 4096: 42.6 vs 20.2 us), and one made
    before such a session receives no records after it."""
    from kb_nano.kernels.cupti_lib import ActivityTrace

    if not _TRACE:
        _TRACE.append(ActivityTrace())
    return _TRACE[0]


def cupti_each_ms(
    module, inputs: list, device: torch.device, calls: int = 5, warm_s: float = 0.2
) -> tuple[list[tuple[str, float]] | None, float | None]:
    """``(name, median ms)`` of each GPU record one call of ``module`` makes, by position,
    from CUPTI activity records (:func:`activity_trace`)
    over ``calls`` calls, each after kb-nano's reading flush on its own stream, as the
    kernel timer runs them; the flush's records are left out; None when the calls made
    different record counts. Also the median SM clock (MHz, NVML; None without NVML)
    sampled around the calls. The GPU is kept busy with the module for ``warm_s`` seconds
    first, so an idle GPU's lowered clock is not what is measured."""
    import time

    from kb_nano.kernels.blocks import SmClock
    from kb_nano.kernels.timing import L2Flush

    trace, flush, clock = activity_trace(), L2Flush(device), SmClock(device)
    with torch.inference_mode():
        end = time.perf_counter() + warm_s
        while time.perf_counter() < end:
            for _ in range(3):
                flush()
                module(*inputs)
            torch.cuda.synchronize()
        clock.sample()
        trace.start()
        flush()
        torch.cuda.synchronize()
        flush_stream = trace.stop()[0][0]
        trace.start()
        for _ in range(calls):
            flush()
            module(*inputs)
        clock.sample()
        torch.cuda.synchronize()
        recs = sorted((r for r in trace.stop() if r[0] != flush_stream), key=lambda r: r[2])
    mhz = clock.fields().get("sm_clock_mhz")
    per = len(recs) // calls
    if not recs or per * calls != len(recs):
        return None, mhz
    each = [
        (recs[j][1], statistics.median((recs[i * per + j][3] - recs[i * per + j][2]) / 1e6 for i in range(calls)))
        for j in range(per)
    ]
    return each, mhz


def each_table(rows: list[dict]) -> list[str]:
    """Kernel by kernel: each kernel's CUPTI time (this process, kb-nano's flush) against
    its ncu time, with the agreement rule of the call table applied to each kernel."""
    out = [
        "",
        "## Kernel by kernel: CUPTI vs ncu",
        "",
        "| row | side | kernels agreeing | ncu - CUPTI per kernel, us (mean) | CUPTI sum vs the row's kernel time "
        "| SM MHz | worst kernel: CUPTI us, ncu us |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    ok_all, n_all, offsets = 0, 0, []
    for r in rows:
        for side in ("baseline", "candidate"):
            mine, ref = r.get(f"cupti_{side}_each"), r.get(f"ncu_{side}_each_ms")
            if not mine or not ref or len(mine) != len(ref):
                continue
            diffs = [
                (abs(n - c) - (KERNEL_REL * n if n >= 0.010 else KERNEL_ABS_MS), nm, c, n)
                for (nm, c), n in zip(mine, ref)
            ]
            ok = sum(d[0] <= 0 for d in diffs)
            ok_all, n_all = ok_all + ok, n_all + len(diffs)
            off = statistics.mean(n - c for (_, c), n in zip(mine, ref)) * 1e3
            offsets.append(off)
            worst = max(diffs)
            total = sum(c for _, c in mine)
            out.append(
                f"| {r['row']} | {side} | {ok} of {len(diffs)} | {off:+.2f} | "
                f"{100 * (total / r[f'{side}_kernel_ms'] - 1):+.1f}% | {r.get(f'cupti_{side}_each_mhz') or '-'} | "
                f"{worst[1][:40]}: {worst[2] * 1e3:.2f}, {worst[3] * 1e3:.2f} |"
            )
    if n_all:
        out += [
            "",
            f"{ok_all} of {n_all} kernels agree with ncu; ncu reads a median "
            f"{statistics.median(offsets):+.2f} us more per kernel than CUPTI.",
        ]
    return out
