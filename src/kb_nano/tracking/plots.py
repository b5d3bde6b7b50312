"""The roofline-style plot of merged kernel results (matplotlib, Agg canvas; no pyplot
global state) and :func:`kernel_plots`, which writes every kernel plot.

:func:`bandwidth_plot`: achieved memory bandwidth (``bytes_moved`` / median time, GB/s)
against bytes moved, and achieved FLOP rate (``flops`` / median time, GFLOP/s) against
arithmetic intensity, of the passed rows, with the device's peak bandwidth and peak FLOP
rate drawn only when :data:`DEVICE_PEAKS` knows the device (datasheet values; no peak is
drawn for CPUs or unknown GPUs, and the panel says so); every scenario's points are
labelled by their shape (``n64``, ``n8 ctx1024``), and a label that finds no free place
is listed under its panel. It writes a PNG (100 dpi) and returns its path;
:func:`bandwidth_figure` returns the matplotlib ``Figure`` instead. The speedup plot is in
:mod:`kb_nano.tracking.speedup_plots`, the perf_report-style plots (time and GB/s against
num_tokens) in :mod:`kb_nano.tracking.perf_plots`.
"""

from __future__ import annotations

import math
from pathlib import Path

from kb_nano.tracking.plot_style import (
    BASELINE_COLOR,
    FAILED_COLOR,
    annotate_points,
    figure,
    human,
    log_axis,
    message_figure,
    provider_colors,
    save,
    shape_label,
    widen_log_limits,
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

CROWDED_LABELS = 24  # above this many shapes a roofline panel's point labels get a smaller font
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
    _label_points(fig, labels, rect=(0, 0.06 + 0.02 * (len(handles) // 4), 1, 0.97))
    return fig


def _label_points(fig, labels: list[tuple], rect: tuple) -> None:
    """Label each panel's points by shape (:func:`annotate_points`; placed in pixels, so
    after the layout). The labels that find no free place are listed under their panel
    with their coordinates (``gid="unplaced_labels"``); the layout is redone once to make
    room for that list, sized by a first placement."""

    def size(top: dict) -> float:
        return 6.0 if len(top) <= CROWDED_LABELS else 5.0

    notes = {}
    for ax, top in labels:
        left = annotate_points(ax, top, size(top), draw=False)
        if left:  # a placeholder of the list's height, so that the layout makes room for it
            text = "\n".join(["x"] * (2 + len(left) // 6))
            notes[ax] = ax.text(0.0, -0.2, text, transform=ax.transAxes, fontsize=6, va="top", gid="unplaced_labels")
    if notes:
        fig.tight_layout(rect=rect)
    for ax, top in labels:
        left = annotate_points(ax, top, size(top))
        if left and ax not in notes:
            notes[ax] = ax.text(0.0, -0.2, "", transform=ax.transAxes, fontsize=6, va="top", gid="unplaced_labels")
        if ax in notes:
            notes[ax].set_text(_unplaced_text(ax, left, top))


def _unplaced_text(ax, left: list[tuple[float, str]], top: dict) -> str:
    """``labels with no room (shape: x, y): n16: 1.4M, 5.6; ...``, 6 entries a line; ``""``
    when none."""
    if not left:
        return ""
    xl, yl = ax.get_xlabel().split(" (")[0], ax.get_ylabel()
    items = [f"{text}: {human(float(f'{x:.3g}'))}, {human(float(f'{top[(x, text)]:.3g}'))}" for x, text in sorted(left)]
    lines = ["; ".join(items[i : i + 6]) for i in range(0, len(items), 6)]
    return f"labels with no room (shape: {xl}, {yl}):\n" + "\n".join(lines)


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
        for axis in (ax.xaxis, ax.yaxis):
            widen_log_limits(axis)
            log_axis(axis)
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
    of them (moved, with a leader line, where labels would overlap; in a smaller font above
    :data:`CROWDED_LABELS` shapes); a label with no free place in its panel is listed under
    the panel with its point's coordinates. CUDA and CPU rows
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
    from kb_nano.tracking.speedup_plots import speedup_plot

    paths = [speedup_plot(rows, speedup_out), bandwidth_plot(rows, bandwidth_out)]
    for metric, out in (("ms", time_out), ("gbs", gbs_out)):
        if out is not None:
            paths.append(perf_plot(rows, out, metric))
    return paths
