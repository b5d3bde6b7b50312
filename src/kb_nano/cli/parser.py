"""The argument parser of ``kb_nano`` and its entry point."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from kb_nano import flags
from kb_nano.cli import commands
from kb_nano.errors import KbNanoError, one_line
from kb_nano.interrupts import interrupts
from kb_nano.launch import interrupt_line
from kb_nano.paths import find_workflow_root


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``kb_nano kernels: error: ...`` and how to get help),
    not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(root: Path | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``kb_nano``. The options that set config keys come from the
    tables of :mod:`kb_nano.flags`, their help and types from the config schema of the
    workflow at ``root`` (default: :func:`kb_nano.paths.find_workflow_root`). Raises
    ``KbNanoError`` when no workflow (its schema) is found."""
    add = flags.option_adder(root or find_workflow_root())

    parser = _Parser(
        prog="kb_nano",
        description="kb-nano: benchmark candidate LLM-inference kernels (a front for its Snakemake workflow).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("kernels", help="Tier 1: candidates vs baselines on real model shapes")
    add(k, flags.KERNELS)
    flags.add_snakemake_flags(k)
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
    k.set_defaults(func=commands.cmd_kernels)

    g = sub.add_parser("generate-inputs", help="write the scenario manifest results/inputs/llm-<selection>.yaml")
    add(g, flags.GENERATE_INPUTS)
    flags.add_snakemake_flags(g)
    g.set_defaults(func=commands.cmd_generate_inputs)

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
    flags.add_snakemake_flags(c)
    c.set_defaults(func=commands.cmd_capture_golden)

    e = sub.add_parser("e2e", help="Tier 2: vLLM's own benchmarks with candidates swapped into the engine")
    esub = e.add_subparsers(dest="kind", required=True)
    for kind, text in flags.E2E_KINDS.items():
        p = esub.add_parser(
            kind,
            help=text,
            description=f"{text}. The workload flags (--input-len, ...) default to the first configured "
            f"e2e.workloads entry of kind {kind}, else vLLM's defaults.",
        )
        add(p, flags.E2E)
        add(p, flags.workload_flags(kind))
        p.add_argument("--baseline", action="store_true", help="run only the baseline variant")
        flags.add_snakemake_flags(p)
        p.set_defaults(func=commands.cmd_e2e)

    v = sub.add_parser("eval", help="Tier 3: standardized workloads x model x TP, baseline vs candidates (vLLM)")
    add(v, flags.EVAL)
    flags.add_snakemake_flags(v)
    v.set_defaults(func=commands.cmd_eval)

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
    flags.add_tracking_flags(h)
    h.set_defaults(func=commands.cmd_history)

    u = sub.add_parser("mlflow-ui", help="serve the MLflow UI on the kb-nano store and print its URL")
    u.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, loopback only)")
    u.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    u.add_argument("--workers", type=int, default=1, help="server worker processes (default 1)")
    u.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for the server (default 120)")
    flags.add_tracking_flags(u)
    u.set_defaults(func=commands.cmd_mlflow_ui)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kb_nano`` console script. Returns the exit status; user
    errors (and a file where kb-nano writes a directory) print ``error: <one line>`` and
    return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, passthrough = argv[:cut], argv[cut + 1 :]
    try:
        parser = build_parser()
    except KbNanoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(own)
    if unknown:
        flags.unrecognized(parser, args, unknown)
    try:
        # SIGTERM and SIGHUP too: a run stopped by a script or a closed terminal ends as a Ctrl-C does
        with interrupts((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
            return args.func(args, passthrough)
    except (KbNanoError, NotADirectoryError, FileExistsError) as exc:  # (or a file where it writes a directory)
        line = one_line(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(interrupt_line(args.command, exc), file=sys.stderr)
        return 130
