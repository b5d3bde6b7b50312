"""Harness overhead of Tier-1 kernel jobs: where the wall time of one scenario goes.

    python bench/overhead.py                      # every kernel job of config/config.yaml
    python bench/overhead.py --jobs 20            # the first 20 (round-robin over targets)
    python bench/overhead.py --configfile my.yaml --cores 1

Steps, in a temporary copy of the workflow (clean ``results/``):

1. ``snakemake --until generate_inputs`` writes the manifest; the kernel jobs are the
   embedded default's candidate × scenario pairs (``kb_nano.workflow.select``).
2. ``snakemake --cores C <the jobs' shards>`` runs them for real (wall ``W``), then the same
   command again with nothing to do (wall ``W0``: parsing and the DAG). Per job:
   ``(W - W0) / jobs`` with ``--cores 1`` (jobs run one at a time; the default).
3. Each job's ``kb_nano.bench.measure`` runs again, one fresh process per job as a worker
   would, with its phases timed from outside (wrapping ``make_tensor``, ``compare``,
   ``exclusive`` and ``time_pair`` in ``kb_nano.bench``; the code under test is unchanged):
   setup (candidate import, module construction, weights, inputs), correctness (the
   first comparison and the second-input check after timing), timing (warmup + timed
   calls, lock held) and the pure kernel time (the sum of the timed calls of both sides).
4. Start-up = per-job wall - (setup + correctness + timing): everything outside the
   measurement (Snakemake dispatch, the job process, the worker process and its imports,
   the shard write). For reference it also times ``python -c pass`` and a fresh
   ``import kb_nano.bench`` (torch).

Prints one line per job and the mean per job; ``--json PATH`` writes all of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPY = ("Snakefile", "workflow", "config", "candidates", "profiles", "envs")


def _phases_child(spec_path: str) -> None:
    """Run one measurement in this fresh process and print its phase times as JSON."""
    t_main = time.perf_counter()
    import kb_nano.bench as bench

    t_imported = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    events: dict[str, list] = {"make_tensor": [], "compare": [], "exclusive": [], "kernel_ms": []}

    def wrap_make_tensor(fn):
        def inner(*a, **k):
            out = fn(*a, **k)
            events["make_tensor"].append(time.perf_counter())
            return out

        return inner

    def wrap_compare(fn):
        def inner(*a, **k):
            out = fn(*a, **k)
            events["compare"].append(time.perf_counter())
            return out

        return inner

    real_exclusive, real_time_pair = bench.exclusive, bench.time_pair

    import contextlib

    @contextlib.contextmanager
    def exclusive(*a, **k):
        t0 = time.perf_counter()
        with real_exclusive(*a, **k):
            yield
        events["exclusive"].append((t0, time.perf_counter()))

    def time_pair(*a, **k):
        t = real_time_pair(*a, **k)
        events["kernel_ms"].append(sum(t.baseline_ms) + sum(t.candidate_ms))
        return t

    bench.make_tensor = wrap_make_tensor(bench.make_tensor)
    bench.compare = wrap_compare(bench.compare)
    bench.exclusive, bench.time_pair = exclusive, time_pair
    t0 = time.perf_counter()
    row = bench.measure(spec["scenario"], spec["candidate_id"], Path(spec["candidate_path"]), spec["settings"], Path(spec["root"]))
    t1 = time.perf_counter()
    first_compare = events["compare"][0] if events["compare"] else None
    if first_compare is None:  # skipped / import_error before any forward call
        setup, correctness, timing = t1 - t0, 0.0, 0.0
    else:
        setup_end = max([t for t in events["make_tensor"] if t < first_compare], default=t0)
        setup = setup_end - t0
        correctness = first_compare - setup_end
        timing = 0.0
        if events["exclusive"]:
            ex0, ex1 = events["exclusive"][0]
            timing = ex1 - ex0
            correctness += t1 - ex1
        else:
            correctness = t1 - setup_end
    print(json.dumps({
        "status": row["status"],
        "import_s": t_imported - t_main,
        "measure_s": t1 - t0,
        "setup_s": setup,
        "correctness_s": correctness,
        "timing_s": timing,
        "kernel_s": sum(events["kernel_ms"]) / 1e3,
    }))


def _run(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def _spread(jobs: list, n: int) -> list:
    """First ``n`` jobs taken round-robin over targets, so a small ``n`` still covers them."""
    by_target: dict[str, list] = {}
    for job in jobs:
        by_target.setdefault(job[0]["target"], []).append(job)
    out = []
    while len(out) < min(n, len(jobs)):
        for queue in by_target.values():
            if queue and len(out) < n:
                out.append(queue.pop(0))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=0, help="number of kernel jobs (default: all of the config)")
    parser.add_argument("--configfile", help="config layered over config/config.yaml (default: the embedded default)")
    parser.add_argument("--cores", type=int, default=1, help="snakemake --cores for the timed run (default 1)")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--phases-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phases_child:
        _phases_child(args.phases_child)
        return 0

    import yaml

    from kb_nano import workflow as kbw
    from kb_nano.manifest import load

    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="kb_nano_overhead_") as tmp:
        work = Path(tmp)
        for name in COPY:
            src = REPO / name
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, work / name)
        config = yaml.safe_load((work / "config/config.yaml").read_text())
        extra = ["--configfile", str(Path(args.configfile).resolve())] if args.configfile else []
        if args.configfile:
            config.update(yaml.safe_load(Path(args.configfile).read_text()))
        smk = [py, "-m", "snakemake", "--cores", str(args.cores), *extra]
        _run([*smk, "--until", "generate_inputs"], work)
        manifest = load(work / "results/inputs/llm.yaml")
        jobs, _ = kbw.select(manifest, kbw.candidates(work, config), config)
        jobs = _spread(jobs, args.jobs or len(jobs))
        shards = [kbw.shard_path(s["scenario_id"], c) for s, c in jobs]
        wall = _run([*smk, *shards], work)
        noop = _run([*smk, *shards], work)
        per_job = (wall - noop) / len(jobs)

        settings = {**kbw.settings(config), "num_threads": 1}
        rows = []
        for scenario, cand in jobs:
            spec = work / "spec.json"
            spec.write_text(json.dumps({"scenario": scenario, "candidate_id": cand.id, "settings": settings,
                                        "candidate_path": str(work / f"candidates/{cand.target}/{cand.name}.py"),
                                        "root": str(work)}))
            t0 = time.perf_counter()
            out = subprocess.run([py, __file__, "--phases-child", str(spec)], cwd=work, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"error: phases of {cand.id} on {scenario['scenario_id']} failed:\n{out.stderr[-3000:]}")
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"scenario_id": scenario["scenario_id"], "candidate": cand.id,
                         "process_wall_s": time.perf_counter() - t0, **rec})
        pass_s = statistics.median(_run([py, "-c", "pass"], work) for _ in range(5))
        import_s = statistics.median(_run([py, "-c", "import kb_nano.bench"], work) for _ in range(3))

    def mean(key):
        return statistics.fmean(r[key] for r in rows)

    measured = mean("setup_s") + mean("correctness_s") + mean("timing_s")
    print(f"{'scenario':44} {'candidate':28} {'status':8} {'setup':>7} {'correct':>7} {'timing':>7} {'kernel':>7}")
    for r in rows:
        print(f"{r['scenario_id']:44} {r['candidate']:28} {r['status']:8} {r['setup_s']:7.3f} "
              f"{r['correctness_s']:7.3f} {r['timing_s']:7.3f} {r['kernel_s']:7.3f}")
    summary = {
        "jobs": len(rows),
        "passed": sum(r["status"] == "passed" for r in rows),
        "cores": args.cores,
        "snakemake_wall_s": wall,
        "snakemake_noop_s": noop,
        "per_job_wall_s": per_job,
        "start_up_s": per_job - measured,
        "setup_s": mean("setup_s"),
        "correctness_s": mean("correctness_s"),
        "timing_s": mean("timing_s"),
        "kernel_s": mean("kernel_s"),
        "python_pass_s": pass_s,
        "import_kb_nano_bench_s": import_s,
    }
    print(f"\n{summary['jobs']} jobs ({summary['passed']} passed, the rest skipped/failed), snakemake --cores {args.cores}: "
          f"{wall:.1f} s, of which {noop:.1f} s parse+DAG (no-op rerun) -> {per_job:.3f} s per job")
    print("mean per job, s: " + ", ".join(f"{k[:-2]} {summary[k]:.3f}" for k in
          ("start_up_s", "setup_s", "correctness_s", "timing_s", "kernel_s")))
    print(f"  start-up = per-job wall - (setup + correctness + timing); kernel = sum of the timed calls "
          f"(inside timing); share of the per-job wall that is kernel time: {summary['kernel_s'] / per_job:.1%}")
    print(f"reference: python -c pass {pass_s:.3f} s; python -c 'import kb_nano.bench' (torch) {import_s:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
