"""Timer fidelity on a GPU: kb-nano's three timers against independent ones, and run-to-run
reproducibility (bench/FIDELITY.md).

    python bench/fidelity.py --out fidelity/           # Llama-3.1-8B TP 1, 4 operators, 7 token counts
    python bench/fidelity.py --targets rms_norm --num-tokens 1 4096 --sweeps 1 --no-ncu

Rows: every (scenario, shipped candidate) of ``--targets`` on ``--model`` (kb-nano's own
manifest; attention prefill up to ``--max-prefill-tokens`` and decode up to
``--max-decode-tokens`` sequences against a ``--context-lens`` KV cache). Each row is
measured by kb-nano exactly as a kernel job measures it (:func:`kb_nano.kernels.measure.measure`),
``--sweeps`` times back to back, then re-timed outside kb-nano:

- **kernel time vs ncu**: one process under Nsight Compute (``ncu --metrics
  gpu__time_duration.sum --cache-control none --clock-control none``) runs each module
  ``NCU_CALLS`` times, each call after a marker kernel (``torch.cuda._sleep``) and kb-nano's
  read flush; a call's ncu time is the sum of its kernels' ``gpu__time_duration``, median
  over the calls. ``--cache-control none`` with kb-nano's flush before each call, rather than
  ``--cache-control all``: ncu's own flush runs before *every* kernel, so a multi-kernel
  call would re-read its intermediates from memory; kb-nano's (and a model's) calls find
  them in L2. Agreement: within 5 % for calls >= 10 us, within 1 us below.
- **graph time vs do_bench_cudagraph**: ``triton.testing.do_bench_cudagraph`` of a function
  that rotates over as many input sets as the row's ``graph_calls`` (K) and keeps each
  call's output until K calls later, so both replay the same workload: K input sets, K
  output buffers written in turn (kb-nano keeps every output of its graph, to check it).
  Median mode, ``rep=100``; the SM clock (NVML) is sampled during it. Agreement: within
  5 %. Also shown (``rep=20``): the same without keeping outputs (every call reuses one
  freed output buffer, as ``do_bench_cudagraph(lambda: module(*x))`` does).
- **reproducibility**: the speedup of sweep 2 against sweep 1: the relative difference
  and whether sweep 2's speedup lies in sweep 1's interval.
- **flush**: CUPTI kernel time of each single-kernel candidate at the largest token count
  after a zeroing flush and after kb-nano's reading flush, next to ncu.

Writes ``rows.json`` and ``report.md`` under ``--out`` and prints the report. Needs CUDA,
Triton and (for the ncu table) ``ncu``; exits 1 when a row disagrees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch
from fidelity_each import KERNEL_ABS_MS, KERNEL_REL, activity_trace, cupti_each_ms, each_table
from fidelity_ncu import ncu_ms
from fidelity_rows import REPO, input_sets, modules, rows_of, settings, slots

GRAPH_REL = 0.05


def do_bench_graph_ms(module, sets: list[list], ring: bool = True, rep: int = 100) -> tuple[float, float | None]:
    """``do_bench_cudagraph`` (median) of a function rotating over ``sets``, and the median
    SM clock (MHz, NVML) while it ran. ``ring``: each call's output is kept until
    ``len(sets)`` calls later, so the calls write ``len(sets)`` distinct output buffers in
    turn, as kb-nano's graph does (it keeps every call's output, to check it); without,
    every output is freed at once and the next call reuses its memory."""
    import collections

    import triton.testing

    i, held = [0], collections.deque(maxlen=len(sets) if ring else 1)

    def fn():
        out = module(*sets[i[0] % len(sets)])
        if ring:
            held.append(out)
        i[0] += 1

    clock = ClockSampler()
    with torch.inference_mode(), clock:
        ms = float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    held.clear()
    return ms, clock.median()


class ClockSampler:
    """The SM clock (MHz) sampled by NVML every 10 ms in a thread while the block runs."""

    def __enter__(self):
        import threading

        self.samples, self._stop = [], threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            return self

        def run():
            while not self._stop.wait(0.01):
                self.samples.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if getattr(self, "_thread", None):
            self._thread.join()

    def median(self) -> float | None:
        return float(statistics.median(self.samples)) if self.samples else None


def flush_compare_us(module, inputs: list, device: torch.device, calls: int = 30) -> dict:
    """Median CUPTI kernel time (us) of a single-kernel ``module`` after a zeroing and after a
    reading flush of kb-nano's size, read through :func:`fidelity_each.activity_trace`
    (the flush's, the gap's and the memset's records left out by name)."""
    from kb_nano.kernels.timing import L2Flush

    read = L2Flush(device)
    zero = torch.empty(read.nbytes, dtype=torch.int8, device=device)
    trace, out = activity_trace(), {}
    with torch.inference_mode():
        for mode, flush in (("zero", zero.zero_), ("read", read)):
            for _ in range(3):
                flush()
                module(*inputs)
            torch.cuda.synchronize()
            trace.start()
            for _ in range(calls):
                flush()
                torch.cuda._sleep(1000)  # a gap, so the call's kernel starts alone
                module(*inputs)
            torch.cuda.synchronize()
            names = {}
            for _, name, start, end in trace.stop():
                names.setdefault(name, []).append((end - start) / 1e3)
            mine = [
                v
                for n, v in names.items()
                if len(v) == calls
                and not any(part in n.lower() for part in ("reduce_kernel", "spin", "elementwise", "memset"))
            ]
            out[mode] = statistics.median(mine[0]) if len(mine) == 1 else None
    return out


def mhz(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def kernel_ok(kb: float, ref: float) -> bool:
    return abs(kb - ref) <= (KERNEL_REL * ref if ref >= 0.010 else KERNEL_ABS_MS)


def report(rows: list[dict], ncu_note: str | None, head: str) -> tuple[str, int]:
    out, bad = [head, ""], 0
    out += [
        "## Kernel time (CUPTI) vs ncu",
        "",
        "| row | side | kernels: kb-nano / ncu | kb-nano kernel ms | ncu ms | diff | agrees |",
        "| --- | --- | ---: | ---: | ---: | ---: | :---: |",
    ]
    if ncu_note:
        out.append(f"| ncu not run: {ncu_note} | | | | | | |")
    for r in rows:
        for side in ("baseline", "candidate"):
            kb, ref = r[f"{side}_kernel_ms"], r.get(f"ncu_{side}_ms")
            if kb is None or ref is None:
                continue
            ok = kernel_ok(kb, ref)
            bad += not ok
            out.append(
                f"| {r['row']} | {side} | {r.get(f'{side}_kernels')} / {r.get(f'ncu_{side}_kernels')} "
                f"| {kb:.4f} | {ref:.4f} | {100 * (kb / ref - 1):+.1f}% | "
                f"{'yes' if ok else '**no**'} |"
            )
    out += [
        "",
        "## Graph time vs do_bench_cudagraph",
        "",
        "| row | side | K | kb-nano graph ms (SM MHz) | do_bench_cudagraph ms (SM MHz) | diff | agrees "
        "| one output buffer: ms, diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | :---: | ---: |",
    ]
    for r in rows:
        for side in ("baseline", "candidate"):
            kb, ref = r[f"{side}_graph_ms"], r.get(f"dbcg_{side}_ms")
            if kb is None or ref is None:
                continue
            ok = abs(kb / ref - 1) <= GRAPH_REL
            bad += not ok
            one = r.get(f"dbcg1_{side}_ms")
            out.append(
                f"| {r['row']} | {side} | {r.get('graph_calls')} | {kb:.4f} ({mhz(r.get('sm_clock_mhz'))}) | "
                f"{ref:.4f} ({mhz(r.get(f'dbcg_{side}_mhz'))}) | {100 * (kb / ref - 1):+.1f}% | "
                f"{'yes' if ok else '**no**'} | " + (f"{one:.4f}, {100 * (kb / one - 1):+.1f}% |" if one else "- |")
            )
    out += [
        "",
        "## Reproducibility: two back-to-back sweeps",
        "",
        "| row | basis | speedup, sweep 1 [95% interval] | speedup, sweep 2 | diff | in interval 1 |",
        "| --- | --- | ---: | ---: | ---: | :---: |",
    ]
    diffs, inside = [], 0
    for r in rows:
        if r.get("speedup_2") is None:
            continue
        d = r["speedup_2"] / r["speedup"] - 1
        ok = r["speedup_ci_low"] <= r["speedup_2"] <= r["speedup_ci_high"]
        diffs.append(abs(d))
        inside += ok
        out.append(
            f"| {r['row']} | {r['speedup_basis']} | {r['speedup']:.3f} [{r['speedup_ci_low']:.3f}, "
            f"{r['speedup_ci_high']:.3f}] | {r['speedup_2']:.3f} | {100 * d:+.1f}% | {'yes' if ok else 'no'} |"
        )
    if diffs:
        out += [
            "",
            f"Speedup difference between the sweeps: max {100 * max(diffs):.1f}%, median "
            f"{100 * statistics.median(diffs):.1f}%; sweep 2 inside sweep 1's interval for {inside} of {len(diffs)} rows.",
        ]
    out += each_table(rows)
    flush = [r for r in rows if r.get("flush_us")]
    if flush:
        out += [
            "",
            "## Flush: CUPTI kernel time after zeroing vs reading the flush buffer",
            "",
            "| row | after zeroing, us | after reading, us | ncu, us |",
            "| --- | ---: | ---: | ---: |",
        ]
        for r in flush:
            f, n = r["flush_us"], r.get("ncu_candidate_ms")
            zero = f"{f['zero']:.1f}" if f.get("zero") else "-"
            read = f"{f['read']:.1f}" if f.get("read") else "-"
            out.append(f"| {r['row']} | {zero} | {read} | {'-' if n is None else f'{1e3 * n:.1f}'} |")
    return "\n".join(out), bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama31-8b")
    parser.add_argument("--targets", nargs="+", default=["rms_norm", "silu_and_mul", "rotary_embedding", "attention"])
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096, 16384])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[1024])
    parser.add_argument("--max-decode-tokens", type=int, default=256)
    parser.add_argument("--max-prefill-tokens", type=int, default=4096)
    parser.add_argument("--sweeps", type=int, default=2, choices=[1, 2])
    parser.add_argument("--no-ncu", action="store_true")
    parser.add_argument("--out", default=None, help="directory for rows.json, report.md and ncu.log")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/fidelity.py: needs a CUDA device", file=sys.stderr)
        return 2
    from kb_nano.kernels.measure import measure
    from kb_nano.kernels.pool import Pool

    out_dir = Path(a.out or tempfile.mkdtemp(prefix="kb_nano_fidelity-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    jobs = rows_of(a)
    root = Path(tempfile.mkdtemp(prefix="kb_nano_fidelity_root-"))
    (root / "results").mkdir()
    pool = Pool("cuda", {"OMP_WAIT_POLICY": "PASSIVE"}, root)
    rows = []
    try:
        with open(out_dir / "jobs.log", "wb") as log:
            for sweep in range(a.sweeps):
                for j, (s, cand) in enumerate(jobs):
                    row = measure(s, cand, REPO / "candidates" / f"{cand}.py", settings(), root, pool, log.fileno())
                    if row["status"] != "passed":
                        print(f"{s['scenario_id']} {cand}: {row['status']}: {row['error']}", file=sys.stderr)
                    if sweep == 0:
                        rows.append({**row, "row": f"{s['scenario_id'].replace('__', ' ')} {cand.split('/')[1]}"})
                    elif rows[j]["status"] == "passed" and row["status"] == "passed":
                        rows[j]["speedup_2"] = row["speedup"]
    finally:
        pool.close()
    ok_jobs = [(s, c) for (s, c), r in zip(jobs, rows) if r["status"] == "passed"]
    rows = [r for r in rows if r["status"] == "passed"]
    biggest = max((s["num_tokens"] for s, _ in ok_jobs), default=0)
    for r, (s, cand) in zip(rows, ok_jobs):
        mods = modules(s, cand, device)
        sets = input_sets(s, device, r["graph_calls"] or slots(s, r["baseline_eager_ms"], device))
        for side in ("baseline", "candidate"):
            r[f"dbcg_{side}_ms"], r[f"dbcg_{side}_mhz"] = do_bench_graph_ms(mods[side], sets)
            r[f"dbcg1_{side}_ms"], _ = do_bench_graph_ms(mods[side], sets, ring=False, rep=20)
        if s["num_tokens"] == biggest and r["candidate_kernels"] == 1 and not s.get("context_len"):
            r["flush_us"] = flush_compare_us(mods["candidate"], sets[0], device)
        del mods, sets
        torch.cuda.empty_cache()
    for r, (s, cand) in zip(rows, ok_jobs):  # after every do_bench_cudagraph: CUPTI set up costs graphs ~2%
        mods = modules(s, cand, device)
        inputs = input_sets(s, device, 1)[0]
        for side in ("baseline", "candidate"):
            r[f"cupti_{side}_each"], r[f"cupti_{side}_each_mhz"] = cupti_each_ms(mods[side], inputs, device)
        del mods, inputs
        torch.cuda.empty_cache()
    note = "--no-ncu" if a.no_ncu else None
    if not a.no_ncu:
        got = ncu_ms([[s, c] for s, c in ok_jobs], out_dir)
        if isinstance(got, str):
            note = got
        else:
            for r, (b, c) in zip(rows, got):
                for side, n in (("baseline", b), ("candidate", c)):
                    r[f"ncu_{side}_ms"], r[f"ncu_{side}_kernels"] = n["ms"], n["kernels"]
                    r[f"ncu_{side}_names"], r[f"ncu_{side}_each_ms"] = n["names"], n["each_ms"]
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ).stdout.strip()
    head = (
        f"Measured {datetime.now(UTC).isoformat(timespec='minutes')} on {smi}, torch {torch.__version__}; "
        f"command: python bench/fidelity.py {' '.join(sys.argv[1:])}; {len(rows)} rows."
    )
    text, bad = report(rows, note, head)
    (out_dir / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    (out_dir / "report.md").write_text(text + "\n")
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
