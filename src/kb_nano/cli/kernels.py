"""``kb_nano kernels``, ``generate-inputs`` and ``capture-golden``: Tier 1 and its inputs."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

from kb_nano import operators
from kb_nano import workflow as kbw
from kb_nano.cli.config import base_config, config_overrides, preflight, select_models
from kb_nano.cli.snakemake import print_mlflow_record, read_marker, run_snakemake, snakemake_action, workflow_failed
from kb_nano.config import DEFAULT_CONFIG
from kb_nano.errors import KbNanoError
from kb_nano.files import check_dirs
from kb_nano.paths import find_workflow_root


def cmd_list(args, root: Path, base: dict) -> int:
    """``kernels --list [--level N] [--model M] [--tp T]``: the operator registry with each
    candidate contract and the baseline's state_dict shapes for the first configured (or
    ``--model``/``--tp``) model and TP it applies to
    (:func:`kb_nano.operators.listing.operator_table`), fitted to the console's width."""
    from kb_nano.console import make_console
    from kb_nano.operators.listing import ModelExamples, operator_table

    specs = select_models(args.model, base["models"], root) if args.model else base["models"]
    examples = ModelExamples(root, specs, args.tp or base["tp"])
    console = make_console()
    title = "kb-nano operators" + (f" (level {args.level})" if args.level else "")
    table, count = operator_table(examples, args.level, console.width, title)
    console.print(table)
    if count:
        console.print(
            "a candidate (candidates/<target>/<name>.py) is one nn.Module taking the constructor's arguments and "
            "forward's inputs above, with the baseline's state_dict keys and shapes (docs/kernels.md#candidates)"
        )
    else:
        console.print(
            f"no operators at level {args.level} yet (levels present: "
            f"{', '.join(sorted({f'L{e.level}' for e in operators.CATALOG.values()}))})"
        )
    return 0


def cmd_map(args, root: Path, base: dict) -> int:
    """``kernels --map``: each configured (or ``--model``) model's operators with their
    per-rank input shapes at each ``--tp`` (:func:`kb_nano.operators.listing.map_tables`)."""
    from kb_nano.console import make_console
    from kb_nano.operators.listing import ModelExamples, map_tables

    specs = select_models(args.model, base["models"], root) if args.model else base["models"]
    console = make_console()
    for table in map_tables(ModelExamples(root, specs, args.tp or base["tp"])):
        console.print(table)
    return 0


def cmd_kernels(args, passthrough: list[str]) -> int:
    """``kb_nano kernels``: run the Tier-1 DAG and print the merged table (not after a
    Snakemake action that runs no job, e.g. ``-- --unlock``: :func:`snakemake_action`)."""
    root = find_workflow_root()
    if args.level and not args.list:
        raise KbNanoError("--level only filters --list; to run one level use --target or --category")
    base = base_config(root, args.configfile)
    if args.list:
        return cmd_list(args, root, base)
    config = config_overrides(args, root, base)
    effective = preflight(root, base, config, args.configfile or str(DEFAULT_CONFIG), dry_run=args.dry_run)
    check_dirs(root, kbw.kernel_job_dirs(kbw.candidates(root, effective), effective))
    ignored = kbw.cpu_ignored(root, effective)
    if ignored:
        print(
            f"note: {', '.join(ignored)} change nothing on a CPU run (a CPU has the eager timer only; rows "
            "say speedup_basis=eager)",
            file=sys.stderr,
        )
    if args.map:
        return cmd_map(args, root, base)
    output_json = effective["output_json"]
    from kb_nano.tracking import marker_path

    versus = getattr(args, "versus", None)
    if versus and not (root / "candidates" / f"{versus}.py").is_file():  # before the sweep, not after it
        print(f"error: --versus {versus}: no candidate file candidates/{versus}.py", file=sys.stderr)
        return 2
    started_at = datetime.now(UTC).isoformat(timespec="seconds")  # rows created since: measured by this run
    marker = marker_path("kernels")
    marker_before = read_marker(root, marker)
    start_manifest(root, effective)
    # kernels_measured: every selected shard, so a deleted one is measured again
    targets = ["results/kernels.parquet", output_json, marker, "kernels_measured"]
    code = run_snakemake(root, targets, config, args, passthrough)
    if code != 0:
        return workflow_failed(root, code, "kernels")
    if args.dry_run or snakemake_action(passthrough):
        return 0  # Snakemake ran no job (-n, --unlock, --list-rules, ...): no results table
    doc = json.loads((root / output_json).read_text())
    if getattr(args, "by_scenario", False) or getattr(args, "versus", None):
        from kb_nano.kernels.providers import print_providers

        try:
            print_providers(doc["rows"], getattr(args, "versus", None))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        from kb_nano.kernels.table import measured_since, print_kernels

        shown = None if args.all_rows else measured_since(doc["rows"], started_at)
        print_kernels(doc["rows"], doc["summary"], shown=shown)
    print(f"results: {root / 'results/kernels.parquet'}, {root / output_json}")
    failed = [r for r in doc["rows"] if r["status"] not in ("passed", "skipped")]
    print_mlflow_record(root, marker, marker_before)
    if args.fail_on_error and failed:
        print(f"error: {len(failed)} row(s) neither passed nor skipped (--fail-on-error)", file=sys.stderr)
        return 1
    return 0


