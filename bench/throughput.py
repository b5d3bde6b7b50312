"""Iteration speed: is kb-nano as fast to iterate with as a bare one-process loop?

Runs the SAME (scenario, candidate) rows two ways and prints both walls and their ratio:

1. kb-nano: the workflow files are copied into a fresh temporary directory and
   ``kb_nano kernels [options] -- --until merge_kernels`` runs there (MLflow logging is
   not timed). Wall = the whole invocation (``time.perf_counter``): manifest, Snakemake,
   one job per scenario, merge. The manifest is generated, or copied from the user cache
   (``~/.cache/kb_nano/manifests``) when an earlier run generated the same one: the
   output says which; ``--cold-cache`` runs with an empty cache. Also reported: the rows by status and the sum of the
   rows' own ``wall_s``.
2. bare loop, in this one process, for exactly the pairs kb-nano ran with status
   ``passed``: import torch, build the baseline and the candidate (weights copied from the
   baseline), move both to the device and dtype, make seeded inputs, one correctness check
   (``torch.allclose`` in float64 with the row's atol/rtol), then time each side with the
   rows' ``num_warmup`` untimed and ``num_runs`` timed calls: on CPU with
   ``torch.utils.benchmark.Timer`` at the rows' ``num_threads``; on CUDA with
   ``triton.testing.do_bench`` (warmup/rep are ms there, converted from the counts with its
   own per-call estimate: the counts match approximately), without triton CUDA events.
   Wall = all of it, imports and module construction included.

Before either, one untimed ``python -c "import torch, snakemake.api, transformers.modeling_utils,
kb_nano.kernels.manifest"`` warms the file caches (on a fresh machine the first process to import
them reads them from disk, seconds each).

With ``nvidia-smi``, ``nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 200``
samples during each run: the share of samples with utilization > 0 and the mean are reported.

    python bench/throughput.py                      # the embedded default config (CPU)
    python bench/throughput.py --target rms_norm --model llama31-8b --tp 1 --num-tokens 1 64
    python bench/throughput.py --device cuda --model llama31-8b --tp 1 \\
        --target rms_norm silu_and_mul --num-tokens 1 16 64 256 1024 4096 16384
    python bench/throughput.py --keep --json out.json --max-ratio 3   # --keep: for --reuse DIR
    python bench/throughput.py --cold-cache   # as a first sweep on a new machine (manifest generated)

Exit status: 0; 1 with ``--max-ratio X`` when kb/bare exceeds X; 2 when something errored.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Self

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from workflow_helpers import copy_workflow  # noqa: E402 (tests/ on sys.path first)

PASS_THROUGH = ("target", "model", "num_tokens", "tp", "device", "num_warmup", "num_runs")


class GpuSampler:
    """Background ``nvidia-smi`` utilization sampling (every 200 ms); a no-op without it."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._proc = self._thread = None

    def __enter__(self) -> Self:
        if shutil.which("nvidia-smi"):
            cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._thread = threading.Thread(target=self._read, daemon=True)
            self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:  # one line per GPU per sample; "[N/A]" is skipped
            if line.strip().isdigit():
                self.samples.append(float(line))

    def __exit__(self, *exc) -> None:
        if self._proc:
            self._proc.terminate()
            self._proc.wait()
            self._thread.join(timeout=2)

    def summary(self) -> dict | None:
        """``{samples, busy_pct, mean_util_pct}`` or None when nothing was sampled."""
        n, s = len(self.samples), self.samples
        return {"samples": n, "busy_pct": 100.0 * sum(x > 0 for x in s) / n, "mean_util_pct": sum(s) / n} if n else None


def kb_nano_command(args: argparse.Namespace) -> list[str]:
    """``kb_nano kernels`` with the pass-through options and ``-- --until merge_kernels``."""
    exe = Path(sys.executable).with_name("kb_nano")
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "kb_nano.cli"]
    cmd.append("kernels")
    for key in PASS_THROUGH:
        value = getattr(args, key)
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    return cmd + ["--", "--until", "merge_kernels"]


