"""Plots of merged kernel results (matplotlib, Agg canvas; no pyplot global state).

- :func:`speedup_plot`: speedup (baseline median / candidate median) per scenario per
  candidate, one panel per target, log scale, a line at 1.0, the 95% rerun interval
  (``speedup_ci_low`` .. ``speedup_ci_high``) as an error bar, hatched bars where the
  speedup is not ``significant``; rows that did not pass are marked with a red ✗ and
  their status, skipped rows with a grey ○.
- :func:`bandwidth_plot`: roofline-style view of passed rows: achieved memory bandwidth
  (``bytes_moved`` / median time, GB/s) and achieved FLOP rate (``flops`` / median time,
  GFLOP/s) against arithmetic intensity, with the device's peak bandwidth and peak FLOP
  rate drawn only when :data:`DEVICE_PEAKS` knows the device (datasheet values; no peak
  is drawn for CPUs or unknown GPUs, and the panel says so); each scenario's points are
  labelled by their shape (``n64``, ``n8 ctx1024``) while a panel has few scenarios.

Both write a PNG (100 dpi) and return its path; :func:`speedup_figure` and
:func:`bandwidth_figure` return the matplotlib ``Figure`` instead. The perf_report-style
plots (time and GB/s against num_tokens) are in :mod:`kb_nano.tracking.perf_plots`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

from kb_nano.kernels.merge import status_counts, summarize
from kb_nano.tracking.plot_style import (
    BASELINE_COLOR,
    FAILED_COLOR,
    MAX_WIDTH_IN,
    SKIPPED_COLOR,
    annotate_points,
    figure,
    log_axis,
    message_figure,
    provider_colors,
    save,
    shape_label,
)

# Device peaks: (lower-case substring of torch.cuda.get_device_name(), peak memory
# bandwidth in GB/s, {dtype: peak dense TFLOP/s}, source). First match wins, so the more
# specific names come first. Tensor-core rates are dense (the datasheets' headline BF16/FP16
# figures are "with sparsity", i.e. twice these).
DEVICE_PEAKS: list[tuple[str, float, dict[str, float], str]] = [
    (
        "h200",
        4800.0,
        {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16/FP16, 67 TFLOP/s FP32",
    ),
    (
        "h100 pcie",
        2000.0,
        {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0},
        "NVIDIA H100 Tensor Core GPU datasheet (PCIe): 2 TB/s HBM2e, 756 TFLOP/s dense BF16/FP16, 51 TFLOP/s FP32",
    ),
    (
        "h100",
        3350.0,
        {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0},
        "NVIDIA H100 Tensor Core GPU datasheet (SXM): 3.35 TB/s HBM3, 989 TFLOP/s dense BF16/FP16, 67 TFLOP/s FP32",
    ),
    (
        "a100-sxm4-80gb",
        2039.0,
        {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 2,039 GB/s HBM2e, 312 TFLOP/s dense BF16/FP16, 19.5 TFLOP/s FP32",
    ),
    (
        "a100-sxm4-40gb",
        1555.0,
        {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
        "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM): 1,555 GB/s HBM2, 312 TFLOP/s dense BF16/FP16, 19.5 TFLOP/s FP32",
    ),
]

MAX_POINT_LABELS = 24  # a roofline panel with more scenario shapes than this gets no point labels
TARGET_MARKERS = ["o", "s", "^", "D", "v", "P", "*", "h"]  # roofline marker shape per target


def device_peak(device_name: str | None, dtype: str | None = None) -> dict | None:
    """Datasheet peaks of a device: ``{"bandwidth_gbs": GB/s, "tflops": dense TFLOP/s for
    dtype (BF16 when the dtype is unknown), "source": str}``; None when the device is not
    in :data:`DEVICE_PEAKS` (e.g. every CPU)."""
    name = (device_name or "").lower()
    for pattern, bw, flops, source in DEVICE_PEAKS:
        if pattern in name:
            return {"bandwidth_gbs": bw, "tflops": flops.get(dtype or "", flops["bfloat16"]), "source": source}
    return None


def achieved(row: dict, side: str = "candidate") -> tuple[float | None, float | None]:
    """``(GB/s, GFLOP/s)`` achieved by ``side`` (candidate|baseline) of a row:
    ``bytes_moved`` / median time and ``flops`` / median time; None where unknown."""
    ms = row.get(f"{side}_ms")
    if not ms or ms <= 0 or (isinstance(ms, float) and math.isnan(ms)):
        return None, None
    sec = ms * 1e-3
    nbytes, flops = row.get("bytes_moved"), row.get("flops")
    gbs = nbytes / sec / 1e9 if nbytes else None
    gflops = flops / sec / 1e9 if flops else None
    return gbs, gflops


def _scenario_label(row: dict) -> str:
    return f"{row['model']}\ntp{row['tp']} {shape_label(row)}"


def _passed_speedup(r: dict) -> float | None:
    s = r.get("speedup")
    return s if r["status"] == "passed" and s and s > 0 else None


def _interval(r: dict) -> tuple[float, float] | None:
    lo, hi = r.get("speedup_ci_low"), r.get("speedup_ci_high")
    return (lo, hi) if lo and hi and 0 < lo <= hi else None


def speedup_figure(rows: list[dict], title: str = "kb-nano kernels: speedup over the PyTorch baseline"):
    """The figure of :func:`speedup_plot` (a matplotlib ``Figure``, not saved)."""
    targets = sorted(
        {r["target"] for r in rows}, key=lambda t: (min(r["level"] or 0 for r in rows if r["target"] == t), t)
    )
    if not targets:
        return message_figure("no kernel rows in this result set")
    colors = provider_colors(rows)
    widths = []
    for t in targets:
        n_sc = len({r["scenario_id"] for r in rows if r["target"] == t})
        n_c = len({r["candidate"] for r in rows if r["target"] == t})
        widths.append(n_sc * max(n_c, 1) * 0.45 + 2)
    width = min(max(8.0, *widths), MAX_WIDTH_IN)
    fig = figure(width, 3.4 * len(targets) + 0.8)
    axes = fig.subplots(len(targets), 1, squeeze=False)[:, 0]
    ends = [1.0]
    for r in rows:
        if _passed_speedup(r):
            ends += [r["speedup"], *(_interval(r) or ())]
    limits = (min(ends) / 1.6, max(ends) * 1.6)
    for ax, target in zip(axes, targets):
        _speedup_panel(ax, target, [r for r in rows if r["target"] == target], colors, limits)
    height = fig.get_figheight()
    fig.suptitle(
        title + "\nbars from 1.0 (above = faster); whiskers: 95% rerun interval; hatched: not significant",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / height))
    return fig


def _speedup_bar(ax, x: float, width: float, r: dict, color: str) -> None:
    """One passed row: a bar from 1.0 to its speedup (hatched when not significant), the
    95% interval as a whisker, the value past the whisker's end."""
    s = r["speedup"]
    ax.bar(
        x,
        s - 1.0,
        bottom=1.0,
        width=width,
        color=color,
        edgecolor="black",
        linewidth=0.4,
        hatch=None if r.get("significant") else "//",
        label=r["candidate"],
    )
    ci = _interval(r)
    if ci:
        err = [[max(s - ci[0], 0.0)], [max(ci[1] - s, 0.0)]]
        ax.errorbar([x], [s], yerr=err, fmt="none", ecolor="black", elinewidth=0.9, capsize=3, label=r["scenario_id"])
    up = s >= 1
    end = (ci[1] if up else ci[0]) if ci else s
    ax.text(x, end * (1.04 if up else 0.96), f"{s:.2f}x", ha="center", va="bottom" if up else "top", fontsize=7)


