"""Statistics the tiers share (torch-free): Student's t quantiles and the 95% rerun
interval of a speedup measured as paired replicates (Tier 1: blocks of batches,
:mod:`kb_nano.kernels.blocks`; Tiers 2 and 3: pairs of engine runs, :mod:`kb_nano.e2e.merge`)."""

from __future__ import annotations

import numpy as np

# Student's t, two-sided 95%: t_{0.975, df} for df = 1..30 (NIST/SEMATECH e-Handbook of Statistical
# Methods, table 1.3.6.7.2); above 30 the Cornish-Fisher expansion z + (z^3 + z) / (4 df)
# + (5 z^5 + 16 z^3 + 3 z) / (96 df^2) (Abramowitz & Stegun 26.7.5), within 0.001 of the table at df = 30
T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (see :data:`T975`)."""
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def speedup_interval(
    baseline_blocks: list[float], candidate_blocks: list[float], speedup: float, run_sd: float = 0.0
) -> tuple[float, float]:
    """95% interval for the speedup a rerun of the same measurement reports, around
    ``speedup`` (the ratio of the two sides' medians over blocks, :func:`kb_nano.kernels.blocks.estimate`),
    from the per-block mean call times (ms) of the two sides (Tiers 2 and 3: per pair of
    engine runs, the baseline's and the candidate's metric, oriented so that their ratio
    is the speedup).

    Block ``b`` gives one ratio ``baseline_blocks[b] / candidate_blocks[b]`` (its two
    batches ran back to back, ABAB, so drift cancels within the pair); the blocks are the
    independent replicates (the batch-means method: Law & Kelton, *Simulation Modeling and
    Analysis*, 5th ed., 2015, sec. 9.5.3), ``s`` the standard deviation of the logs of
    their ratios over ``n`` blocks. The interval is
    ``speedup * exp(+- t_{0.975, n-1} * sqrt(pi / 2) * s * sqrt(2 / n))``:

    - ``sqrt(2 / n)``: a prediction interval for the estimate of a future sample of ``n``
      blocks, not a confidence interval for the true value: the rerun's estimate is as
      noisy as this one, so their difference has ``sqrt(1/n + 1/n)`` times the blocks'
      spread (Hahn, Meeker & Escobar, *Statistical Intervals*, 2nd ed., 2017, ch. 4);
    - ``sqrt(pi / 2)``: the estimates are medians, whose sampling variance is ``pi / 2``
      times the mean's for normal data (``pi s^2 / 2n``; Kendall & Stuart, *The Advanced
      Theory of Statistics*, vol. 1); the spread of the ratio of the two sides' medians is
      taken as that of the median of the paired ratios.

    So a rerun's speedup falls inside with 95% probability when reruns vary as blocks do
    (docs/measurement.md says what varies between runs and not between blocks). What
    varies only between runs is ``run_sd``: the standard deviation of one run's log
    speedup that no block samples (a variance component; Searle, Casella & McCulloch,
    *Variance Components*, 1992), added in quadrature as ``1.96 * sqrt(2) * run_sd`` (two
    runs' worth, a known normal spread): the half-width in logs is
    ``sqrt(h_blocks^2 + (1.96 * sqrt(2) * run_sd)^2)``. Raises ``ValueError`` with fewer
    than two blocks or unpaired lists."""
    b = np.asarray(baseline_blocks, dtype=np.float64)
    c = np.asarray(candidate_blocks, dtype=np.float64)
    if len(b) != len(c) or len(b) < 2:
        raise ValueError(f"paired blocks needed (at least 2), got {len(b)} baseline and {len(c)} candidate")
    logs = np.log(np.maximum(b, 1e-12)) - np.log(np.maximum(c, 1e-12))
    n = len(logs)
    half = t975(n - 1) * np.sqrt(np.pi / 2) * float(np.std(logs, ddof=1)) * np.sqrt(2 / n)
    half = float(np.hypot(half, 1.959964 * np.sqrt(2) * run_sd))
    mid = float(np.log(max(speedup, 1e-12)))
    return float(np.exp(mid - half)), float(np.exp(mid + half))
