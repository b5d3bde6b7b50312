"""Kernel by kernel for the fidelity bench (bench/fidelity.py): each GPU record of a call
timed by CUPTI (kb-nano's activity trace and flush, in the bench's process) next to the
same kernel's ncu time (bench/fidelity_ncu.py), with the call table's agreement rule
applied to each kernel."""

from __future__ import annotations

import statistics

import torch

KERNEL_REL, KERNEL_ABS_MS = 0.05, 0.001  # agreement: 5 % from 10 us up, 1 us below


_TRACE = []


def cupti_each_ms(module, inputs: list, device: torch.device, calls: int = 5) -> list[tuple[str, float]] | None:
    """``(name, median ms)`` of each GPU record one call of ``module`` makes, by position,
    from CUPTI activity records (kb-nano's :class:`~kb_nano.kernels.cupti_lib.ActivityTrace`)
    over ``calls`` calls, each after kb-nano's reading flush on its own stream, as the
    kernel timer runs them; the flush's records are left out. None when the calls made
    different record counts."""
    from kb_nano.kernels.cupti_lib import ActivityTrace
    from kb_nano.kernels.timing import L2Flush

    if not _TRACE:
        _TRACE.append(ActivityTrace())
    trace, flush = _TRACE[0], L2Flush(device)
    with torch.inference_mode():
        for _ in range(3):
            flush()
            module(*inputs)
        torch.cuda.synchronize()
        trace.start()
        flush()
        torch.cuda.synchronize()
        flush_stream = trace.stop()[0][0]
        trace.start()
        for _ in range(calls):
            flush()
            module(*inputs)
        torch.cuda.synchronize()
        recs = sorted((r for r in trace.stop() if r[0] != flush_stream), key=lambda r: r[2])
    per = len(recs) // calls
    if not recs or per * calls != len(recs):
        return None
    return [
        (recs[j][1], statistics.median((recs[i * per + j][3] - recs[i * per + j][2]) / 1e6 for i in range(calls)))
        for j in range(per)
    ]


def each_table(rows: list[dict]) -> list[str]:
    """Kernel by kernel: each kernel's CUPTI time (this process, kb-nano's flush) against
    its ncu time, with the agreement rule of the call table applied to each kernel."""
    out = [
        "",
        "## Kernel by kernel: CUPTI vs ncu",
        "",
        "| row | side | kernels agreeing | ncu - CUPTI per kernel, us (mean) | CUPTI sum vs the row's kernel time "
        "| worst kernel: CUPTI us, ncu us |",
        "| --- | --- | ---: | ---: | ---: | --- |",
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
                f"{100 * (total / r[f'{side}_kernel_ms'] - 1):+.1f}% | "
                f"{worst[1][:40]}: {worst[2] * 1e3:.2f}, {worst[3] * 1e3:.2f} |"
            )
    if n_all:
        out += [
            "",
            f"{ok_all} of {n_all} kernels agree with ncu; ncu reads a median "
            f"{statistics.median(offsets):+.2f} us more per kernel than CUPTI.",
        ]
    return out
