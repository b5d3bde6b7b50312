"""The argument parser of ``kb_nano`` and its entry point."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from kb_nano.cli.config import split_passthrough
from kb_nano.cli.e2e import cmd_e2e, cmd_eval
from kb_nano.cli.kernels import cmd_capture_golden, cmd_generate_inputs, cmd_kernels
from kb_nano.cli.snakemake import interrupts
from kb_nano.cli.tracking import cmd_history, cmd_mlflow_ui
from kb_nano.errors import KbNanoError
from kb_nano.files import blocking_file, not_a_directory
from kb_nano.interrupts import SignalInterrupt


def _tracking_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tracking-uri",
        help="MLflow store (default: $MLFLOW_TRACKING_URI, config mlflow_tracking_uri, else sqlite results/mlflow.db)",
    )
    p.add_argument("--configfile", help="config file layered over config/config.yaml (for mlflow_tracking_uri)")


def _cores(value: str) -> str:
    if value == "all" or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError("must be a positive number or 'all'")


def _positive_int(value: str) -> int:
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise argparse.ArgumentTypeError("must be a positive integer")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", nargs="+", action="extend", help="model key prefix (llama31), vendored Hub id, or config.json path"
    )
    p.add_argument("--tp", nargs="+", action="extend", type=int, help="tensor-parallel degree(s)")
    p.add_argument("--num-tokens", nargs="+", action="extend", type=int, help="token count(s) per scenario")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    _snakemake_flags(p)


def _snakemake_flags(p: argparse.ArgumentParser) -> None:
    """The flags every command that runs the workflow shares."""
    p.add_argument("--configfile", help="config file whose keys override config/config.yaml")
    p.add_argument(
        "--cores", default="all", type=_cores, help="Snakemake --cores: a positive number or 'all' (default)"
    )
    p.add_argument("-n", "--dry-run", action="store_true", help="show the jobs without running them")
    p.add_argument("-v", "--verbose", action="store_true", help="print the Snakemake command and rule details")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``kb_nano kernels: error: ...`` and how to get help),
    not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kb_nano``."""
    parser = _Parser(prog="kb_nano", description="The ``kb_nano`` command line: a front for the Snakemake workflow.")
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernels", help="Tier 1: candidates vs baselines on real model shapes")
    _common(k)
    k.add_argument("--target", nargs="+", action="extend", help="operator name(s), e.g. rms_norm")
    k.add_argument("--category", nargs="+", action="extend", help="operator category(ies), e.g. norm")
    k.add_argument(
        "--candidate", nargs="+", action="extend", help="candidate id(s) or prefixes, e.g. rms_norm/torch_fused"
    )
    k.add_argument("--num-warmup", type=int, help="untimed calls per side (default 10)")
    k.add_argument(
        "--num-runs",
        type=int,
        help="timed eager calls per side, at least (default 100; CPU: small calls "
        "get more, at least 10 batches of about 5 ms; CUDA: blocks run until the interval is within "
        "ci_target or max_timing_s; the row's num_runs says how many ran)",
    )
    k.add_argument(
        "--atol",
        type=float,
        help="absolute tolerance for every operator (default: each operator's own, "
        "e.g. 0.01 for bf16 pointwise ops; docs/kernels.md)",
    )
    k.add_argument(
        "--rtol",
        type=float,
        help="relative tolerance for every operator (default: each operator's own; 0 = max-abs-error only)",
    )
    k.add_argument("--device", help="auto | cpu | cuda[:i] (default auto)")
    k.add_argument("--timeout-s", type=float, help="seconds per kernel job, i.e. per scenario (default 600)")
    k.add_argument(
        "--num-trials", type=int, help="correctness trials on fresh inputs before timing (default 3, at least 2)"
    )
    k.add_argument(
        "--seed",
        type=int,
        help="replay: use this measurement seed (a row's `seed`) instead of a fresh one "
        "from the OS; the same seed gives the same trial inputs and parameters",
    )
    k.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: also time K calls per CUDA-graph replay (columns *_graph_ms; default on)",
    )
    k.add_argument(
        "--speedup-basis",
        choices=["auto", "kernel", "graph", "eager"],
        help="the timer `speedup` comes from (default auto: kernel on CUDA, eager on a CPU, where it is "
        "the only one); recorded per row as speedup_basis",
    )
    k.add_argument(
        "--float32-matmul-precision",
        choices=["highest", "high", "medium"],
        help="torch.set_float32_matmul_precision for both sides (default highest: no TF32)",
    )
    k.add_argument(
        "--memory-limit-gb",
        type=float,
        help="address-space cap of a CPU worker in GiB, at least 2 (the worker maps ~1 GiB before the "
        "candidate runs); a candidate past it gets runtime_error (default none)",
    )
    k.add_argument("--output-json", help="merged JSON path (default results/kernels.json)")
    k.add_argument("--list", action="store_true", help="list the operators (targets) and exit")
    k.add_argument("--level", type=int, choices=[1, 2, 3, 4], help="with --list: only this level")
    k.add_argument("--map", action="store_true", help="show each model's operators and per-rank shapes and exit")
    k.add_argument(
        "--gpu-pool",
        type=_positive_int,
        metavar="N",
        help="use the first N GPUs of the pool (CUDA_VISIBLE_DEVICES, else all visible): "
        "--resources gpu=N and each job leases one of those N devices",
    )
    k.add_argument(
        "--fail-on-error", action="store_true", help="exit 1 when any row is neither passed nor skipped (for CI gates)"
    )
    k.add_argument(
        "--all-rows",
        action="store_true",
        help="print every row of the selection (default: only the rows this run measured, when it reused others)",
    )
    k.add_argument(
        "--by-scenario",
        action="store_true",
        help="print providers side by side: one table per operator x model x TP, one line per num_tokens, "
        "the baseline and each candidate in columns (time, GB/s, speedup and its interval)",
    )
    k.add_argument(
        "--versus",
        metavar="CANDIDATE",
        help="with --by-scenario (implied): also each candidate's time relative to this candidate's",
    )
    k.set_defaults(func=cmd_kernels)

    g = sub.add_parser("generate-inputs", help="write the scenario manifest results/inputs/llm-<selection>.yaml")
    _common(g)
    g.add_argument("--target", nargs="+", action="extend", help="only these operators' scenarios, e.g. rms_norm")
    g.add_argument("--category", nargs="+", action="extend", help="only these operator categories, e.g. norm")
    g.set_defaults(func=cmd_generate_inputs)

    c = sub.add_parser("capture-golden", help="capture real inputs of attention / fused_moe / sampler from a model run")
    c.add_argument(
        "--model",
        nargs="+",
        action="extend",
        required=True,
        help="model key prefix (qwen3-8b), vendored Hub id (Qwen/Qwen3-8B), or config.json path",
    )
    c.add_argument("--weights", help="directory of local weights (default: random weights from the config)")
    c.add_argument("--num-layers", type=int, help="decoder layers to keep (default 2; 0 = all)")
    c.add_argument("--force", action="store_true", help="capture again even if the files are up to date")
    _snakemake_flags(c)
    c.set_defaults(func=cmd_capture_golden)

    e = sub.add_parser("e2e", help="Tier 2: vLLM's own benchmarks with candidates swapped into the engine")
    esub = e.add_subparsers(dest="kind", required=True)
    for kind, text in (
        ("throughput", "offline throughput (vllm bench throughput): requests/s, tokens/s"),
        ("latency", "one batch end to end (vllm bench latency): average and percentiles"),
        ("serve", "vllm serve on loopback driven by vllm bench serve: TTFT, TPOT, ITL, E2EL"),
    ):
        p = esub.add_parser(kind, help=text)
        p.add_argument(
            "--model",
            nargs="+",
            action="extend",
            help="model directory (config.json [+ weights + tokenizer]), key or vendored Hub id "
            "(default: the embedded tiny Llama)",
        )
        p.add_argument(
            "--tp",
            "--tensor-parallel-size",
            dest="tp",
            nargs="+",
            action="extend",
            type=int,
            help="tensor-parallel degree(s)",
        )
        p.add_argument("--seed", type=int)
        p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
        p.add_argument("--max-model-len", type=int)
        p.add_argument(
            "--enforce-eager",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="vLLM --enforce-eager (default on in config/config.yaml)",
        )
        p.add_argument(
            "--load-format",
            choices=["auto", "dummy"],
            help="dummy = random weights; auto = the model directory's weights if any, else dummy",
        )
        p.add_argument("--output-json", help="merged JSON (default results/e2e.json)")
        p.add_argument("--input-len", type=int)
        p.add_argument("--output-len", type=int)
        if kind in ("throughput", "serve"):
            p.add_argument("--dataset-name", choices=["random"])
            p.add_argument("--random-input-len", type=int)
            p.add_argument("--random-output-len", type=int)
            p.add_argument("--random-range-ratio", type=float)
            p.add_argument("--num-prompts", type=int)
        if kind == "serve":
            p.add_argument("--request-rate", type=float, help="requests/s (default: all at once, vLLM's inf)")
            p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
        else:
            p.add_argument("--batch-size", type=int)
            p.add_argument("--num-iters-warmup", type=int)
            p.add_argument("--num-iters", type=int)
        p.add_argument(
            "--candidates",
            nargs="+",
            action="extend",
            help="candidate ids or prefixes of the candidate variant (default: per target, the fastest that passed Tier 1)",
        )
        p.add_argument("--baseline", action="store_true", help="run only the baseline variant")
        p.add_argument(
            "--pairs",
            type=_positive_int,
            help="baseline/candidate engine-run pairs per job, alternately (default 3; 1 = no interval)",
        )
        p.add_argument("--timeout-s", type=float, help="seconds per job (default 900)")
        p.add_argument("--device", choices=["auto", "cpu", "cuda"])
        _snakemake_flags(p)
        p.set_defaults(func=cmd_e2e)

    v = sub.add_parser("eval", help="Tier 3: standardized workloads x model x TP, baseline vs candidates (vLLM)")
    v.add_argument(
        "--model",
        nargs="+",
        action="extend",
        help="models (default: the configured models the candidates apply to; --smoke: the tiny Llama)",
    )
    v.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        nargs="+",
        action="extend",
        type=int,
        help="tensor-parallel degrees (default 1 4)",
    )
    v.add_argument("--category", nargs="+", action="extend", help="operator categories of the candidates (default all)")
    v.add_argument(
        "--candidate",
        "--candidates",
        dest="candidate",
        nargs="+",
        action="extend",
        help="candidate ids (default: per target, the fastest that passed Tier 1)",
    )
    v.add_argument("--num-prompts", type=int, help="prompts per throughput workload (default 1000)")
    v.add_argument("--gpu-pool", type=int, help="GPUs the sweep may use at once (default 8)")
    v.add_argument("--seed", type=int, help="vLLM --seed (default 42)")
    v.add_argument("--output-json", help="merged JSON (default results/eval.json)")
    v.add_argument(
        "--smoke",
        action="store_true",
        help="CPU smoke run: lengths / 16, 16 prompts, 1+3 latency iterations (recorded in every row)",
    )
    v.add_argument("--device", choices=["auto", "cpu", "cuda"], help="auto (default) | cpu | cuda")
    v.add_argument(
        "--pairs", type=_positive_int, help="baseline/candidate run pairs per job, alternately (default 3; --smoke: 1)"
    )
    v.add_argument("--timeout-s", type=float, help="seconds per job (default 3600)")
    _snakemake_flags(v)
    v.set_defaults(func=cmd_eval)

    h = sub.add_parser("history", help="past runs recorded in MLflow; --compare two of them")
    h.add_argument("--tier", choices=["kernels", "e2e", "eval"], help="only this tier (default: all)")
    h.add_argument("--target", help="only runs that include this operator, e.g. rms_norm")
    h.add_argument("--candidate", help="only runs that include this candidate id (or id prefix)")
    h.add_argument("--model", help="only runs that include this model key (or key prefix, e.g. llama31)")
    h.add_argument("--limit", type=int, default=20, help="at most this many runs, newest first (default 20)")
    h.add_argument(
        "--compare",
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="per-scenario speedup changes from run A to run B (run names, ids or unique id prefixes)",
    )
    _tracking_flags(h)
    h.set_defaults(func=cmd_history)

    u = sub.add_parser("mlflow-ui", help="serve the MLflow UI on the kb-nano store and print its URL")
    u.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, loopback only)")
    u.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    u.add_argument("--workers", type=int, default=1, help="server worker processes (default 1)")
    u.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for the server (default 120)")
    _tracking_flags(u)
    u.set_defaults(func=cmd_mlflow_ui)
    return parser


# where each command's finished work lies after a Ctrl-C (commands that write none say only "interrupted")
INTERRUPT_KEEPS = {
    "kernels": "results/kernels/",
    "capture-golden": "results/golden/",
    "e2e": "results/e2e/",
    "eval": "results/eval/",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kb_nano`` console script. Returns the exit status; user
    errors (and a file where kb-nano writes a directory) print ``error: <one line>`` and
    return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = split_passthrough(argv)
    args = build_parser().parse_args(own)
    try:
        # SIGTERM and SIGHUP too: a run stopped by a script or a closed terminal ends as a Ctrl-C does
        with interrupts((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
            return args.func(args, passthrough)
    except KbNanoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (NotADirectoryError, FileExistsError) as exc:  # a file where this process writes a directory
        blocker = blocking_file(Path(exc.filename)) if exc.filename else None
        if blocker is None:
            raise
        print(f"error: {not_a_directory(blocker)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        kept = INTERRUPT_KEEPS.get(args.command)
        how = f" ({exc.signum.name})" if isinstance(exc, SignalInterrupt) else ""
        print(f"interrupted{how}" + (f"; finished shards are kept under {kept}" if kept else ""), file=sys.stderr)
        return 130
