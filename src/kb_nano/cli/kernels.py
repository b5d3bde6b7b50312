"""``kb_nano kernels``, ``generate-inputs`` and ``capture-golden``: Tier 1 and its inputs."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

from kb_nano import workflow as kbw
from kb_nano.cli.config import config_overrides, preflight, select_models
from kb_nano.config import load
from kb_nano.errors import KbNanoError
from kb_nano.files import check_dirs
from kb_nano.launch import run_snakemake, run_tier, snakemake_action
from kb_nano.paths import find_workflow_root


def cmd_list_or_map(args, root: Path, base: dict, specs: list[str] | None = None) -> int:
    """``kernels --list [--level N]``: the operator registry with each candidate contract
    and the baseline's state_dict shapes (:func:`kb_nano.operators.listing.operator_table`);
    ``kernels --map``: each model's operators with their per-rank input shapes at each TP
    (:func:`kb_nano.operators.listing.map_tables`). For the configured models and TPs, or
    ``--model``/``--tp`` (``specs``: the models ``--model`` already selected); fitted to
    the console's width."""
    from kb_nano.console import make_console
    from kb_nano.operators.listing import ModelExamples, list_lines, map_tables, operator_table

    if specs is None:
        specs = select_models(args.model, base["models"], root) if args.model else base["models"]
    examples = ModelExamples(root, specs, args.tp or base["tp"])
    console = make_console()
    if args.map:
        for table in map_tables(examples):
            console.print(table)
        return 0
    title = "kb-nano operators" + (f" (level {args.level})" if args.level else "")
    table, count = operator_table(examples, args.level, console.width, title)
    console.print(table)
    console.print(list_lines(count, args.level))
    return 0


def cmd_kernels(args, passthrough: list[str]) -> int:
    """``kb_nano kernels``: run the Tier-1 DAG and print the merged table: the rows this
    run measured (every row with ``--all-rows``), or providers side by side
    (``--by-scenario``/``--versus``)."""
    root = find_workflow_root()
    if args.level and not args.list:
        raise KbNanoError("--level only filters --list; to run one level use --target or --category")
    base = load(root, args.configfile)
    if args.list:
        return cmd_list_or_map(args, root, base)
    config = config_overrides(args, root, base)
    effective = preflight(root, base, config, args.configfile, dry_run=args.dry_run)
    chosen = kbw.candidates(root, effective)
    for want in effective["candidates"]:  # a prefix: say what it chose (as --model does)
        hits = [c.id for c in chosen if c.id.startswith(want)]
        if want not in hits:
            print(f"note: --candidate {want} selects {', '.join(hits)} (id prefix)", file=sys.stderr)
    check_dirs(root, kbw.kernel_job_dirs(chosen, effective))
    ignored = kbw.cpu_ignored(root, effective)
    if ignored:
        print(
            f"note: {', '.join(ignored)} change nothing on a CPU run (a CPU has the eager timer only; rows "
            "say speedup_basis=eager)",
            file=sys.stderr,
        )
    if args.map:
        return cmd_list_or_map(args, root, base, effective["models"])
    if args.versus and not (root / "candidates" / f"{args.versus}.py").is_file():  # before the sweep, not after it
        from kb_nano.candidates import discover
        from kb_nano.errors import did_you_mean

        ids = [c.id for c in discover(root)]
        raise KbNanoError(
            f"--versus {args.versus}: no candidate file candidates/{args.versus}.py{did_you_mean(args.versus, ids)}"
        )
    started_at = datetime.now(UTC).isoformat(timespec="seconds")  # rows created since: measured by this run
    kbw.start_manifest(root, effective)

    def show(doc: dict) -> int:
        from kb_nano.kernels.providers import print_providers
        from kb_nano.kernels.table import load_warning, measured_since, print_kernels

        if args.by_scenario or args.versus:
            try:
                print_providers(doc["rows"], args.versus)
            except ValueError as exc:  # (a --versus candidate without rows in this selection)
                raise KbNanoError(str(exc)) from None
        else:
            print_kernels(
                doc["rows"], doc["summary"], shown=None if args.all_rows else measured_since(doc["rows"], started_at)
            )
        loaded = load_warning(doc["rows"])
        if loaded:
            print(loaded, file=sys.stderr)
        failed = [r for r in doc["rows"] if r["status"] not in ("passed", "skipped")]
        if args.fail_on_error and failed:
            print(f"error: {len(failed)} row(s) neither passed nor skipped (--fail-on-error)", file=sys.stderr)
            return 1
        return 0

    # kernels_measured: every selected shard, so a deleted one is measured again
    targets = ["results/kernels.parquet", "kernels_measured"]
    return run_tier(root, "kernels", effective["output_json"], targets, config, args, passthrough, show)


def cmd_generate_inputs(args, passthrough: list[str]) -> int:
    """``kb_nano generate-inputs``: write the selection's manifest
    (``results/inputs/llm-<selection>.yaml``, :func:`kb_nano.workflow.manifest_path`) and
    summarise it (:func:`kb_nano.kernels.manifest.summary_lines`)."""
    from kb_nano.kernels.manifest import summary_lines

    root = find_workflow_root()
    base = load(root, args.configfile)
    config = config_overrides(args, root, base)
    effective = preflight(root, base, config, args.configfile, dry_run=True)
    # The Snakefile computes the manifest while parsing (workflow/rules/inputs.smk): a quiet
    # dry run of the kernel sweep parses it and builds nothing.
    args.dry_run, dry_run = True, args.dry_run
    code = run_snakemake(
        root, ["results/kernels.parquet"], config, args, [*passthrough, "--quiet", "all", "host", "rules"]
    )
    if code == 0 and not dry_run:
        print("\n".join(summary_lines(root / kbw.manifest_path(effective))))
    return code


def cmd_capture_golden(args, passthrough: list[str]) -> int:
    """``kb_nano capture-golden``: build ``results/golden/{model}`` for each model (the
    ``capture_golden`` rule) and summarise the files
    (:func:`kb_nano.models.golden_summary.summary_lines`)."""
    from kb_nano.models.configs import resolve
    from kb_nano.models.golden import GOLDEN_DIR
    from kb_nano.models.golden_summary import summary_lines

    root = find_workflow_root()
    base = load(root, args.configfile)
    models = select_models(args.model, base["models"], root)
    keys = [resolve(m, root).key for m in models]
    if args.weights and len(keys) != 1:
        raise KbNanoError(f"--weights: give exactly one --model with it (got {', '.join(keys)})")
    golden = kbw.golden_settings(base, args.num_layers, (keys[0], args.weights) if args.weights else None)
    config = {"models": models, "golden": golden}
    preflight(root, base, config, args.configfile)
    passthrough = [*passthrough, "--forcerun", "capture_golden"] if args.force else passthrough
    code = run_snakemake(root, [str(GOLDEN_DIR / k) for k in keys], config, args, passthrough)
    if code != 0:  # (the rule's one-line error is on stderr above: workflow/scripts/capture_golden.py)
        print(f"error: the Snakemake workflow failed (exit {code}); see the messages above", file=sys.stderr)
        return code
    if not (args.dry_run or snakemake_action(passthrough)):
        print("\n".join(summary_lines(root, keys)))
    return 0
