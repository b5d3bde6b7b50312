"""``kb_nano e2e`` and ``kb_nano eval``: Tiers 2 and 3 (planned by :mod:`kb_nano.e2e.plan`
and :mod:`kb_nano.eval.plan`, run by the workflow, printed from the merged files)."""

from __future__ import annotations

import sys

from kb_nano import gpus
from kb_nano.cli import flags
from kb_nano.cli.config import preflight, user_paths
from kb_nano.config import load
from kb_nano.errors import KbNanoError
from kb_nano.launch import run_tier
from kb_nano.paths import find_workflow_root

NO_VLLM = (
    "vLLM is not installed; on a CPU: pip install -e '.[e2e]' and then "
    "pip uninstall -y torchvision torchaudio torchcodec (see docs/e2e.md)"
)


def cmd_e2e(args, passthrough: list[str]) -> int:
    """``kb_nano e2e throughput|latency|serve``: vLLM's own benchmark for the baseline and the
    candidate variant, alternately ``pairs`` times in one job per model × TP × workload,
    merged (the ratio with its 95% rerun interval), logged to MLflow, printed."""
    from kb_nano.e2e import plan as e2e_plan
    from kb_nano.e2e.table import print_e2e
    from kb_nano.e2e.vllm_cli import vllm_version

    if vllm_version() is None:
        raise KbNanoError(NO_VLLM)
    root = find_workflow_root()
    base = load(root, args.configfile)
    section = flags.given(args, flags.E2E)
    if args.model:
        section["models"] = user_paths(args.model, root)
    fields = flags.given(args, flags.workload_flags(args.kind))
    e2e = e2e_plan.invocation(root, base, args.kind, section, fields, bool(args.baseline))
    preflight(root, base, {"e2e": e2e}, args.configfile, dry_run=args.dry_run, tier="e2e")
    targets = ["results/e2e.parquet"]
    return run_tier(
        root, "e2e", e2e["output_json"], targets, {"e2e": e2e}, args, passthrough, lambda doc: print_e2e(doc["rows"])
    )


def cmd_eval(args, passthrough: list[str]) -> int:
    """``kb_nano eval``: the standardized Tier-3 sweep (fixed workloads x model x TP x
    {baseline, candidates}, :func:`kb_nano.eval.plan.plan`) through Snakemake; prints the
    per-workload candidate/baseline ratios with their spread. On GPUs the pool (at most the
    host's GPUs unless ``--gpu-pool`` says otherwise) bounds the concurrent jobs."""
    from kb_nano.e2e.plan import describe_choice
    from kb_nano.e2e.vllm_cli import vllm_version
    from kb_nano.eval import plan as eval_plan
    from kb_nano.eval.table import print_eval

    root = find_workflow_root()
    base = load(root, args.configfile)
    ev = {**base["eval"], **flags.given(args, flags.EVAL)}
    if args.model:
        ev["models"] = user_paths(args.model, root)
    if args.gpu_pool is None and not args.dry_run and ev["device"] != "cpu" and gpus.pool():
        ev["gpu_pool"] = min(int(ev["gpu_pool"]), len(gpus.pool()))
    preflight(root, base, {"eval": ev}, args.configfile, dry_run=args.dry_run, tier="eval")
    plan = eval_plan.plan(root, {**base, "eval": ev})
    if not args.dry_run and vllm_version() is None:
        raise KbNanoError(NO_VLLM)
    for key, tp, why in plan["skipped"]:
        print(f"skip {key} tp={tp}: {why}", file=sys.stderr)
    if not ev["candidates"]:
        print(describe_choice(root, plan["device"], plan["candidates"], plan["model_specs"]))
    # the pool bounds concurrency (--resources gpu=N) and the ids jobs lease; a dry run only plans
    args.gpu_pool = int(ev["gpu_pool"]) if plan["device"] == "cuda" and not args.dry_run else None
    if plan["device"] == "cuda" and args.dry_run and "--resources" not in passthrough:
        passthrough = [*passthrough, "--resources", f"gpu={ev['gpu_pool']}"]
    targets = ["results/eval.parquet"]
    return run_tier(root, "eval", ev["output_json"], targets, {"eval": ev}, args, passthrough, print_eval)