def _speedup_panel(ax, target: str, trows: list[dict], colors: dict, limits: tuple[float, float]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    scenarios = list(OrderedDict.fromkeys(r["scenario_id"] for r in trows))
    cands = sorted({r["candidate"] for r in trows})
    by_key = {(r["scenario_id"], r["candidate"]): r for r in trows}
    bar_w = 0.8 / max(len(cands), 1)
    for j, cand in enumerate(cands):
        for i, sid in enumerate(scenarios):
            r = by_key.get((sid, cand))
            if r is None:
                continue
            x = i - 0.4 + bar_w * (j + 0.5)
            status = r["status"]
            if _passed_speedup(r):
                _speedup_bar(ax, x, bar_w * 0.9, r, colors[cand])
            elif status == "skipped":
                ax.plot([x], [1.0], marker="o", mfc="none", mec=SKIPPED_COLOR, ms=7, ls="none")
            else:
                ax.plot([x], [1.0], marker="X", color=FAILED_COLOR, ms=11, ls="none", mec="black", mew=0.5)
                ax.text(x, 1.0 * 0.93, status, ha="center", va="top", fontsize=7, color=FAILED_COLOR, rotation=90)
    ax.axhline(1.0, color="black", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set_ylim(*limits)
    log_axis(ax.yaxis, "x", subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0))
    ax.set_xlim(-0.6, len(scenarios) - 0.4)
    ax.set_xticks(range(len(scenarios)))
    first = {sid: next(r for r in trows if r["scenario_id"] == sid) for sid in scenarios}
    ax.set_xticklabels([_scenario_label(first[s]) for s in scenarios], fontsize=8)
    ax.set_ylabel("speedup (log)")
    failed = summarize([r for r in trows if r["status"] not in ("passed", "skipped")])["by_status"]
    ax.set_title(f"{target}" + (f"  —  {status_counts(failed)}" if failed else ""), loc="left", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.25)
    handles = [Patch(facecolor=colors[c], edgecolor="black", label=c) for c in cands]
    if any(_passed_speedup(r) and not r.get("significant") for r in trows):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="not significant"))
    if failed:
        handles.append(
            Line2D([], [], marker="X", color=FAILED_COLOR, ls="none", ms=9, label="not passed (status below)")
        )
    if any(r["status"] == "skipped" for r in trows):
        handles.append(Line2D([], [], marker="o", mfc="none", mec=SKIPPED_COLOR, ls="none", ms=7, label="skipped"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def speedup_plot(
    rows: list[dict], out: Path, title: str = "kb-nano kernels: speedup over the PyTorch baseline"
) -> Path:
    """Grouped bars of speedup (baseline median ms / candidate median ms) per scenario (x)
    and candidate (colour, :func:`~kb_nano.tracking.plot_style.provider_colors`), one panel
    per target, log y axis, dashed line at 1.0 (bars start at 1.0: up = faster). Whiskers
    are the 95% rerun interval (``speedup_ci_low`` .. ``speedup_ci_high``); a bar whose
    row is not ``significant`` (the interval includes 1.0, or there is none) is hatched.
    Rows with a failure status get a red ✗ at 1.0 and the status; skipped rows a grey ○.
    Writes a PNG to ``out`` (parent created) and returns it."""
    return save(speedup_figure(rows, title), out)


def _device(r: dict) -> str:
    return r.get("device_name") or r.get("device") or "unknown"


def bandwidth_figure(rows: list[dict], title: str = "kb-nano kernels: achieved bandwidth and FLOP rate"):
    """The figure of :func:`bandwidth_plot` (a matplotlib ``Figure``, not saved)."""
    from matplotlib.lines import Line2D

    passed = [r for r in rows if r["status"] == "passed" and r.get("bytes_moved") and r.get("candidate_ms")]
    devices = sorted({_device(r) for r in passed})
    if not devices:
        return message_figure("no passed rows with bytes_moved and timings in this result set")
    colors = provider_colors(rows)
    targets = sorted({r["target"] for r in passed})
    markers = {t: TARGET_MARKERS[i % len(TARGET_MARKERS)] for i, t in enumerate(targets)}
    fig = figure(13, 4.6 * len(devices) + 0.6)
    axes = fig.subplots(len(devices), 2, squeeze=False)
    labels = []
    for (ax_bw, ax_fl), dev in zip(axes, devices):
        tops = _device_panels(ax_bw, ax_fl, dev, [r for r in passed if _device(r) == dev], colors, markers)
        labels += [(ax_bw, tops[0]), (ax_fl, tops[1])]
    handles = [
        Line2D([], [], marker=markers[r["target"]], color=colors[c], ls="none", label=c)
        for c, r in sorted({r["candidate"]: r for r in passed}.items())
    ]
    handles.append(Line2D([], [], marker="o", mfc="none", mec=BASELINE_COLOR, ls="none", ms=8, label="baseline"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(handles) // 4), 1, 0.97))
    for ax, top in labels:  # placed in pixels, so after the layout
        if len(top) <= MAX_POINT_LABELS:
            annotate_points(ax, top)
    return fig


def _device_panels(ax_bw, ax_fl, dev: str, drows: list[dict], colors: dict, markers: dict) -> tuple[dict, dict]:
    """Draw one device's two panels; returns per panel ``{(x, shape label): highest y}``."""
    dtypes = sorted({r["dtype"] for r in drows})
    peak = device_peak(dev, dtypes[0] if len(dtypes) == 1 else None)
    kind = sorted({r.get("device") or "?" for r in drows})
    seen_baseline: set[str] = set()
    tops: tuple[dict, dict] = ({}, {})  # per panel: (x, shape label) -> highest y drawn there
    for r in drows:
        ai = r["flops"] / r["bytes_moved"] if r.get("flops") else None
        m = markers[r["target"]]
        sides = [("candidate", dict(marker=m, color=colors[r["candidate"]], ms=6))]
        if r["scenario_id"] not in seen_baseline:
            seen_baseline.add(r["scenario_id"])
            sides.append(("baseline", dict(marker=m, mfc="none", mec=BASELINE_COLOR, ms=8)))
        for side, style in sides:
            gbs, gfl = achieved(r, side)
            for ax, top, x, y in ((ax_bw, tops[0], r["bytes_moved"], gbs), (ax_fl, tops[1], ai, gfl)):
                if x and y:
                    ax.plot([x], [y], ls="none", **style)
                    key = (x, shape_label(r))
                    top[key] = max(top.get(key, 0.0), y)
    for ax in (ax_bw, ax_fl):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(which="both", alpha=0.25)
    ax_bw.set_xlabel("bytes moved per call")
    ax_bw.set_ylabel("achieved bandwidth (GB/s)")
    ax_fl.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax_fl.set_ylabel("achieved GFLOP/s")
    label = f"{dev} ({', '.join(kind)}; {', '.join(dtypes)})"
    if peak:
        ax_bw.axhline(peak["bandwidth_gbs"], color=FAILED_COLOR, lw=1.2)
        ax_bw.text(
            ax_bw.get_xlim()[0],
            peak["bandwidth_gbs"] * 1.08,
            f" peak {peak['bandwidth_gbs']:,.0f} GB/s",
            color=FAILED_COLOR,
            fontsize=8,
            va="bottom",
        )
        _roofline(ax_fl, peak)
        ax_bw.set_ylim(top=peak["bandwidth_gbs"] * 2)
        note = f"peak: {peak['source']}"
    else:
        note = "device peak unknown (no datasheet entry for this device): no roof drawn"
    for ax in (ax_bw, ax_fl):
        log_axis(ax.xaxis)
        log_axis(ax.yaxis)
    if len(tops[0]) > MAX_POINT_LABELS:
        label += f"; {len(tops[0])} shapes: point labels left out above {MAX_POINT_LABELS}"
    ax_bw.set_title(label, loc="left", fontsize=9)
    ax_fl.set_title(note, loc="left", fontsize=7, wrap=True)
    return tops


def bandwidth_plot(
    rows: list[dict], out: Path, title: str = "kb-nano kernels: achieved bandwidth and FLOP rate"
) -> Path:
    """Roofline-style view of passed rows, one row of two panels per device name.

    Left: achieved memory bandwidth (GB/s, log) per row against bytes moved per call;
    candidates in colour (one marker shape per target), the baseline as grey hollow
    markers (once per scenario), and a red line at the device's peak bandwidth when known.
    Right: achieved GFLOP/s against arithmetic intensity (FLOP/byte) with the roofline
    ``min(peak FLOP/s, AI × peak bandwidth)`` when the device is known. Each scenario's
    points are labelled once with its shape (``n64``, ``n8 ctx1024``) right of the highest
    of them (moved up, with a leader line, where labels would overlap), while a panel has
    at most :data:`MAX_POINT_LABELS` shapes. CUDA and CPU rows
    alike (CPU: no peak line; the panel names the reason). Writes a PNG to ``out`` and
    returns it."""
    return save(bandwidth_figure(rows, title), out)


def _roofline(ax, peak: dict) -> None:
    lo, hi = ax.get_xlim()
    lo, hi = min(lo, 1e-2), max(hi, 1e3)
    bw = peak["bandwidth_gbs"]  # GB/s -> GFLOP/s per FLOP/byte
    top = peak["tflops"] * 1e3  # GFLOP/s
    knee = top / bw
    xs = [lo, min(max(knee, lo), hi), hi]
    ys = [min(top, x * bw) for x in xs]
    ax.plot(xs, ys, color=FAILED_COLOR, lw=1.2)
    ax.text(
        hi, top * 1.08, f"peak {peak['tflops']:,.0f} TFLOP/s ", color=FAILED_COLOR, fontsize=8, ha="right", va="bottom"
    )
    ax.set_xlim(lo, hi)
    ax.set_ylim(top=top * 3)


def kernel_plots(
    rows: list[dict],
    speedup_out: Path,
    bandwidth_out: Path,
    time_out: Path | None = None,
    gbs_out: Path | None = None,
) -> list[Path]:
    """The kernel plots of a merged result set: speedup, roofline, and (when their paths
    are given) the perf_report-style time and GB/s plots of
    :mod:`kb_nano.tracking.perf_plots`; returns the paths written."""
    from kb_nano.tracking.perf_plots import perf_plot

    paths = [speedup_plot(rows, speedup_out), bandwidth_plot(rows, bandwidth_out)]
    for metric, out in (("ms", time_out), ("gbs", gbs_out)):
        if out is not None:
            paths.append(perf_plot(rows, out, metric))
    return paths
