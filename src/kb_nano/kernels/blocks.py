"""Blocks: the unit the judge repeats, the rule that stops it, and the GPU clock it records.

A block (:meth:`kb_nano.kernels.judge.Measurement.block`) holds one ABAB pair of batches
per timer: on a CPU the eager timer only; on CUDA the eager timer, the CUPTI kernel timer
and one CUDA-graph replay per side. Each pair gives one mean call time (the batch total
over its calls) per side per timer. The estimates are medians over blocks
(:func:`estimate`), and the speedup's interval is Student's t over the blocks' ratios
(:func:`kb_nano.stats.speedup_interval`), so it covers what changes between blocks
(clocks, other work on the host, the allocator's state), not only call-to-call noise; it is
the range a rerun's speedup falls in (a prediction interval), not a confidence interval
of the true speedup.

Stopping (:func:`stop_reason`), after nvbench's noise-based stopping but in two stages
(Stein's two-stage procedure): on CUDA the first stage is 5 blocks; their spread fixes how
many blocks the interval needs to be within ``ci_target`` of the speedup
(:func:`planned_blocks`), and the measurement runs that many, or until ``max_timing_s``
of timing has passed. The interval is computed over all blocks. Stopping instead at the
first block where the interval looks narrow enough would pick the moment the blocks'
spread happened to dip, and report an interval narrower than the reruns' spread. On a
CPU the block count is fixed (``min_blocks``; the 2-core CI machines are too noisy for a
relative target to be reached in useful time).

:class:`SmClock` reads the SM clock and the clock-event (throttle) reasons through NVML
after every block.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kb_nano import stats
from kb_nano.kernels import timing

MIN_BLOCKS = {"cpu": 10, "cuda": 5}
CI_TARGET = 0.02  # default ci_target: the rerun interval's half-width, relative (about a 1.1% confidence interval)
# The standard deviation of one run's log speedup that blocks do not sample (where the run's
# input slots and workers' state landed), per device type: the maximum-likelihood fit
# (0.0038) over the 45 rows of two back-to-back sweeps on the H200 (bench/FIDELITY.md,
# 2026-12-03 23:39 UTC: python bench/fidelity.py; each row's difference ~ N(0, its block
# variance + 2 run_sd^2)), rounded up. Not measured on CPUs (there the blocks' spread is wide).
RUN_TO_RUN_SD = {"cuda": 0.004}
TIMERS = ("eager", "kernel", "graph")
# NVML clock-event reasons that mean the SM clock was held down (nvml.h, nvmlClocksEventReason*):
# software power cap, hardware slowdown, sync boost excluded (it follows another GPU), software
# thermal, hardware thermal, hardware power brake
THROTTLE_REASONS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}


def new_pass() -> dict:
    """The samples of one timer: per-call times of each side (``base``, ``cand``), the
    judge's clock around each batch (``judge_*``), the sum each worker reported
    (``rep_*``), each block's median (``block_*``), and per-call extras of the kernel timer
    (``span_*``, ``kernels_*``, ``hidden``)."""
    keys = (
        "base",
        "cand",
        "judge_base",
        "judge_cand",
        "rep_base",
        "rep_cand",
        "block_base",
        "block_cand",
        "span_base",
        "span_cand",
        "kernels_base",
        "kernels_cand",
        "hidden",
    )
    return {k: [] for k in keys}


def new_samples() -> dict:
    """All the samples of one measurement (see :func:`new_pass`), plus ``blocks`` (count),
    ``stop`` (why the blocks stopped), ``errors`` (timer -> why it has no samples),
    ``started`` (monotonic s when the first block began) and ``planned`` (``(timer,
    blocks)`` once the first stage fixed the block count, :func:`stop_reason`)."""
    return {
        **{t: new_pass() for t in TIMERS},
        "blocks": 0,
        "stop": None,
        "errors": {},
        "started": None,
        "planned": None,
    }


def basis(requested: str, device: torch.device, errors: dict) -> str:
    """The timer ``speedup`` uses: ``requested`` (``auto`` | ``eager`` | ``kernel`` |
    ``graph``); ``auto`` = ``kernel`` on CUDA, ``eager`` on a CPU. A timer with no samples
    (``errors``) falls back to the next of kernel, graph, eager; a CPU has only eager."""
    if device.type != "cuda":
        return "eager"
    order = ["kernel", "graph", "eager"]
    want = "kernel" if requested in (None, "auto") else requested
    for timer in order[order.index(want) :] + order[: order.index(want)]:
        if timer == "eager" or timer not in errors:
            return timer
    return "eager"


def least_blocks(device: torch.device, settings: dict) -> int:
    """The blocks every measurement runs: :data:`MIN_BLOCKS`, or ``settings["min_blocks"]``
    when larger."""
    return max(MIN_BLOCKS.get(device.type, 10), int(settings.get("min_blocks") or 0))


def stop_reason(s: dict, which: str, device: torch.device, settings: dict) -> str | None:
    """Why the blocks stop now, or None to run another. ``which``: the basis timer. On
    CUDA, when the first stage (:func:`least_blocks`) is done, the block count is fixed
    once from its blocks (:func:`planned_blocks`, kept in ``s["planned"]``; fixed again
    if the basis timer changes); then ``ci_target`` when that many blocks ran,
    ``max_timing_s`` when the time is up first."""
    least = least_blocks(device, settings)
    if s["blocks"] < least:
        return None
    if device.type != "cuda":
        return "fixed"
    target = float(settings.get("ci_target") or CI_TARGET)
    if not s.get("planned") or s["planned"][0] != which:
        p = s[which]
        s["planned"] = (which, planned_blocks(p["block_base"], p["block_cand"], target, max(least, s["blocks"])))
    if s["blocks"] >= s["planned"][1]:
        return "ci_target"
    if time.monotonic() - s["started"] >= float(settings.get("max_timing_s") or 1.0):
        return "max_timing_s"
    return None


def planned_blocks(base: list[float], cand: list[float], target: float, least: int, most: int = 10_000) -> int:
    """How many blocks the speedup's rerun interval (:func:`kb_nano.stats.speedup_interval`)
    needs to be within ``target`` (relative half-width) of the speedup, judged from the
    first-stage blocks ``base``/``cand`` (per-block mean call times, ms): the least ``n >=
    least`` with ``sinh(t_{0.975, n-1} * sqrt(pi/2) * s * sqrt(2/n)) <= target``, ``s``
    the standard deviation of the first stage's log ratios; at most ``most``. The first
    stage's spread, not the spread after each block, decides (Stein, "A two-sample test
    for a linear hypothesis whose power is independent of the variance", *Ann. Math.
    Statist.* 16, 1945): the interval over all the blocks then covers as stated."""
    logs = np.log(np.maximum(np.asarray(base, dtype=np.float64), 1e-12)) - np.log(
        np.maximum(np.asarray(cand, dtype=np.float64), 1e-12)
    )
    if len(logs) < 2:
        return least
    spread = float(np.std(logs, ddof=1))
    limit = float(np.arcsinh(target))
    n = max(least, 2)
    while n < most and stats.t975(n - 1) * np.sqrt(np.pi / 2) * spread * np.sqrt(2 / n) > limit:
        n += 1
    return n


def hidden_ms(s: dict) -> float:
    """Work the candidate did inside its batches but outside its reported times, per
    batch, in ms: the median over batches of the judge's clock around a candidate batch
    minus the times its worker reported, less the same median of the baseline's batches
    (the same IPC and output copies). A median, not a least value: work moved out of the
    timed calls, or a forged clock, must then be in at most half the batches to pass, and
    the estimates (medians over blocks, :func:`estimate`) do not move with a minority of
    blocks; host jitter in a few batches moves neither."""
    return float(np.median(batch_overhead_ms(s, "cand")) - np.median(batch_overhead_ms(s, "base")))


def overhead_noise_ms(s: dict, z: float = 3.0, resamples: int = 2000) -> float:
    """How far :func:`hidden_ms` moves by chance, in ms: ``z`` standard errors of a
    difference of two medians of batch overhead, ``z * sqrt(2) * SE``, with ``SE`` the
    bootstrap standard error of the median of the baseline's batch overhead (Efron &
    Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 6), taken robustly as the
    IQR of the bootstrap medians / 1.349 (the normal distribution's IQR in SDs), because
    a few very slow batches make rare resamples' medians large; fixed seed, so a rerun on
    the same batches gives the same number. The baseline's batches only: a
    candidate could widen its own spread on purpose. Unlike the raw spread of the batches
    (their IQR), it does not grow with a minority of slow batches (host preemptions), which
    move neither median; it shrinks as blocks are added. 0.0 with fewer than 4 batches."""
    over = batch_overhead_ms(s, "base")
    if len(over) < 4:
        return 0.0
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(over, size=(resamples, len(over)), replace=True), axis=1)
    q75, q25 = np.percentile(medians, [75, 25])
    return float(z * np.sqrt(2.0) * (q75 - q25) / 1.349)


def batch_overhead_ms(s: dict, side: str) -> np.ndarray:
    """Per batch of ``side`` (``base`` | ``cand``): the judge's clock around it minus the
    call times its worker reported, in ms (IPC, output copies, and whatever else ran)."""
    return np.subtract(s[f"judge_{side}"], s[f"rep_{side}"])


def estimate(p: dict) -> tuple[float, float]:
    """``(baseline_ms, candidate_ms)`` of one timer: per side the median over blocks of the
    block's mean call time (its batch total / calls). Batch totals, not per-call medians:
    the judge's clock vouches for a batch's total, while a candidate can shift work
    between the calls of a batch (reading later input slots ahead) to make its median
    call short; medians over blocks, so a minority of unusual blocks (jitter, or a
    batch the clock cross-check let through) does not move them."""
    return timing.summarize(p["block_base"])[0], timing.summarize(p["block_cand"])[0]


class SmClock:
    """The SM clock (MHz) and NVML's clock-event reasons of ``device``, sampled by
    :meth:`sample`; :meth:`fields` gives the row's ``sm_clock_mhz`` (median),
    ``sm_clock_min_mhz``, ``throttled`` and ``throttle_reasons``. All None when NVML is
    not there (``nvidia-ml-py`` not installed, no driver): the row then says nothing about
    clocks rather than something wrong."""

    def __init__(self, device: torch.device) -> None:
        self.samples: list[tuple[int, int]] = []
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            self.nvml = pynvml
        except Exception:
            self.handle = None

    def sample(self) -> None:
        if self.handle is None:
            return
        nv = self.nvml
        reasons = (
            getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        try:
            self.samples.append(
                (int(nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM)), int(reasons(self.handle)))
            )
        except Exception:
            self.handle = None

    def fields(self) -> dict:
        if not self.samples:
            return {}
        mhz = sorted(m for m, _ in self.samples)
        seen = 0
        for _, r in self.samples:
            seen |= r
        names = [n for bit, n in THROTTLE_REASONS.items() if seen & bit]
        return {
            "sm_clock_mhz": float(mhz[len(mhz) // 2]),
            "sm_clock_min_mhz": float(mhz[0]),
            "throttled": bool(names),
            "throttle_reasons": ",".join(names) or None,
        }


TARGET_BATCH_MS = {"cpu": 5.0, "cuda": 2.0}  # a batch this long resolves the judge's clock cross-check
MAX_BATCH_CALLS = 1000  # calls (slots) per batch at most
SLOT_BYTES = {"cpu": 2 << 30, "cuda": 8 << 30}  # most memory the slots of one measurement take


def batch_calls(call_ms: float, per_slot_bytes: int, device: torch.device, num_runs: int = 0) -> int:
    """Calls (input slots) per batch: enough for a batch of :data:`TARGET_BATCH_MS`
    at ``call_ms`` per call (so the judge's clock resolves work hidden outside the timed
    calls) and for ``num_runs`` calls in ten batches (each batch costs a
    round of checks: fewer, fuller batches for slow calls), at most
    :data:`MAX_BATCH_CALLS` and what :data:`SLOT_BYTES` holds, at least 2."""
    want = max(TARGET_BATCH_MS.get(device.type, 10.0) / max(call_ms, 1e-4), num_runs / MIN_BLOCKS["cpu"])
    fit = SLOT_BYTES.get(device.type, 2 << 30) // max(per_slot_bytes, 1)
    return int(max(2, min(MAX_BATCH_CALLS, fit, -(-want // 1))))
