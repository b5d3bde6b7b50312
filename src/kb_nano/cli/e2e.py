"""``kb_nano e2e`` and ``kb_nano eval``: Tiers 2 and 3."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kb_nano import gpus
from kb_nano.cli import flags
from kb_nano.cli.config import base_config, preflight
from kb_nano.cli.snakemake import print_mlflow_record, read_marker, run_snakemake, snakemake_action, workflow_failed
from kb_nano.config import DEFAULT_CONFIG
from kb_nano.errors import KbNanoError
from kb_nano.paths import find_workflow_root


def _user_paths(models: list[str], root: Path) -> list[str]:
    """``--model`` values: a path on the command line is the user's (relative to their
    directory), made absolute; keys, Hub ids and workflow-relative paths stay as given."""
    return [str(Path(m).resolve()) if Path(m).exists() and not (root / m).exists() else m for m in models]


def _e2e_overrides(args, root: Path, base: dict) -> dict:
    """The ``e2e`` config section of one ``kb_nano e2e {kind}`` invocation: the configured
    section with the flags applied and one workload built from the flags (defaults: the
    first configured workload of that kind). Raises ``KbNanoError`` (one line)."""
    from kb_nano.e2e import plan as e2e_plan
    from kb_nano.e2e import workloads

    e2e = {**base["e2e"], **flags.given(args, flags.E2E)}
    if args.model:
        e2e["models"] = _user_paths(args.model, root)
    e2e["baseline_only"] = bool(args.baseline)
    configured = [workloads.from_dict(w, where="e2e.workloads") for w in e2e["workloads"]]
    default = next((w for w in configured if w.kind == args.kind), None)
    fields = flags.given(args, flags.workload_flags(args.kind))
    e2e["workloads"] = [workloads.Workload.params(workloads.from_flags(args.kind, default, **fields))]
    config = {**base, "e2e": e2e}
    device = e2e_plan.e2e_device(config)
    for spec in e2e["models"]:
        e2e_plan.model(spec, root, e2e["load_format"])
    e2e_plan.variants(root, config, device)
    if not e2e["candidates"] and not e2e["baseline_only"]:
        chosen = e2e_plan.candidate_set(root, [], device, e2e["models"])
        print(e2e_plan.describe_choice(root, device, chosen, e2e["models"]) + ("" if chosen else "; the baseline only"))
    return e2e


def cmd_e2e(args, passthrough: list[str]) -> int:
    """``kb_nano e2e throughput|latency|serve``: vLLM's own benchmark for the baseline and the
    candidate variant, alternately ``pairs`` times in one job per model × TP × workload,
    merged (the ratio with its 95% rerun interval), logged to MLflow, printed."""
    from kb_nano.e2e.vllm_cli import vllm_version
    from kb_nano.tracking import marker_path

    if vllm_version() is None:
        raise KbNanoError(
            "vLLM is not installed; on a CPU: pip install -e '.[e2e]' and then "
            "pip uninstall -y torchvision torchaudio torchcodec (see docs/e2e.md)"
        )
    root = find_workflow_root()
    base = base_config(root, args.configfile)
    e2e = _e2e_overrides(args, root, base)
    preflight(root, base, {"e2e": e2e}, args.configfile or str(DEFAULT_CONFIG), dry_run=args.dry_run, tier="e2e")
    output_json = e2e["output_json"]
    marker = marker_path("e2e")
    marker_before = read_marker(root, marker)
    code = run_snakemake(root, ["results/e2e.parquet", output_json, marker], {"e2e": e2e}, args, passthrough)
    if code != 0:
        return workflow_failed(root, code, "e2e")
    if args.dry_run or snakemake_action(passthrough):
        return 0
    from kb_nano.e2e.table import print_e2e

    doc = json.loads((root / output_json).read_text())
    print_e2e(doc["rows"])
    print(
        f"results: {root / 'results/e2e.parquet'}, {root / output_json}; vLLM's JSON per job under "
        f"{root / 'results/e2e'}"
    )
    print_mlflow_record(root, marker, marker_before)
    return 0


def cmd_eval(args, passthrough: list[str]) -> int:
    """``kb_nano eval``: the standardized Tier-3 sweep (fixed workloads x model x TP x
    {baseline, candidates}, kb_nano.eval.plan) through Snakemake; prints the per-workload
    candidate/baseline ratios with their spread."""
    from kb_nano.e2e import plan as e2e_plan
    from kb_nano.e2e.vllm_cli import vllm_version
    from kb_nano.eval import plan as eval_plan
    from kb_nano.tracking import marker_path

    root = find_workflow_root()
    base = base_config(root, args.configfile)
    ev = {**base["eval"], **flags.given(args, flags.EVAL)}
    if args.model:
        ev["models"] = _user_paths(args.model, root)
    if args.gpu_pool is None and not args.dry_run and ev["device"] != "cpu":
        visible = len(gpus.pool())
        if visible:  # the configured pool (default 8), capped by the GPUs this host has
            ev["gpu_pool"] = min(int(ev["gpu_pool"]), visible)
    # one-line errors before Snakemake starts: the schema first (tp >= 1, ...), then the plan
    preflight(root, base, {"eval": ev}, args.configfile or str(DEFAULT_CONFIG), dry_run=args.dry_run, tier="eval")
    plan = eval_plan.plan(root, {**base, "eval": ev})
    if not args.dry_run and vllm_version() is None:
        raise KbNanoError(
            "vLLM is not installed; on a CPU: pip install -e '.[e2e]' and then "
            "pip uninstall -y torchvision torchaudio torchcodec (see docs/e2e.md)"
        )
    for key, tp, why in plan["skipped"]:
        print(f"skip {key} tp={tp}: {why}", file=sys.stderr)
    if not ev["candidates"]:
        print(e2e_plan.describe_choice(root, plan["device"], plan["candidates"], plan["model_specs"]))
    # On GPUs the pool bounds concurrency (--resources gpu=N) and the ids jobs lease
    # (run_snakemake); a dry run only plans, so it needs no GPU of that count here.
    args.gpu_pool = int(ev["gpu_pool"]) if plan["device"] == "cuda" and not args.dry_run else None
    if plan["device"] == "cuda" and args.dry_run and "--resources" not in passthrough:
        passthrough = [*passthrough, "--resources", f"gpu={ev['gpu_pool']}"]
    marker = marker_path("eval")
    marker_before = read_marker(root, marker)
    code = run_snakemake(root, ["results/eval.parquet", ev["output_json"], marker], {"eval": ev}, args, passthrough)
    if code != 0:
        return workflow_failed(root, code, "eval")
    if args.dry_run or snakemake_action(passthrough):
        return 0
    from kb_nano.eval.table import print_eval

    doc = json.loads((root / ev["output_json"]).read_text())
    print_eval(doc)
    print(f"results: {root / 'results/eval.parquet'}, {root / ev['output_json']}")
    print_mlflow_record(root, marker, marker_before)
    return 0
