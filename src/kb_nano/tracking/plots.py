"""Plots of merged kernel results (matplotlib, Agg canvas; no pyplot global state).

- :func:`speedup_plot`: speedup (baseline median / candidate median) per scenario per
  candidate, one panel per target, log scale, a line at 1.0; rows that did not pass are
  marked with a red ✗ and their status, skipped rows with a grey ○.
- :func:`bandwidth_plot`: roofline-style view of passed rows: achieved memory bandwidth
  (``bytes_moved`` / median time, GB/s) and achieved FLOP rate (``flops`` / median time,
  GFLOP/s) against arithmetic intensity, with the device's peak bandwidth and peak FLOP
  rate drawn only when :data:`DEVICE_PEAKS` knows the device (datasheet values; no peak
  is drawn for CPUs or unknown GPUs, and the panel says so).

Both write a PNG (100 dpi) and return its path.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

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

FAILED_COLOR = "#d62728"
SKIPPED_COLOR = "#8c8c8c"
BASELINE_COLOR = "#555555"
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
MAX_WIDTH_IN = 30.0


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


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _human(v: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:g}{unit}"
    return f"{v:g}"


def _log_axis(axis, suffix: str = "", subs=(1.0, 2.0, 5.0)) -> None:
    """Readable log-axis ticks (0.5x 1x 2x; 1k 1M) instead of 10^n notation; only decades
    when the axis spans more than 2.5 of them. Call after the limits are final."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    if lo > 0 and math.log10(hi / lo) > 2.5:
        subs = (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{_human(v)}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def _scenario_label(row: dict) -> str:
    return f"{row['model']}\ntp{row['tp']} n{row['num_tokens']}"


def _colors(candidates: list[str]) -> dict[str, str]:
    return {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(candidates)}


def speedup_plot(
    rows: list[dict], out: Path, title: str = "kb-nano kernels: speedup over the PyTorch baseline"
) -> Path:
    """Grouped bars of speedup per scenario (x) and candidate (colour), one panel per
    target, log y axis, dashed line at 1.0 (bars start at 1.0: up = faster). Rows with a
    failure status get a red ✗ at 1.0 and the status; skipped rows a grey ○. Writes a PNG
    to ``out`` (parent created) and returns it."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    targets = sorted(
        {r["target"] for r in rows}, key=lambda t: (min(r["level"] or 0 for r in rows if r["target"] == t), t)
    )
    if not targets:
        fig = _figure(8, 3)
        fig.text(0.5, 0.5, "no kernel rows in this result set", ha="center", va="center")
        fig.savefig(out)
        return out
    all_cands = sorted({r["candidate"] for r in rows})
    colors = _colors(all_cands)
    widths = []
    for t in targets:
        n_sc = len({r["scenario_id"] for r in rows if r["target"] == t})
        n_c = len({r["candidate"] for r in rows if r["target"] == t})
        widths.append(n_sc * max(n_c, 1) * 0.45 + 2)
    width = min(max(8.0, *widths), MAX_WIDTH_IN)
    fig = _figure(width, 3.4 * len(targets) + 0.8)
    axes = fig.subplots(len(targets), 1, squeeze=False)[:, 0]
    speeds = [r["speedup"] for r in rows if r["status"] == "passed" and r.get("speedup") and r["speedup"] > 0]
    lo = min([*speeds, 1.0]) / 1.6
    hi = max([*speeds, 1.0]) * 1.6
    for ax, target in zip(axes, targets):
        trows = [r for r in rows if r["target"] == target]
        scenarios = list(OrderedDict.fromkeys(r["scenario_id"] for r in trows))
        cands = sorted({r["candidate"] for r in trows})
        by_key = {(r["scenario_id"], r["candidate"]): r for r in trows}
        n = len(cands)
        bar_w = 0.8 / max(n, 1)
        for j, cand in enumerate(cands):
            for i, sid in enumerate(scenarios):
                r = by_key.get((sid, cand))
                if r is None:
                    continue
                x = i - 0.4 + bar_w * (j + 0.5)
                status = r["status"]
                if status == "passed" and r.get("speedup") and r["speedup"] > 0:
                    s = r["speedup"]
                    ax.bar(
                        x, s - 1.0, bottom=1.0, width=bar_w * 0.9, color=colors[cand], edgecolor="black", linewidth=0.4
                    )
                    ax.text(
                        x,
                        s * (1.04 if s >= 1 else 0.96),
                        f"{s:.2f}x",
                        ha="center",
                        va="bottom" if s >= 1 else "top",
                        fontsize=7,
                    )
                elif status == "skipped":
                    ax.plot([x], [1.0], marker="o", mfc="none", mec=SKIPPED_COLOR, ms=7, ls="none")
                else:
                    ax.plot([x], [1.0], marker="X", color=FAILED_COLOR, ms=11, ls="none", mec="black", mew=0.5)
                    ax.text(x, 1.0 * 0.93, status, ha="center", va="top", fontsize=7, color=FAILED_COLOR, rotation=90)
        ax.axhline(1.0, color="black", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        _log_axis(ax.yaxis, "x", subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0))
        ax.set_xlim(-0.6, len(scenarios) - 0.4)
        ax.set_xticks(range(len(scenarios)))
        first = {sid: next(r for r in trows if r["scenario_id"] == sid) for sid in scenarios}
        ax.set_xticklabels([_scenario_label(first[s]) for s in scenarios], fontsize=8)
        ax.set_ylabel("speedup (log)")
        n_fail = sum(r["status"] not in ("passed", "skipped") for r in trows)
        ax.set_title(f"{target}" + (f"  —  {n_fail} failed" if n_fail else ""), loc="left", fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.25)
        handles = [Patch(facecolor=colors[c], edgecolor="black", label=c) for c in cands]
        if n_fail:
            handles.append(
                Line2D([], [], marker="X", color=FAILED_COLOR, ls="none", ms=9, label="failed (status below)")
            )
        if any(r["status"] == "skipped" for r in trows):
            handles.append(Line2D([], [], marker="o", mfc="none", mec=SKIPPED_COLOR, ls="none", ms=7, label="skipped"))
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    height = fig.get_figheight()
    fig.suptitle(title + "  (bars from 1.0; above = faster)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height))
    fig.savefig(out)
    return out


def bandwidth_plot(
    rows: list[dict], out: Path, title: str = "kb-nano kernels: achieved bandwidth and FLOP rate"
) -> Path:
    """Roofline-style view of passed rows, one row of two panels per device name.

    Left: achieved memory bandwidth (GB/s, log) per row against bytes moved per call;
    candidates in colour, the baseline as grey hollow circles (once per scenario), and a
    red line at the device's peak bandwidth when known. Right: achieved GFLOP/s against
    arithmetic intensity (FLOP/byte) with the roofline ``min(peak FLOP/s, AI × peak
    bandwidth)`` when the device is known. CUDA and CPU rows alike (CPU: no peak line;
    the panel names the reason). Writes a PNG to ``out`` and returns it."""
    from matplotlib.lines import Line2D

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    passed = [r for r in rows if r["status"] == "passed" and r.get("bytes_moved") and r.get("candidate_ms")]
    devices = sorted({r.get("device_name") or r.get("device") or "unknown" for r in passed})
    if not devices:
        fig = _figure(8, 3)
        fig.text(0.5, 0.5, "no passed rows with bytes_moved and timings in this result set", ha="center", va="center")
        fig.savefig(out)
        return out
    colors = _colors(sorted({r["candidate"] for r in rows}))
    fig = _figure(13, 4.6 * len(devices) + 0.6)
    axes = fig.subplots(len(devices), 2, squeeze=False)
    for (ax_bw, ax_fl), dev in zip(axes, devices):
        drows = [r for r in passed if (r.get("device_name") or r.get("device") or "unknown") == dev]
        dtypes = sorted({r["dtype"] for r in drows})
        peak = device_peak(dev, dtypes[0] if len(dtypes) == 1 else None)
        kind = sorted({r.get("device") or "?" for r in drows})
        seen_baseline: set[str] = set()
        for r in drows:
            gbs, gfl = achieved(r, "candidate")
            ai = r["flops"] / r["bytes_moved"] if r.get("flops") else None
            c = colors[r["candidate"]]
            ax_bw.plot([r["bytes_moved"]], [gbs], marker="o", color=c, ls="none", ms=6)
            if gfl and ai:
                ax_fl.plot([ai], [gfl], marker="o", color=c, ls="none", ms=6)
            if r["scenario_id"] not in seen_baseline:
                seen_baseline.add(r["scenario_id"])
                bgbs, bgfl = achieved(r, "baseline")
                if bgbs:
                    ax_bw.plot([r["bytes_moved"]], [bgbs], marker="o", mfc="none", mec=BASELINE_COLOR, ls="none", ms=8)
                if bgfl and ai:
                    ax_fl.plot([ai], [bgfl], marker="o", mfc="none", mec=BASELINE_COLOR, ls="none", ms=8)
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
            _log_axis(ax.xaxis)
            _log_axis(ax.yaxis)
        ax_bw.set_title(label, loc="left", fontsize=9)
        ax_fl.set_title(note, loc="left", fontsize=7, wrap=True)
    handles = [
        Line2D([], [], marker="o", color=colors[c], ls="none", label=c)
        for c in sorted({r["candidate"] for r in passed})
    ]
    handles.append(Line2D([], [], marker="o", mfc="none", mec=BASELINE_COLOR, ls="none", ms=8, label="baseline"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(handles) // 4), 1, 0.97))
    fig.savefig(out)
    return out


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


def kernel_plots(rows: list[dict], speedup_out: Path, bandwidth_out: Path) -> list[Path]:
    """Both kernel plots for a merged result set; returns the two paths."""
    return [speedup_plot(rows, speedup_out), bandwidth_plot(rows, bandwidth_out)]
