"""The argument parser of ``kb_nano`` and its entry point."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from kb_nano.cli import flags
from kb_nano.cli.config import split_passthrough
from kb_nano.cli.e2e import cmd_e2e, cmd_eval
from kb_nano.cli.kernels import cmd_capture_golden, cmd_generate_inputs, cmd_kernels
from kb_nano.cli.tracking import cmd_history, cmd_mlflow_ui
from kb_nano.errors import KbNanoError
from kb_nano.files import blocking_file, not_a_directory
from kb_nano.interrupts import SignalInterrupt, interrupts
from kb_nano.paths import find_workflow_root


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


def build_parser(root: Path | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``kb_nano``. The options that set config keys come from the
    tables of :mod:`kb_nano.cli.flags`, their help and types from the config schema of the
    workflow at ``root`` (default: :func:`kb_nano.paths.find_workflow_root`). Raises
    ``KbNanoError`` when no workflow (its schema) is found."""
    schema, embedded = flags.help_sources(root or find_workflow_root())

    def add(p: argparse.ArgumentParser, table) -> None:
        flags.add_flags(p, table, schema, embedded)

    parser = _Parser(
        prog="kb_nano",
        description="kb-nano: benchmark candidate LLM-inference kernels (a front for its Snakemake workflow).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernels", help="Tier 1: candidates vs baselines on real model shapes")
    add(k, flags.KERNELS)
    _snakemake_flags(k)
    k.add_argument("--list", action="store_true", help="list the operators (targets) and exit")
    k.add_argument("--level", type=int, choices=[1, 2, 3, 4], help="with --list: only this level")
    k.add_argument("--map", action="store_true", help="show each model's operators and per-rank shapes and exit")
    k.add_argument(
        "--gpu-pool",
        type=flags.positive_int,
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
    add(g, flags.GENERATE_INPUTS)
    _snakemake_flags(g)
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
    add(c, flags.CAPTURE_GOLDEN)
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
        p = esub.add_parser(
            kind,
            help=text,
            description=f"{text}. The workload flags (--input-len, ...) default to the first configured "
            f"e2e.workloads entry of kind {kind}, else vLLM's defaults.",
        )
        add(p, flags.E2E)
        add(p, flags.workload_flags(kind))
        p.add_argument("--baseline", action="store_true", help="run only the baseline variant")
        _snakemake_flags(p)
        p.set_defaults(func=cmd_e2e)

    v = sub.add_parser("eval", help="Tier 3: standardized workloads x model x TP, baseline vs candidates (vLLM)")
    add(v, flags.EVAL)
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


# where each command's finished work lies after a Ctrl-C (commands that write none say only
# "interrupted"), and the merged file built from it: a merge the Ctrl-C stopped loses its
# output (Snakemake deletes a killed job's outputs), which the next run rebuilds
INTERRUPT_KEEPS = {
    "kernels": ("results/kernels/", "results/kernels.parquet"),
    "capture-golden": ("results/golden/", None),
    "e2e": ("results/e2e/", "results/e2e.parquet"),
    "eval": ("results/eval/", "results/eval.parquet"),
}


def interrupt_line(command: str, signum: signal.Signals | None) -> str:
    """The last line of a run of ``command`` that ``signum`` (None: a plain
    ``KeyboardInterrupt``) interrupted: where its finished shards are kept, and that a
    merged file an interrupted merge deleted is rebuilt from them by the next run."""
    how = f" ({signum.name})" if signum is not None else ""
    kept, merged = INTERRUPT_KEEPS.get(command, (None, None))
    line = f"interrupted{how}" + (f"; finished shards are kept under {kept}" if kept else "")
    if merged:
        line += f"; {merged}, if its merge was stopped, is rebuilt from them on the next run"
    return line


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kb_nano`` console script. Returns the exit status; user
    errors (and a file where kb-nano writes a directory) print ``error: <one line>`` and
    return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = split_passthrough(argv)
    try:
        parser = build_parser()
    except KbNanoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(own)
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
        signum = exc.signum if isinstance(exc, SignalInterrupt) else None
        print(interrupt_line(args.command, signum), file=sys.stderr)
        return 130