def start_manifest(root: Path, effective: dict) -> None:
    """Bring the selection's manifest up to date in a background thread of this process
    (:func:`kb_nano.workflow.manifest`) while Snakemake starts: generating one imports torch
    and transformers (seconds), which then overlaps Snakemake's own start-up; the
    Snakefile's parse waits for the file under the manifest's lock and reads it. A
    failure here is left to that parse, which reports it."""

    from kb_nano.kernels.manifest import written_note

    def run() -> None:
        with contextlib.suppress(Exception):
            path = kbw.manifest_path(effective)
            data, how = kbw.manifest(root, effective, Path(path))
            if how is not None and threading.main_thread().is_alive():  # (not after an interrupt ended kb_nano)
                print(written_note(path, data, how), file=sys.stderr)

    threading.Thread(target=run, name="kb_nano-manifest", daemon=True).start()


def cmd_generate_inputs(args, passthrough: list[str]) -> int:
    """``kb_nano generate-inputs``: write the selection's manifest
    (``results/inputs/llm-<selection>.yaml``, :func:`kb_nano.workflow.manifest_path`) and
    summarise it."""
    root = find_workflow_root()
    base = base_config(root, args.configfile)
    config = config_overrides(args, root, base)
    effective = preflight(root, base, config, args.configfile or str(DEFAULT_CONFIG), dry_run=True)
    # The Snakefile computes the manifest while parsing (workflow/rules/inputs.smk): a quiet
    # dry run of the kernel sweep parses it and builds nothing.
    args.dry_run, dry_run = True, args.dry_run
    code = run_snakemake(root, ["results/kernels.parquet"], config, args, [*passthrough, "--quiet", "all"])
    args.dry_run = dry_run
    if code != 0 or args.dry_run:
        return code
    from kb_nano.kernels.manifest import load

    path = root / kbw.manifest_path(effective)
    manifest = load(path)
    scenarios = manifest["scenarios"]
    na = [s for s in scenarios if not s["applicable"]]
    print(f"{path}: {len(scenarios)} scenarios for {', '.join(manifest['models'])}; {len(na)} not applicable")
    for s in na:
        print(f"  n/a {s['scenario_id']}: {s['reason']}")
    return 0


def cmd_capture_golden(args, passthrough: list[str]) -> int:
    """``kb_nano capture-golden``: build ``results/golden/{model}`` for each model (the
    ``capture_golden`` rule) and summarise the files
    (:func:`kb_nano.models.golden_summary.summary_lines`)."""
    from kb_nano.models.configs import resolve
    from kb_nano.models.golden import GOLDEN_DIR
    from kb_nano.workflow import golden_settings

    root = find_workflow_root()
    base = base_config(root, args.configfile)
    models = select_models(args.model, base["models"], root)
    keys = [resolve(m, root).key for m in models]
    golden = golden_settings(base)
    if args.num_layers is not None:
        if args.num_layers < 0:
            raise KbNanoError("--num-layers: must be >= 0 (0 = all layers of the config)")
        golden["num_layers"] = args.num_layers
    if args.weights:
        if len(keys) != 1:
            raise KbNanoError(f"--weights: give exactly one --model with it (got {', '.join(keys)})")
        weights = Path(args.weights).resolve()
        if not weights.is_dir() or not any(weights.glob("*.safetensors")) and not any(weights.glob("*.bin")):
            raise KbNanoError(f"--weights {args.weights}: not a directory with *.safetensors or *.bin weight files")
        golden["weights"][keys[0]] = str(weights)
    config = {"models": models, "golden": golden}
    preflight(root, base, config, args.configfile or str(DEFAULT_CONFIG))
    passthrough = [*passthrough, "--forcerun", "capture_golden"] if args.force else passthrough
    code = run_snakemake(root, [str(GOLDEN_DIR / k) for k in keys], config, args, passthrough)
    if code != 0:  # (the rule's one-line error is on stderr above: workflow/scripts/capture_golden.py)
        print(f"error: the Snakemake workflow failed (exit {code}); see the messages above", file=sys.stderr)
        return code
    if args.dry_run or snakemake_action(passthrough):
        return 0
    from kb_nano.models.golden_summary import summary_lines

    print("\n".join(summary_lines(root, keys)))
    return 0
