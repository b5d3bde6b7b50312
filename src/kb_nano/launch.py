"""Running the workflow as ``kb_nano`` does: Snakemake's own CLI in a process group of
its own (:mod:`kb_nano.snakemake_main`), with the targets and the config override of one
invocation, interrupted cleanly on SIGINT, SIGTERM, SIGHUP or kb_nano's death; which
Snakemake options run no job; what to say when it failed or was interrupted."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from kb_nano import gpus
from kb_nano.errors import KbNanoError
from kb_nano.interrupts import SignalInterrupt, interrupts, on_parent_death, stop_group

# Snakemake's actions that run no job (snakemake.cli.args_to_api): the attribute of its
# parsed arguments and the option names that set it. After one of them kb_nano prints only
# what Snakemake said, not the results table of an earlier run.
NO_JOB_ACTIONS = {
    "dryrun": ("--dry-run", "--dryrun", "-n"),
    "touch": ("--touch", "-t"),
    "lint": ("--lint",),
    "list_target_rules": ("--list-target-rules", "--lt"),
    "list_rules": ("--list-rules", "--list", "-l"),
    "print_compilation": ("--print-compilation",),
    "containerize": ("--containerize",),
    "generate_unit_tests": ("--generate-unit-tests",),
    "dag": ("--dag",),
    "rulegraph": ("--rulegraph",),
    "filegraph": ("--filegraph",),
    "d3dag": ("--d3dag",),
    "unlock": ("--unlock",),
    "cleanup_metadata": ("--cleanup-metadata", "--cm"),
    "conda_cleanup_envs": ("--conda-cleanup-envs",),
    "conda_create_envs_only": ("--conda-create-envs-only",),
    "list_conda_envs": ("--list-conda-envs",),
    "cleanup_shadow": ("--cleanup-shadow",),
    "container_cleanup_images": ("--container-cleanup-images",),
    "list_changes": ("--list-changes", "--lc"),
    "list_input_changes": ("--list-input-changes", "--li"),
    "list_params_changes": ("--list-params-changes", "--lp"),
    "list_untracked": ("--list-untracked", "--lu"),
    "summary": ("--summary", "-S"),
    "detailed_summary": ("--detailed-summary", "-D"),
    "archive": ("--archive",),
    "delete_all_output": ("--delete-all-output",),
    "delete_temp_output": ("--delete-temp-output",),
    "export_cwl": ("--export-cwl",),
    "report": ("--report",),  # unless --report-after-run
    "executor": ("--executor", "-e"),  # -e dryrun / touch
}
_EXITS = ("--help", "-h", "--version", "-v")  # Snakemake prints and exits while parsing


def _may_name_an_action(passthrough: list[str]) -> bool:
    """Whether any argument could be (an abbreviation of, or a short-option cluster with)
    an option of NO_JOB_ACTIONS; when not, Snakemake's parser need not be imported (1-2 s)."""
    options = [o for names in NO_JOB_ACTIONS.values() for o in names] + list(_EXITS)
    shorts = {o[1] for o in options if len(o) == 2}
    for arg in passthrough:
        if arg.startswith("--") and len(arg) > 2:
            name = arg.split("=", 1)[0]
            if any(o.startswith(name) for o in options if o.startswith("--")):
                return True
        elif arg.startswith("-") and len(arg) > 1 and shorts & set(arg[1:]):
            return True
    return False


@functools.lru_cache(maxsize=8)
def _snakemake_action(passthrough: tuple[str, ...]) -> str | None:
    if not _may_name_an_action(list(passthrough)):
        return None
    import io

    from snakemake.cli import get_argument_parser

    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            ns, _ = get_argument_parser().parse_known_args(list(passthrough))
    except SystemExit as exc:
        return "--help/--version" if exc.code in (0, None) else None
    for attr, names in NO_JOB_ACTIONS.items():
        value = getattr(ns, attr, None)
        if attr == "executor":
            value = value if value in ("dryrun", "touch") else None
        elif attr == "report" and getattr(ns, "report_after_run", False):
            value = None
        if value not in (None, False):
            return names[0]
    return None