def fmt(x: float | None) -> str:
    """``x`` with two decimals, ``-`` for None."""
    return "-" if x is None else f"{x:.2f}"


def flatten(out) -> list:
    """The tensors of a module output (a tensor, or nested tuples/lists of them)."""
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flatten(o)]
    return [out]


def time_side(fn, num_warmup: int, num_runs: int, device, torch) -> float:
    """Milliseconds per call of ``fn`` (see the module docstring for how)."""
    if device.type == "cpu":
        from torch.utils.benchmark import Timer

        for _ in range(num_warmup):
            fn()
        return Timer(stmt="fn()", globals={"fn": fn}).timeit(num_runs).mean * 1e3
    try:
        from triton.testing import do_bench
    except ImportError:  # CUDA events, below
        do_bench = None
    if do_bench:  # warmup/rep are ms: convert the counts with do_bench's own estimate,
        flush = torch.empty(int(256e6 // 4), dtype=torch.int, device=device)  # which clears L2 per call
        fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(5):
            flush.zero_()
            fn()
        torch.cuda.synchronize(device)
        est_ms = max((time.perf_counter() - t0) * 1e3 / 5, 1e-3)
        return float(do_bench(fn, warmup=num_warmup * est_ms, rep=num_runs * est_ms))
    for _ in range(num_warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_runs):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / num_runs


def bare_loop(root: Path, rows: list[dict]) -> tuple[float, list[dict]]:
    """Build, check and time each passed row in this process; returns ``(wall_s, pairs)``,
    one dict per pair with its ms per side, or its ``error``."""
    t0 = time.perf_counter()
    import torch

    from kb_nano import candidates, operators
    from kb_nano.kernels import manifest
    from kb_nano.operators.base import DTYPES, make_tensor

    # every selection's manifest (kb_nano.workflow.manifest_path; a --reuse directory may hold
    # several), the newest last: a scenario id means the same scenario in each
    scenarios = {
        s["scenario_id"]: s
        for path in sorted((root / "results" / "inputs").glob("llm-*.yaml"), key=lambda f: f.stat().st_mtime)
        for s in manifest.load(path)["scenarios"]
    }
    pairs = []
    with torch.inference_mode():
        for row in rows:
            pair = {"scenario_id": row["scenario_id"], "candidate": row["candidate"]}
            pairs.append(pair)
            try:
                sc = scenarios[row["scenario_id"]]
                device = torch.device(row.get("device") or "cpu")
                if device.type == "cpu" and row.get("num_threads"):
                    torch.set_num_threads(int(row["num_threads"]))
                target, name = row["candidate"].split("/", 1)
                init_args, dtype = dict(sc["init_args"]), DTYPES[sc["dtype"]]
                baseline = operators.get(target).baseline(**init_args)
                candidate = candidates.load_class(root / "candidates" / target / f"{name}.py", target)(**init_args)
                candidate.load_state_dict(baseline.state_dict(), strict=True)
                baseline = baseline.to(device=device, dtype=dtype).eval()
                candidate = candidate.to(device=device, dtype=dtype).eval()
                gen = torch.Generator().manual_seed(0)
                inputs = [make_tensor(spec, gen, str(device)) for spec in sc["inputs"]]
                ref = flatten(baseline(*[t.clone() for t in inputs]))
                got = flatten(candidate(*[t.clone() for t in inputs]))
                ok = len(ref) == len(got) and all(
                    torch.allclose(g.double(), r.double(), atol=float(row["atol"]), rtol=float(row["rtol"]))
                    for g, r in zip(got, ref)
                )
                if not ok:
                    raise AssertionError(f"outputs differ beyond atol={row['atol']} rtol={row['rtol']}")
                warm, runs = int(row["num_warmup"]), int(row["num_runs"])
                pair["baseline_ms"] = time_side(partial(baseline, *inputs), warm, runs, device, torch)
                pair["candidate_ms"] = time_side(partial(candidate, *inputs), warm, runs, device, torch)
            except Exception as exc:  # noqa: BLE001 - reported per pair
                pair["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return time.perf_counter() - t0, pairs


def phases(rows: list[dict], start: datetime, wall_s: float) -> dict:
    """Where kb-nano's wall went, from the rows' ``started_at``/``ended_at`` (the judge's
    clock): ``before_first_job`` (CLI, manifest, DAG, judge start), ``jobs`` (first start to
    last end), ``after_last_job`` (merge, shutdown); seconds."""
    spans = [
        (datetime.fromisoformat(r["started_at"]), datetime.fromisoformat(r["ended_at"]))
        for r in rows
        if r.get("started_at") and r.get("ended_at")
    ]
    if not spans:
        return {}
    first = (min(s for s, _ in spans) - start).total_seconds()
    last = (max(e for _, e in spans) - start).total_seconds()
    return {"before_first_job": first, "jobs": last - first, "after_last_job": wall_s - last}


def machine() -> str:
    """GPU name + driver (nvidia-smi), else the CPU model from /proc/cpuinfo."""
    if shutil.which("nvidia-smi"):
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=False,
            )
            .stdout.strip()
            .splitlines()
        )
        if out:
            return f"{len(out)}x {out[0]}"
    info = Path("/proc/cpuinfo")
    models = (
        [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]
        if info.is_file()
        else []
    )
    return f"{models[0] if models else platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


def main(argv: list[str] | None = None) -> int:
    """Run both sides, print the table; returns the exit status (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--target", nargs="+")
    p.add_argument("--model", nargs="+")
    p.add_argument("--num-tokens", nargs="+", type=int)
    p.add_argument("--tp", nargs="+", type=int)
    p.add_argument("--device")
    p.add_argument("--num-warmup", type=int)
    p.add_argument("--num-runs", type=int)
    p.add_argument("--json", type=Path, help="write the numbers to this file")
    p.add_argument("--max-ratio", type=float, help="exit 1 when kb/bare exceeds this")
    p.add_argument("--keep", action="store_true", help="keep the temporary workflow copy (for --reuse)")
    p.add_argument(
        "--cold-cache",
        action="store_true",
        help="run kb-nano with an empty XDG_CACHE_HOME (no cached manifest, no candidate compiler "
        "caches: a first sweep on a new machine); default: the user's cache, as a second sweep has it",
    )
    p.add_argument("--reuse", type=Path, help=argparse.SUPPRESS)  # skip kb-nano; read DIR/results
    args = p.parse_args(argv)

    result: dict = {"command": shlex.join([sys.executable, *sys.argv]), "machine": machine()}
    # Both sides start from warm file caches: the first Python process on a fresh machine
    # reads torch, transformers and snakemake from disk (seconds each), whichever side it is.
    warm = [sys.executable, "-c", "import torch, snakemake.api, transformers.modeling_utils, kb_nano.kernels.manifest"]
    subprocess.run(warm, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if args.reuse:
        root, kb_wall, kb_gpu = args.reuse.resolve(), None, None
    else:
        root = Path(tempfile.mkdtemp(prefix="kb_nano_throughput_"))
        copy_workflow(root)
        cmd = kb_nano_command(args)
        result["kb_nano_command"] = shlex.join(cmd)
        env = {**os.environ, "KB_NANO_ROOT": str(root), "COLUMNS": "200"}
        if args.cold_cache:
            env["XDG_CACHE_HOME"] = str(root / ".cold_cache")
        with GpuSampler() as sampler:  # the whole invocation, output captured
            t0, kb_start = time.perf_counter(), datetime.now(UTC)
            proc = subprocess.run(
                cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
            )
            kb_wall = time.perf_counter() - t0
        kb_gpu = sampler.summary()
        (root / "kb_nano_output.txt").write_text(proc.stdout)
        result["manifest"] = (
            "from the user cache"
            if ".yaml (from the user cache)" in proc.stdout
            else "generated"
            if "wrote results/inputs/llm-" in proc.stdout
            else "read back"
        )
        if proc.returncode:
            print(proc.stdout[-4000:], file=sys.stderr)
            print(f"kb_nano exited {proc.returncode} after {kb_wall:.1f} s (copy kept: {root})", file=sys.stderr)
            return 2
    try:
        rows = json.loads((root / "results" / "kernels.json").read_text())["rows"]
        passed = [r for r in rows if r["status"] == "passed"]
        if kb_wall is not None:
            result["kb_nano_phases_s"] = phases(rows, kb_start, kb_wall)
        with GpuSampler() as sampler:
            bare_wall, pairs = bare_loop(root, passed)
        bare_gpu = sampler.summary()
    finally:
        if not args.reuse and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    import torch  # already imported by the bare loop

    errors = [pr for pr in pairs if "error" in pr]
    ratio = kb_wall / bare_wall if kb_wall is not None and bare_wall > 0 else None
    result.update(
        rows=len(rows),
        statuses=dict(collections.Counter(r["status"] for r in rows)),
        passed_rows=len(passed),
        kb_nano_wall_s=kb_wall,
        kb_nano_row_wall_s_sum=sum(r.get("wall_s") or 0.0 for r in rows),
        bare_loop_wall_s=bare_wall,
        ratio_kb_over_bare=ratio,
        bare_loop_errors=len(errors),
        gpu_util_kb_nano=kb_gpu,
        gpu_util_bare_loop=bare_gpu,
        torch_version=torch.__version__,
        num_warmup=sorted({r["num_warmup"] for r in passed}),
        num_runs=sorted({r["num_runs"] for r in passed}),
        workdir=str(root) if args.reuse or args.keep else None,
        pairs=pairs,
    )

    statuses = ", ".join(f"{n} {s}" for s, n in sorted(result["statuses"].items()))
    for label, value in (
        ("rows (kb-nano)", f"{len(rows)}: {statuses}"),
        ("rows timed by the bare loop", f"{len(passed)} passed pairs ({len(errors)} errored)"),
        ("kb-nano wall (s)", fmt(kb_wall)),
        *(
            (("kb-nano manifest", result["manifest"] + (" (--cold-cache)" if args.cold_cache else "")),)
            if "manifest" in result
            else ()
        ),
        ("kb-nano sum of rows' wall_s (s)", fmt(result["kb_nano_row_wall_s_sum"])),
        *(
            (
                (
                    "kb-nano before / during / after jobs (s)",
                    " / ".join(fmt(v) for v in result["kb_nano_phases_s"].values()),
                ),
            )
            if result.get("kb_nano_phases_s")
            else ()
        ),
        ("bare-loop wall (s)", fmt(bare_wall)),
        ("ratio kb/bare", fmt(ratio) + ("x" if ratio else "")),
        *(
            (
                f"GPU util during {k}",
                f"{g['busy_pct']:.0f}% of {g['samples']} samples > 0, mean {g['mean_util_pct']:.1f}%",
            )
            for k, g in (("kb-nano", kb_gpu), ("bare loop", bare_gpu))
            if g
        ),
        ("machine", result["machine"]),
        ("torch", torch.__version__),
        ("warmup / runs per side", f"{result['num_warmup']} / {result['num_runs']}"),
        ("command", result["command"]),
        *((("kb_nano command", result["kb_nano_command"]),) if "kb_nano_command" in result else ()),
        *((("workdir (kept)", result["workdir"]),) if result["workdir"] else ()),
    ):
        print(f"{label:<34}{value}")
    for pr in errors:
        print(f"bare-loop error: {pr['scenario_id']} {pr['candidate']}: {pr['error']}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if errors:
        return 2
    if args.max_ratio is not None and ratio is not None and ratio > args.max_ratio:
        print(f"ratio {ratio:.2f} exceeds --max-ratio {args.max_ratio}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
