"""Run-to-run reproducibility of a Tier-1 sweep, and the between-run term that fits it.

The same sweep runs twice, back to back, in one fresh temporary copy of the workflow:
``kb_nano kernels [options] -- --until merge_kernels``, then the same command with
``--forcerun kernel_bench`` (every row measured again; the manifest and the workers'
warm-up are shared, as in a user's rerun). For every row passed in both runs:

- the difference of the two runs' log speedups ``d``;
- the first run's rerun interval half-width (log) and whether the second speedup lies inside;
- the blocks' part of that half-width ``h_b``: the reported half-width minus the current
  between-run term in quadrature (``kb_nano.kernels.blocks.RUN_TO_RUN_SD`` of the rows'
  device; ``kb_nano.stats.speedup_interval``).

Then the maximum-likelihood run-to-run standard deviation ``sd`` of one run's log speedup
(a variance component: Searle, Casella & McCulloch, *Variance Components*, 1992): each ``d``
taken as ``N(0, (h_b / 1.96)^2 + 2 sd^2)`` (``h_b`` is already a two-run prediction half-width),
maximised over a grid of ``sd`` from 0 to 0.5 in steps of 0.0005, with the coverage each
``sd`` would have given. This is how the CUDA value was fitted (bench/FIDELITY.md).

    python bench/rerun.py                       # the embedded default config (CPU)
    python bench/rerun.py --target embedding rms_norm --num-tokens 1 64 --json out.json

Exit status: 0; 2 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from workflow_helpers import copy_workflow  # noqa: E402 (tests/ on sys.path first)

Z = 1.959964
KEY = ["scenario_id", "candidate"]


def _run(work: Path, args: list[str], extra: list[str]) -> pd.DataFrame:
    cmd = [sys.executable, "-m", "kb_nano.cli", "kernels", *args, "--", "--until", "merge_kernels", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env={**os.environ, "KB_NANO_ROOT": str(work)}, text=True, capture_output=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        raise SystemExit(2)
    print(f"  {' '.join(cmd[3:])}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return pd.read_parquet(work / "results/kernels.parquet")


def fit_run_sd(d: np.ndarray, h_blocks: np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood ``sd`` (grid 0..0.5, step 0.0005) of ``d ~ N(0, (h_blocks/1.96)^2 + 2 sd^2)``;
    returns ``(sd, log-likelihood gain over sd = 0)``. ``d``, ``h_blocks``: 1-D float arrays (logs)."""
    grid = np.arange(0.0, 0.5, 0.0005)
    var = (h_blocks[None, :] / Z) ** 2 + 2 * grid[:, None] ** 2
    ll = -0.5 * (np.log(2 * np.pi * var) + d[None, :] ** 2 / var).sum(axis=1)
    return float(grid[int(np.argmax(ll))]), float(ll.max() - ll[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows and the summary here")
    args, sweep = ap.parse_known_args()
    from kb_nano.kernels.blocks import RUN_TO_RUN_SD

    with tempfile.TemporaryDirectory(prefix="kb_rerun_") as tmp:
        work = copy_workflow(Path(tmp))
        print(f"sweep twice in {work}:", file=sys.stderr)
        first = _run(work, sweep, [])
        second = _run(work, sweep, ["--forcerun", "kernel_bench"])
    both = first.merge(second, on=KEY, suffixes=("_1", "_2"))
    both = both[(both.status_1 == "passed") & (both.status_2 == "passed")].copy()
    if both.empty:
        print("no row passed in both runs", file=sys.stderr)
        return 2
    device = str(both.device_1.iloc[0]).split(":")[0]
    current = RUN_TO_RUN_SD.get(device, 0.0)
    both["d"] = np.log(both.speedup_2) - np.log(both.speedup_1)
    half = np.log(both.speedup_ci_high_1) - np.log(both.speedup_1)
    both["half"] = half
    both["h_blocks"] = np.sqrt(np.maximum(half**2 - (Z * math.sqrt(2) * current) ** 2, 0.0))
    both["inside"] = (both.speedup_2 >= both.speedup_ci_low_1) & (both.speedup_2 <= both.speedup_ci_high_1)
    sd, gain = fit_run_sd(both.d.to_numpy(), both.h_blocks.to_numpy())

    def coverage(s: float) -> int:
        h = np.hypot(both.h_blocks, Z * math.sqrt(2) * s)
        return int((both.d.abs() <= h).sum())

    n = len(both)
    print(f"\n{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, device {device}")
    print("| scenario | candidate | speedup 1 | speedup 2 | diff | half-width | inside |")
    print("| --- | --- | ---: | ---: | ---: | ---: | :---: |")
    for r in both.sort_values(KEY).itertuples():
        print(
            f"| {r.scenario_id} | {r.candidate} | {r.speedup_1:.3f} | {r.speedup_2:.3f} | "
            f"{100 * math.expm1(r.d):+.1f}% | {100 * math.expm1(r.half):.1f}% | {'yes' if r.inside else '**no**'} |"
        )
    diffs = 100 * np.expm1(both.d.abs())
    print(
        f"\n{n} rows passed twice; second inside the first's interval: {int(both.inside.sum())} of {n} "
        f"(RUN_TO_RUN_SD[{device!r}] = {current}); speedups differ by at most {diffs.max():.1f}% "
        f"(median {np.median(diffs):.1f}%)"
    )
    print(
        f"maximum-likelihood run-to-run sd: {sd:.4f} (log-likelihood +{gain:.1f} over 0); "
        f"inside with it: {coverage(sd)} of {n}; with the blocks alone: {coverage(0.0)} of {n}"
    )
    if args.json:
        summary = {"device": device, "rows": n, "inside": int(both.inside.sum()), "current_sd": current}
        summary |= {"fitted_sd": sd, "loglik_gain": gain, "inside_fitted": coverage(sd)}
        cols = [*KEY, "speedup_1", "speedup_2", "d", "half", "h_blocks", "inside"]
        doc = {"summary": summary, "rows": json.loads(both[cols].to_json(orient="records"))}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