def snakemake_action(passthrough: list[str]) -> str | None:
    """The option among the arguments after ``--`` whose Snakemake action runs no job
    (``--unlock``, ``--dry-run``, ``--list-rules``, ``--summary``, ``--cleanup-metadata``,
    ``--help``, ...: :data:`NO_JOB_ACTIONS`), or None. The arguments are read with
    Snakemake's own parser, so abbreviations (``--unl``) and short-option clusters
    (``-np``) count; arguments it rejects give None (Snakemake then fails with its own
    message). With one, the commands print what Snakemake says and no results table."""
    return _snakemake_action(tuple(passthrough))


def run_snakemake(root: Path, targets: list[str], config: dict, args, passthrough: list[str]) -> int:
    """Run the workflow for ``targets`` with ``config`` overrides; returns Snakemake's
    exit status. Progress ("N of M steps done") streams to the terminal. Raises
    :class:`~kb_nano.interrupts.SignalInterrupt` when kb_nano or Snakemake was interrupted,
    after Snakemake has stopped.

    Overrides travel as a temporary YAML config file given after the user's
    ``--configfile`` (Snakemake's ``--config`` does not parse list values).
    """
    import tempfile

    # Targets first: --configfile and --quiet take several values and would swallow them.
    cmd = [
        sys.executable,
        "-m",
        "kb_nano.snakemake_main",  # Snakemake's CLI, quiet when interrupted while it starts
        *targets,
        "--snakefile",
        str(root / "Snakefile"),
        "--directory",
        str(root),
    ]
    cmd += ["--cores", str(args.cores)]
    env = dict(os.environ)
    pool = gpus.pool()
    gpu_pool = getattr(args, "gpu_pool", None)
    if gpu_pool is not None:
        if gpu_pool > len(pool):
            seen = f"only {len(pool)} ({','.join(pool)})" if pool else "none"
            raise KbNanoError(
                f"--gpu-pool {gpu_pool}: {seen} visible here (CUDA_VISIBLE_DEVICES / "
                f"{gpus.POOL_ENV} / nvidia-smi); pass at most that many"
            )
        pool = pool[:gpu_pool]
        env[gpus.POOL_ENV] = ",".join(pool)
    if pool and "--resources" not in passthrough:
        # Snakemake only counts GPUs: at most one GPU job per device of the pool at once;
        # each job then leases a concrete device id (kb_nano.gpus).
        cmd += ["--resources", f"gpu={len(pool)}"]
    no_jobs = args.dry_run or snakemake_action(passthrough) is not None
    if args.dry_run:
        cmd += ["--dry-run"]
    elif (
        "results/kernels.parquet" in targets
        and not no_jobs
        and not {"--profile", "--executor", "-e"} & set(passthrough)
    ):
        env["KB_NANO_PRESTART_JUDGE"] = "1"  # local kernel jobs: start the judge while Snakemake parses
    if not args.verbose and not no_jobs and "--quiet" not in passthrough:
        # no per-job rule blocks and no start banner (host, version, config files): on
        # up-to-date results the table follows a few lines; a dry run lists every job
        cmd += ["--quiet", "rules", "host"]
    # Under the workflow directory, not /tmp: cluster jobs (`-- --profile profiles/slurm`)
    # re-read every --configfile on their node, which shares the workflow directory only.
    (root / ".snakemake").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kb_nano_", dir=root / ".snakemake") as tmp:
        configfiles = [str(Path(args.configfile).resolve())] if args.configfile else []
        if config:
            override = Path(tmp) / "overrides.yaml"
            override.write_text(yaml.safe_dump(config, sort_keys=False))
            configfiles.append(str(override))
        if configfiles:
            cmd += ["--configfile", *configfiles]
        cmd += passthrough
        if args.verbose:
            print("+ " + " ".join(cmd), file=sys.stderr)
        # Snakemake runs in a process group of its own, which gets exactly one SIGINT when
        # this process is interrupted (Ctrl-C, kill -INT or SIGTERM to it alone, SIGHUP)
        # and when it dies (PR_SET_PDEATHSIG), so its jobs stop, finished shards stay and
        # its lock is released however kb_nano was stopped.
        proc = subprocess.Popen(cmd, cwd=root, env=env, process_group=0, preexec_fn=on_parent_death(signal.SIGINT))
        # (SIGINT to the group whatever kb_nano got: Snakemake and the judges stop cleanly on
        # SIGINT only; the SignalInterrupt raised here names the signal kb_nano got.)
        with interrupts((signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                stop_group(proc, signal.SIGINT, 60, signal.SIGTERM)
                raise
        if code == 130:  # Snakemake alone was interrupted (kb_nano.snakemake_main)
            raise SignalInterrupt(signal.SIGINT)
        return code


def workflow_failed(root: Path, code: int, tier: str) -> int:
    """Say that Snakemake failed, where the rows already written are kept and, when the
    directory is locked, how to unlock it; returns ``code``."""
    print(
        f"error: the Snakemake workflow failed (exit {code}); rows already written are kept under "
        f"{root / 'results' / tier}; see the messages above",
        file=sys.stderr,
    )
    if any((root / ".snakemake/locks").glob("*")):
        command = {"kernels": "kernels", "e2e": "e2e latency", "eval": "eval"}[tier]
        print(
            "hint: the directory is locked; if no other kb_nano/snakemake run is active, "
            f"run `kb_nano {command} -- --unlock`",
            file=sys.stderr,
        )
    return code


# where each command's finished work lies after a Ctrl-C (commands that write none say only
# "interrupted"), and the merged file built from it: a merge the Ctrl-C stopped loses its
# output (Snakemake deletes a killed job's outputs), which the next run rebuilds
INTERRUPT_KEEPS = {
    "kernels": ("results/kernels/", "results/kernels.parquet"),
    "capture-golden": ("results/golden/", None),
    "e2e": ("results/e2e/", "results/e2e.parquet"),
    "eval": ("results/eval/", "results/eval.parquet"),
}


def interrupt_line(command: str, exc: KeyboardInterrupt) -> str:
    """The last line of a run of ``command`` that ``exc`` interrupted: the signal a
    :class:`~kb_nano.interrupts.SignalInterrupt` names, where the finished shards are
    kept, and that a merged file an interrupted merge deleted is rebuilt from them by the
    next run."""
    how = f" ({exc.signum.name})" if isinstance(exc, SignalInterrupt) else ""
    kept, merged = INTERRUPT_KEEPS.get(command, (None, None))
    line = f"interrupted{how}" + (f"; finished shards are kept under {kept}" if kept else "")
    if merged:
        line += f"; {merged}, if its merge was stopped, is rebuilt from them on the next run"
    return line


PER_JOB_FILES = {"kernels": "shards", "e2e": "vLLM's JSON per job", "eval": "vLLM's JSON per job"}


def run_tier(
    root: Path, tier: str, output_json: str, targets: list[str], config: dict, args, passthrough: list[str], show
) -> int:
    """One tier's command after its preflight: run the workflow for ``targets`` (with the
    config override ``config``), the tier's merged JSON ``output_json`` and its log rule's
    marker, then, unless Snakemake failed or ran no job (``-n``, ``-- --unlock``, ...:
    :func:`snakemake_action`), call ``show(doc)`` with the merged results document
    (``{"rows", "summary", ...}``, read from the file the merge rule wrote) and say which
    MLflow run holds it (:func:`kb_nano.tracking.marker.print_mlflow_record`). Returns
    the exit status: Snakemake's when it failed (:func:`workflow_failed`), else ``show``'s
    (None counts as 0)."""
    from kb_nano.tracking.marker import print_mlflow_record, read_marker
    from kb_nano.tracking.store import marker_path

    marker = marker_path(tier)
    before = read_marker(root, marker)
    code = run_snakemake(root, [*targets, output_json, marker], config, args, passthrough)
    if code != 0:
        return workflow_failed(root, code, tier)
    if args.dry_run or snakemake_action(passthrough):
        return 0  # Snakemake ran no job: no results table
    code = show(json.loads((root / output_json).read_text())) or 0
    results = root / "results"
    print(
        f"results: {results / (tier + '.parquet')}, {root / output_json}; {PER_JOB_FILES[tier]} under {results / tier}"
    )
    print_mlflow_record(root, marker, before)
    return code
