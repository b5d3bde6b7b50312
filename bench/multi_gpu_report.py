"""Report of a multi-GPU leasing run (``bench/multi_gpu.sh``): markdown for bench/MULTI_GPU.md.

    python bench/multi_gpu_report.py --runs OUT/runs.tsv --smi OUT/nvidia_smi.csv --machine OUT/machine.txt

Inputs, as ``bench/multi_gpu.sh`` writes them:

- ``runs.tsv``: one line per sweep (tab-separated, header line): ``gpus`` (the N of
  ``--resources gpu=N``), ``exit_code`` of Snakemake (124/137: stopped at the time budget),
  ``wall_s`` (seconds, the whole ``snakemake`` command: parse, jobs, merge),
  ``start_epoch`` / ``end_epoch`` (Unix seconds), ``start_local`` / ``end_local`` (the same
  instants in the host's local time, ``%Y/%m/%d %H:%M:%S.%f`` as nvidia-smi prints
  them), ``planned_jobs`` (kernel jobs of the dry run), ``parquet`` (the sweep's merged
  rows, relative to the directory of runs.tsv) and ``complete`` (1 = merged by the
  workflow, 0 = the sweep was stopped and the shards written so far were concatenated).
- the Parquet files: kernel rows (:data:`kb_nano.kernels.schema.KERNEL_SCHEMA`, version >= 3), of
  which this uses ``gpu_ids`` and ``started_at`` / ``ended_at`` (ISO 8601 UTC with
  microseconds, stamped by the job inside its device lease, see :mod:`kb_nano.kernels.judge_process`).
- ``nvidia_smi.csv`` (optional): ``nvidia-smi --query-gpu=timestamp,index,utilization.gpu,
  memory.used --format=csv -lms 200`` (timestamps in local time; utilization in %,
  memory in MiB).
- ``machine.txt`` (optional): free text, quoted verbatim.

Prints the markdown on stdout: per sweep the wall time, rows and statuses, rows per
``gpu_ids`` value, the most jobs running at once and the share of the wall time with k jobs
running; the ratio of wall times (gpu=1 / gpu=N); from the nvidia-smi samples of each sweep,
per GPU the share of samples with utilization > 0 (also split into samples while a job of
the sweep held that GPU and while none did) and the peak memory used; the per-job table.

Double booking: per device id, the rows' ``[started_at, ended_at]`` intervals must not
overlap (touching is allowed). When two do, the report is still printed and the script exits
1 with one line ``error: ...`` on stderr naming the file, the device and both jobs. Bad
input (a missing file or column) exits 2 with one line naming the file and the fix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

# the columns of runs.tsv, in the order bench/multi_gpu.sh writes them
RUN_COLUMNS = "gpus exit_code wall_s start_epoch end_epoch start_local end_local planned_jobs parquet complete".split()
SMI_TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


class InputError(Exception):
    """An input file is missing or lacks what the report needs (exit 2)."""


# ----------------------------------------------------------------------------- inputs


def read_runs(path: Path) -> pd.DataFrame:
    """runs.tsv -> one row per sweep, in file order; ``parquet`` made absolute. Raises
    ``InputError`` for a missing file or column."""
    if not path.is_file():
        raise InputError(f"{path}: no such file; pass the runs.tsv that bench/multi_gpu.sh wrote")
    runs = pd.read_csv(path, sep="\t")
    missing = [c for c in RUN_COLUMNS if c not in runs.columns]
    if missing:
        raise InputError(f"{path}: missing column(s) {', '.join(missing)}; expected {' '.join(RUN_COLUMNS)}")
    if runs.empty:
        raise InputError(f"{path}: no sweep recorded")
    runs["parquet"] = [str((path.parent / p).resolve()) for p in runs["parquet"]]
    runs["start_utc"] = pd.to_datetime(runs["start_epoch"], unit="s", utc=True)
    runs["end_utc"] = pd.to_datetime(runs["end_epoch"], unit="s", utc=True)
    # local = UTC + offset; both strings come from the same `date` call as the epochs
    runs["utc_offset"] = pd.to_datetime(runs["start_local"], format=SMI_TIME_FORMAT) - runs["start_utc"].dt.tz_localize(
        None
    )
    return runs


def read_rows(path: Path) -> pd.DataFrame:
    """A sweep's kernel rows; ``started``/``ended`` parsed (UTC). Rows that no job wrote
    (the merge's not-applicable rows) have no ``started_at`` and are kept with NaT.
    Raises ``InputError`` for a missing file or a schema without the lease timestamps."""
    if not path.is_file():
        raise InputError(f"{path}: no such file; the sweep wrote no merged rows (see its Snakemake log)")
    rows = pd.read_parquet(path)
    missing = [
        c for c in ("gpu_ids", "started_at", "ended_at", "candidate", "scenario_id", "status") if c not in rows.columns
    ]
    if missing:
        raise InputError(
            f"{path}: no column(s) {', '.join(missing)} (kernel rows of schema_version >= 3 have them); "
            "rerun the sweep with this kb_nano"
        )
    rows["started"] = pd.to_datetime(rows["started_at"], utc=True)
    rows["ended"] = pd.to_datetime(rows["ended_at"], utc=True)
    return rows


def read_smi(path: Path) -> pd.DataFrame:
    """nvidia-smi CSV -> columns ``time`` (local, naive), ``gpu`` (index as str),
    ``util`` (%), ``mem_mib``; lines it cannot parse (a line cut off when the sampler was
    stopped, ``[N/A]`` values) are dropped. Raises ``InputError`` for a missing file."""
    if not path.is_file():
        raise InputError(
            f"{path}: no such file; pass the CSV of nvidia-smi --query-gpu=... -lms 200, or leave out --smi"
        )
    raw = pd.read_csv(path, skipinitialspace=True, dtype=str, on_bad_lines="skip")
    if raw.shape[1] < 4:
        raise InputError(f"{path}: expected the columns timestamp, index, utilization.gpu, memory.used")
    raw = raw.iloc[:, :4]
    raw.columns = ["timestamp", "index", "util", "mem"]
    smi = pd.DataFrame(
        {
            "time": pd.to_datetime(raw["timestamp"].str.strip(), format=SMI_TIME_FORMAT, errors="coerce"),
            "gpu": raw["index"].str.strip(),
            "util": pd.to_numeric(raw["util"].str.replace("%", "").str.strip(), errors="coerce"),
            "mem_mib": pd.to_numeric(raw["mem"].str.replace("MiB", "").str.strip(), errors="coerce"),
        }
    )
    return smi.dropna(subset=["time", "util"])


# ----------------------------------------------------------------------------- checks


def device_intervals(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per (job, leased device id): ``gpu``, ``started``, ``ended``,
    ``candidate``, ``scenario_id``; a TP-k row (``gpu_ids`` "0,1") gives k lines. Rows
    without a device or without timestamps are left out."""
    held = rows.dropna(subset=["gpu_ids", "started", "ended"]).copy()
    held["gpu"] = held["gpu_ids"].str.split(",")
    held = held.explode("gpu")
    held["gpu"] = held["gpu"].str.strip()
    return held[["gpu", "started", "ended", "candidate", "scenario_id"]].reset_index(drop=True)


def double_bookings(rows: pd.DataFrame) -> list[str]:
    """Per device id, pairs of jobs whose ``[started, ended]`` overlap (a later job started
    before an earlier one on the same device ended). Returns one description per overlap."""
    found = []
    for gpu, spans in device_intervals(rows).groupby("gpu"):
        spans = spans.sort_values("started")
        latest = None  # the interval ending last so far
        for span in spans.itertuples():
            if latest is not None and span.started < latest.ended:
                found.append(
                    f"device {gpu} held by two jobs at once: {latest.candidate} {latest.scenario_id} "
                    f"[{latest.started.isoformat()}, {latest.ended.isoformat()}] and {span.candidate} "
                    f"{span.scenario_id} [{span.started.isoformat()}, {span.ended.isoformat()}]"
                )
            if latest is None or span.ended > latest.ended:
                latest = span
    return found


def concurrency(rows: pd.DataFrame, start: pd.Timestamp, end: pd.Timestamp) -> tuple[int, dict[int, float]]:
    """Most jobs running at once, and the share of ``[start, end]`` with k jobs running
    (k -> share), from the rows' ``[started, ended]`` (jobs with or without a device)."""
    jobs = rows.dropna(subset=["started", "ended"])
    events = sorted([(t, 1) for t in jobs["started"]] + [(t, -1) for t in jobs["ended"]], key=lambda e: (e[0], e[1]))
    running, most, shares, last = 0, 0, {}, start
    for t, step in events:
        t = min(max(t, start), end)
        shares[running] = shares.get(running, 0.0) + (t - last).total_seconds()
        last = t
        running += step
        most = max(most, running)
    shares[running] = shares.get(running, 0.0) + (end - last).total_seconds()
    total = (end - start).total_seconds()
    return most, {k: v / total for k, v in sorted(shares.items()) if v > 0} if total > 0 else {}


def held_at(intervals: pd.DataFrame, gpu: str, times: pd.Series) -> pd.Series:
    """For each UTC instant in ``times``: did a job hold device ``gpu`` then?"""
    spans = intervals[intervals["gpu"] == gpu]
    held = pd.Series(False, index=times.index)
    for span in spans.itertuples():
        held |= (times >= span.started) & (times <= span.ended)
    return held


# ----------------------------------------------------------------------------- report


def _table(df: pd.DataFrame) -> str:
    if df.empty:
        return "(none)"
    return df.astype(object).where(df.notna(), None).to_markdown(index=False, floatfmt=".4g", missingval="")


def smi_table(run, rows: pd.DataFrame, smi: pd.DataFrame) -> pd.DataFrame:
    """Per GPU, the samples taken during one sweep: count, share with utilization > 0
    (all, while a job of the sweep held the GPU, while none did), mean utilization, peak
    memory."""
    window = smi[(smi["time"] >= run.start_local_ts) & (smi["time"] <= run.end_local_ts)].copy()
    window["utc"] = (window["time"] - run.utc_offset).dt.tz_localize("UTC")
    intervals = device_intervals(rows)
    out = []
    for gpu, samples in window.groupby("gpu", sort=True):
        held = held_at(intervals, gpu, samples["utc"])
        busy = samples["util"] > 0
        out.append(
            {
                "GPU": gpu,
                "samples": len(samples),
                "util > 0": f"{busy.mean():.0%}",
                "util > 0 while leased": f"{busy[held].mean():.0%} of {int(held.sum())}" if held.any() else "no lease",
                "util > 0 while not leased": f"{busy[~held].mean():.0%} of {int((~held).sum())}"
                if (~held).any()
                else "always leased",
                "mean util %": round(float(samples["util"].mean()), 1),
                "peak memory MiB": int(samples["mem_mib"].max()),
            }
        )
    return pd.DataFrame(out)


def report(runs: pd.DataFrame, smi: pd.DataFrame | None, machine: str | None) -> tuple[str, list[str]]:
    """The markdown and the double-booking errors (``"file: description"``)."""
    lines: list[str] = []
    errors: list[str] = []
    runs = runs.copy()
    runs["start_local_ts"] = pd.to_datetime(runs["start_local"], format=SMI_TIME_FORMAT)
    runs["end_local_ts"] = pd.to_datetime(runs["end_local"], format=SMI_TIME_FORMAT)
    if machine:
        lines += ["## Machine", "", "```", machine.strip(), "```", ""]

    sweeps = {}  # run index -> rows, shares, span (s), complete
    summary = []
    for run in runs.itertuples():
        rows = read_rows(Path(run.parquet))
        most, shares = concurrency(rows, run.start_utc, run.end_utc)
        found = double_bookings(rows)
        errors += [f"{Path(run.parquet).name}: {f}" for f in found]
        used = sorted(set(device_intervals(rows)["gpu"]), key=lambda g: (len(g), g))
        jobs = rows.dropna(subset=["started", "ended"])
        span = (jobs["ended"].max() - jobs["started"].min()).total_seconds() if len(jobs) else float("nan")
        complete = bool(int(run.complete)) and int(run.exit_code) == 0 and len(rows) >= int(run.planned_jobs)
        sweeps[run.Index] = {"rows": rows, "shares": shares, "span": span, "complete": complete, "found": found}
        summary.append(
            {
                "run": f"--resources gpu={run.gpus}",
                "wall s": round(float(run.wall_s), 1),
                "jobs phase s": round(span, 1),
                "sum of job s": round(float((jobs["ended"] - jobs["started"]).dt.total_seconds().sum()), 1),
                "exit": int(run.exit_code),
                "jobs planned": int(run.planned_jobs),
                "rows": len(rows),
                "complete": "yes" if complete else "NO",
                "statuses": ", ".join(f"{k} {v}" for k, v in rows["status"].value_counts().items()),
                "devices used": f"{','.join(used)} ({len(used)})" if used else "none",
                "max concurrent jobs": most,
                "double-booked": "NO" if not found else f"YES ({len(found)})",
            }
        )
    lines += [
        "## Sweeps",
        "",
        "`jobs phase`: first job's start to last job's end; `sum of job s`: the jobs' "
        "`ended_at - started_at` added up.",
        "",
        _table(pd.DataFrame(summary)),
        "",
    ]

    parallel = runs.loc[runs["gpus"].idxmax()]
    serial = runs.loc[runs["gpus"].idxmin()]
    p, q = sweeps[parallel.name], sweeps[serial.name]
    if parallel.name == serial.name:
        lines += [f"Only the gpu={parallel.gpus} sweep ran: no wall-time ratio.", ""]
    elif not p["complete"]:
        lines += [f"The gpu={parallel.gpus} sweep did not complete: no wall-time ratio.", ""]
    else:
        ratio = float(serial.wall_s) / float(parallel.wall_s)
        text = (
            f"Wall-time ratio gpu={serial.gpus} / gpu={parallel.gpus}: **{ratio:.2f}** "
            f"({float(serial.wall_s):.1f} s / {float(parallel.wall_s):.1f} s; {parallel.gpus} would be perfect scaling of the jobs; "
            "both walls include Snakemake's parse, the fork server's torch import and the merge). "
            f"Jobs phase only: **{q['span'] / p['span']:.2f}** ({q['span']:.1f} s / {p['span']:.1f} s)."
        )
        if not q["complete"]:
            text += (
                f" The gpu={serial.gpus} sweep was stopped with {len(q['rows'])} of {int(serial.planned_jobs)} rows "
                "written, so both ratios are lower bounds."
            )
        else:
            a = set(zip(p["rows"]["scenario_id"], p["rows"]["candidate"]))
            b = set(zip(q["rows"]["scenario_id"], q["rows"]["candidate"]))
            if a != b:
                text += f" The two sweeps' job sets differ: {len(a - b)} only in gpu={parallel.gpus}, {len(b - a)} only in gpu={serial.gpus}."
        lines += [text, ""]

    lines += ["## Rows per device (`gpu_ids`)", ""]
    per_gpu = (
        pd.concat(
            [
                sweeps[r.Index]["rows"]["gpu_ids"].fillna("none").value_counts().rename(f"gpu={r.gpus} rows")
                for r in runs.itertuples()
            ],
            axis=1,
        )
        .fillna(0)
        .astype(int)
    )
    per_gpu.index.name = "gpu_ids"
    lines += [_table(per_gpu.sort_index().reset_index()), ""]

    lines += ["## Jobs running at once (share of each sweep's wall time)", ""]
    k_max = max(max(sw["shares"], default=0) for sw in sweeps.values())
    lines += [
        _table(
            pd.DataFrame(
                [
                    {
                        "run": f"gpu={r.gpus}",
                        **{f"{k} jobs": f"{sweeps[r.Index]['shares'].get(k, 0.0):.0%}" for k in range(k_max + 1)},
                    }
                    for r in runs.itertuples()
                ]
            )
        ),
        "",
    ]

    lines += ["## Double booking", ""]
    for run in runs.itertuples():
        sw = sweeps[run.Index]
        verdict = (
            "no two overlapping `[started_at, ended_at]` on one device"
            if not sw["found"]
            else f"FAILED: {Path(run.parquet).name}: " + "; ".join(sw["found"])
        )
        lines.append(f"- gpu={run.gpus}: {len(device_intervals(sw['rows']))} device leases checked: {verdict}")
    lines.append("")

    if smi is not None:
        lines += ["## nvidia-smi samples (every 200 ms)", ""]
        for run in runs.itertuples():
            lines += [f"During the gpu={run.gpus} sweep ({run.start_local} to {run.end_local}, local time):", ""]
            lines += [_table(smi_table(run, sweeps[run.Index]["rows"], smi)), ""]

    jobs = []
    for run in runs.itertuples():
        for r in sweeps[run.Index]["rows"].sort_values("started").itertuples():
            jobs.append(
                {
                    "run": f"gpu={run.gpus}",
                    "candidate": r.candidate,
                    "num_tokens": r.num_tokens,
                    "status": r.status,
                    "gpu_ids": r.gpu_ids,
                    "start s": round((r.started - run.start_utc).total_seconds(), 2) if pd.notna(r.started) else None,
                    "end s": round((r.ended - run.start_utc).total_seconds(), 2) if pd.notna(r.ended) else None,
                    "baseline_ms": r.baseline_ms,
                    "candidate_ms": r.candidate_ms,
                    "speedup": r.speedup,
                }
            )
    lines += [
        "## Jobs",
        "",
        "`start s` / `end s`: seconds from the start of the sweep's `snakemake` command.",
        "",
        _table(pd.DataFrame(jobs)),
        "",
    ]
    return "\n".join(lines), errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="runs.tsv of bench/multi_gpu.sh")
    parser.add_argument("--smi", type=Path, help="nvidia-smi CSV sampled during the sweeps")
    parser.add_argument("--machine", type=Path, help="machine description (quoted verbatim)")
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.runs)
        smi = read_smi(args.smi) if args.smi else None
        if args.machine and not args.machine.is_file():
            raise InputError(f"{args.machine}: no such file; leave out --machine or pass machine.txt")
        machine = args.machine.read_text() if args.machine else None
        text, errors = report(runs, smi, machine)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        print(f"error: double-booked: {errors[0]}{more}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
