"""Timing fidelity on a GPU: kb-nano's median vs ``triton.testing.do_bench``, and achieved
bandwidth vs the device's measured copy bandwidth (issue 7, bench/FIDELITY.md).

    python bench/fidelity.py                       # rms_norm, silu_and_mul, attention on Llama-3.1-8B, TP 1
    python bench/fidelity.py --num-tokens 1 4096 --json fidelity.json

For every scenario (from kb-nano's own manifest) and for the baseline and one candidate
of the operator, on the same module and the same input shapes:

- kb-nano: the Tier-1 engine exactly as a kernel job runs it (:func:`kb_nano.kernels.measure.measure`:
  judge and worker processes, fresh input values before every batch, L2 flushed before
  every call, CUDA events; the row's ``baseline_ms`` / ``candidate_ms`` medians);
- Triton: ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")``
  (its own 256 MB L2 flush, fixed inputs).

Each is run ``--repeats`` times, alternating, and the median of the repeats is compared:
``ratio = kb_nano / do_bench``; a row agrees when ``|ratio - 1| <= 3%``. For each row the
achieved bandwidth ``bytes_moved / median`` (the operator's minimum traffic, GB/s) is
printed next to the copy bandwidth :func:`kb_nano.roofline.measure_peaks` measured.
Prints a Markdown table; exits 1 when a row disagrees. Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CANDIDATES = {"rms_norm": "triton_rowwise", "silu_and_mul": "triton_fused", "attention": "gqa_grouped"}
TOLERANCE = 0.03


def modules(scenario: dict, device: torch.device):
    """Baseline and candidate modules of a scenario, same weights, on ``device``."""
    from kb_nano import operators
    from kb_nano.candidates import load_class
    from kb_nano.kernels.inputs import randomize_constant_parameters
    from kb_nano.operators.base import DTYPES

    op = operators.get(scenario["target"])
    dtype = DTYPES[scenario["dtype"]]
    torch.manual_seed(0)
    base = op.baseline(**scenario["init_args"])
    randomize_constant_parameters(base, 0)
    out = {"baseline": base.to(device=device, dtype=dtype).eval()}
    name = CANDIDATES.get(scenario["target"])
    if name:
        cls = load_class(REPO / "candidates" / scenario["target"] / f"{name}.py", scenario["target"])
        cand = cls(**scenario["init_args"])
        cand.load_state_dict(base.state_dict())
        out[f"{scenario['target']}/{name}"] = cand.to(device=device, dtype=dtype).eval()
    return out


def do_bench_ms(scenario: dict, module, device: torch.device, repeats: int) -> float:
    """Median over ``repeats`` of ``triton.testing.do_bench`` (median mode) of one module."""
    import triton.testing

    from kb_nano.operators.base import make_tensor

    gen = torch.Generator().manual_seed(0)
    inputs = [make_tensor(s, gen, str(device)) for s in scenario["inputs"]]
    with torch.inference_mode():
        return statistics.median(triton.testing.do_bench(lambda: module(*inputs), warmup=25, rep=100,
                                                         return_mode="median") for _ in range(repeats))


def kb_nano_ms(scenario: dict, candidate: str, pool, num_runs: int, repeats: int) -> tuple[float, float]:
    """Median over ``repeats`` kb-nano measurements of (baseline_ms, candidate_ms)."""
    import tempfile

    from kb_nano.kernels.measure import measure

    settings = {"device": "cuda", "atol": None, "rtol": None, "num_warmup": 10, "num_runs": num_runs,
                "num_trials": 3, "num_threads": 1, "timeout_s": 600, "seed": None, "golden": None,
                "cuda_graph": False, "float32_matmul_precision": "highest", "memory_limit_gb": None, "roofline": None}
    base, cand = [], []
    path = REPO / "candidates" / f"{candidate}.py"
    with tempfile.TemporaryFile() as log:
        for _ in range(repeats):
            row = measure(scenario, candidate, path, settings, pool.root, pool, log.fileno())
            if row["status"] != "passed":
                raise RuntimeError(f"{scenario['scenario_id']} {candidate}: {row['status']} ({row['error']})")
            base.append(row["baseline_ms"])
            cand.append(row["candidate_ms"])
    return statistics.median(base), statistics.median(cand)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama31-8b")
    parser.add_argument("--targets", nargs="+", default=["rms_norm", "silu_and_mul", "attention"])
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 64, 1024, 4096])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[1024])
    parser.add_argument("--max-decode-tokens", type=int, default=256,
                        help="skip attention decode scenarios with more sequences (their KV cache is num_tokens x context)")
    parser.add_argument("--num-runs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    a = parser.parse_args()

    from kb_nano.manifest import generate
    from kb_nano.roofline import measure_peaks

    device = torch.device("cuda")
    manifest = generate([a.model], [1], a.num_tokens, "auto", REPO, context_lens=a.context_lens)
    scenarios = [s for s in manifest["scenarios"] if s.get("applicable", True) and s["target"] in a.targets
                 and not (s.get("context_len") and s["num_tokens"] > a.max_decode_tokens)]
    import tempfile

    from kb_nano.kernels.pool import Pool

    peak = measure_peaks(device, torch.bfloat16)
    rows = []
    pool = Pool("cuda", {"OMP_WAIT_POLICY": "PASSIVE"}, Path(tempfile.mkdtemp(prefix="kb_nano_fidelity-")))
    try:
        for s in scenarios:
            mods = modules(s, device)
            cand = next((w for w in mods if w != "baseline"), None)
            if cand is None:
                continue
            kb = dict(zip(("baseline", cand), kb_nano_ms(s, cand, pool, a.num_runs, a.repeats)))
            for who, module in mods.items():
                r = {"kb_nano_ms": kb[who], "do_bench_ms": do_bench_ms(s, module, device, a.repeats)}
                r.update(scenario=s["scenario_id"], who=who, bytes_moved=s.get("bytes_moved"))
                r["ratio"] = r["kb_nano_ms"] / r["do_bench_ms"]
                r["gbps"] = s["bytes_moved"] / r["kb_nano_ms"] / 1e6 if s.get("bytes_moved") else None
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
    finally:
        pool.close()
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"{datetime.now(timezone.utc).isoformat(timespec='minutes')}; measured copy bandwidth "
          f"{peak['copy_gbps']:.0f} GB/s (read + write), bf16 matmul {peak['matmul_tflops']:.0f} TFLOP/s\n")
    print("| scenario | module | kb-nano median ms | do_bench median ms | ratio | achieved GB/s | % of copy |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    bad = 0
    for r in rows:
        ok = abs(r["ratio"] - 1) <= TOLERANCE
        bad += not ok
        bw = f"{r['gbps']:.0f} | {100 * r['gbps'] / peak['copy_gbps']:.0f}%" if r["gbps"] else "- | -"
        print(f"| {r['scenario']} | {r['who']} | {r['kb_nano_ms']:.4f} | {r['do_bench_ms']:.4f} | "
              f"{r['ratio']:.3f}{'' if ok else ' **off**'} | {bw} |")
    print(f"\n{len(rows) - bad} of {len(rows)} rows within {TOLERANCE:.0%} of do_bench")
    if a.json:
        Path(a.json).write_text(json.dumps({"peak": peak, "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
