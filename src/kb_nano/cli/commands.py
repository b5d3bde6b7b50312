"""The ``kb_nano`` commands: each turns its flags into a config override and Snakemake
targets (:mod:`kb_nano.overrides`), hands them to :mod:`kb_nano.launch`, and prints from
the merged files and what Snakemake reports; the planning, tables and servers come from
the tier packages."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from functools import partial

from kb_nano import flags, operators
from kb_nano import workflow as kbw
from kb_nano.config import load
from kb_nano.errors import KbNanoError
from kb_nano.launch import run_snakemake, run_tier, snakemake_action
from kb_nano.overrides import config_overrides, preflight, section, select_models
from kb_nano.paths import find_workflow_root


def _base(args):
    """The workflow root and the effective config with ``--configfile``."""
    root = find_workflow_root()
    return root, load(root, args.configfile)


def cmd_kernels(args, passthrough: list[str]) -> int:
    """``kb_nano kernels``: run Tier 1 and print the merged table (:mod:`kb_nano.kernels.show`),
    or ``--list``/``--map`` the operators (:func:`kb_nano.operators.listing.print_listing`)."""
    from kb_nano.kernels.show import check_versus, selection_notes, show_results
    from kb_nano.operators.listing import print_listing

    if args.level and not args.list:
        raise KbNanoError("--level only filters --list; to run one level use --target or --category")
    root, base = _base(args)
    if args.list:
        specs = select_models(args.model, base["models"], root) if args.model else base["models"]
        return print_listing(root, specs, args.tp or base["tp"], args.level)
    config = config_overrides(args, root, base)
    effective = preflight(root, base, config, args.configfile, dry_run=args.dry_run)
    selection_notes(root, effective)
    if args.map:
        return print_listing(root, effective["models"], args.tp or base["tp"], map_=True)
    check_versus(root, args.versus)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")  # rows created since: measured by this run
    kbw.start_manifest(root, effective)
    views = {k: getattr(args, k) for k in ("all_rows", "by_scenario", "versus", "fail_on_error")}
    # kernels_measured: every selected shard, so a deleted one is measured again
    targets = ["results/kernels.parquet", "kernels_measured"]
    show = partial(show_results, started_at=started_at, **views)
    return run_tier(root, "kernels", effective["output_json"], targets, config, args, passthrough, show)


def cmd_generate_inputs(args, passthrough: list[str]) -> int:
    """``kb_nano generate-inputs``: write the selection's manifest
    (:func:`kb_nano.workflow.manifest_path`) and summarise it."""
    from kb_nano.kernels.manifest import summary_lines

    root, base = _base(args)
    config = config_overrides(args, root, base)
    effective = preflight(root, base, config, args.configfile, dry_run=True)
    # The Snakefile computes the manifest while parsing (workflow/rules/inputs.smk): a quiet
    # dry run of the kernel sweep parses it and builds nothing.
    args.dry_run, dry_run = True, args.dry_run
    quiet = [*passthrough, "--quiet", "all", "host", "rules"]
    code = run_snakemake(root, ["results/kernels.parquet"], config, args, quiet)
    if code == 0 and not dry_run:
        print("\n".join(summary_lines(root / kbw.manifest_path(effective))))
    return code


def cmd_capture_golden(args, passthrough: list[str]) -> int:
    """``kb_nano capture-golden``: build ``results/golden/{model}`` for each model (the
    ``capture_golden`` rule) and summarise the files (:mod:`kb_nano.models.golden_summary`)."""
    from kb_nano.models.golden import GOLDEN_DIR
    from kb_nano.models.golden_summary import invocation, summary_lines

    root, base = _base(args)
    keys, config = invocation(root, base, args.model, args.weights, args.num_layers)
    preflight(root, base, config, args.configfile)
    passthrough = [*passthrough, "--forcerun", "capture_golden"] if args.force else passthrough
    code = run_snakemake(root, [str(GOLDEN_DIR / k) for k in keys], config, args, passthrough)
    if code != 0:  # (the rule's one-line error is on stderr above: workflow/scripts/capture_golden.py)
        print(f"error: the Snakemake workflow failed (exit {code}); see the messages above", file=sys.stderr)
        return code
    if not (args.dry_run or snakemake_action(passthrough)):
        print("\n".join(summary_lines(root, keys)))
    return 0


def cmd_e2e(args, passthrough: list[str]) -> int:
    """``kb_nano e2e throughput|latency|serve``: Tier 2, planned by
    :func:`kb_nano.e2e.plan.invocation`, printed by :func:`kb_nano.e2e.table.print_e2e`."""
    from kb_nano.e2e import plan as e2e_plan
    from kb_nano.e2e.installed import require_vllm
    from kb_nano.e2e.table import print_e2e

    require_vllm()
    root, base = _base(args)
    fields = flags.given(args, flags.workload_flags(args.kind))
    e2e = e2e_plan.invocation(root, base, args.kind, section(args, flags.E2E, root), fields, bool(args.baseline))
    preflight(root, base, {"e2e": e2e}, args.configfile, dry_run=args.dry_run, tier="e2e")
    show = lambda doc: print_e2e(doc["rows"])  # noqa: E731
    return run_tier(root, "e2e", e2e["output_json"], ["results/e2e.parquet"], {"e2e": e2e}, args, passthrough, show)


def cmd_eval(args, passthrough: list[str]) -> int:
    """``kb_nano eval``: Tier 3 (:mod:`kb_nano.eval.plan`, :mod:`kb_nano.eval.table`); on GPUs
    the pool (at most the host's GPUs unless ``--gpu-pool`` says otherwise) bounds its jobs."""
    from kb_nano.eval import plan as eval_plan
    from kb_nano.eval.table import print_eval

    root, base = _base(args)
    given = section(args, flags.EVAL, root)
    ev = eval_plan.invocation(base, given, dry_run=args.dry_run, pool_given=args.gpu_pool is not None)
    preflight(root, base, {"eval": ev}, args.configfile, dry_run=args.dry_run, tier="eval")
    cuda = eval_plan.announce(root, {**base, "eval": ev}, dry_run=args.dry_run)["device"] == "cuda"
    # the pool bounds concurrency (--resources gpu=N) and the ids jobs lease; a dry run only plans
    args.gpu_pool = int(ev["gpu_pool"]) if cuda and not args.dry_run else None
    if cuda and args.dry_run and "--resources" not in passthrough:
        passthrough = [*passthrough, "--resources", f"gpu={ev['gpu_pool']}"]
    return run_tier(
        root, "eval", ev["output_json"], ["results/eval.parquet"], {"eval": ev}, args, passthrough, print_eval
    )


def cmd_history(args, passthrough: list[str]) -> int:
    """``kb_nano history``: recorded runs, or ``--compare RUN_A RUN_B``
    (:func:`kb_nano.tracking.history_tables.print_history`)."""
    from kb_nano.tracking.history_tables import print_history
    from kb_nano.tracking.store import command_tracking_uri

    if passthrough:
        raise KbNanoError(f"history takes no arguments after -- (got {' '.join(passthrough)})")
    if args.target:
        operators.check_target(args.target, where="--target")
    filters = {k: getattr(args, k) for k in ("tier", "target", "candidate", "model", "limit")}
    return print_history(command_tracking_uri(args.configfile, args.tracking_uri), args.compare, **filters)


def cmd_mlflow_ui(args, passthrough: list[str]) -> int:
    """``kb_nano mlflow-ui``: serve the MLflow UI on the kb-nano store until Ctrl-C
    (:func:`kb_nano.tracking.ui.serve_ui`); arguments after ``--`` go to ``mlflow ui``."""
    from kb_nano.tracking.store import command_tracking_uri
    from kb_nano.tracking.ui import serve_ui

    uri = command_tracking_uri(args.configfile, args.tracking_uri)
    return serve_ui(uri, args.host, args.port, args.workers, args.start_timeout, passthrough)
