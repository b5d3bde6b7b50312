"""The jobs of a planned Tier-2 or Tier-3 run, as the ``e2e_bench`` rule takes them
(workflow/rules/e2e.smk): the shard paths, each job's input files, params and GPUs.

A plan is :func:`kb_nano.e2e.plan.plan` (tier ``e2e``) or :func:`kb_nano.eval.plan.plan`
(tier ``eval``); both have the keys read here. Torch-free (Snakefile parse time); raises
``KbNanoError`` for a path whose model or workload the plan does not hold.
"""

from __future__ import annotations

from pathlib import Path

from kb_nano.e2e.plan import job_variants, variant_candidates
from kb_nano.errors import KbNanoError, did_you_mean
from kb_nano.paths import PACKAGE_DIR

# The package modules a job runs (kb_nano.e2e.job and what it imports at run time), relative
# to the package: inputs of every job, so editing one reruns the jobs.
HARNESS_MODULES = (
    "e2e/commands.py",
    "e2e/job.py",
    "e2e/vllm_plugin.py",
    "e2e/vllm_cli.py",
    "e2e/workloads.py",
    "e2e/schema.py",
    "candidates.py",
    "rows.py",
)


def harness_files() -> list[str]:
    """The absolute paths of :data:`HARNESS_MODULES` in the installed package."""
    return [str(PACKAGE_DIR / f) for f in HARNESS_MODULES]


def shard_paths(tier: str, plan: dict) -> list[str]:
    """Every job's shard, ``results/{tier}/{model}/tp{tp}/{workload}/{variant}.parquet``
    (rule ``e2e_bench``'s output): per model, each of its TPs (``plan['tps']``) x workload x
    the job variants (:func:`kb_nano.e2e.plan.job_variants`)."""
    return [
        f"results/{tier}/{m}/tp{tp}/{w}/{v}.parquet"
        for m in plan["models"]
        for tp in plan["tps"][m]
        for w in plan["workloads"]
        for v in job_variants(plan["variants"])
    ]


def _planned(plan: dict, tier: str, field: str, name: str):
    """``plan[field][name]``; raises ``KbNanoError`` naming the config field when the
    plan has no such model or workload (a shard path asked for by hand)."""
    held = plan[field]
    if name not in held:
        raise KbNanoError(
            f"{tier}.{field}: {name!r} is not planned{did_you_mean(name, held)}; "
            f"planned: {', '.join(held) or 'none'} (add it to {tier}.{field} or ask for one of those)"
        )
    return held[name]


def job_inputs(plan: dict, tier: str, model_key: str, variant: str, root: Path) -> dict:
    """The input files of a job: ``candidates`` (the variant's files, relative to ``root``),
    ``model_config`` (the model's config.json) and ``harness`` (:func:`harness_files`).
    Raises ``KbNanoError`` for a model the plan does not hold or a variant naming a
    candidate without a file."""
    m = _planned(plan, tier, "models", model_key)
    return {
        "candidates": [str(c.path) for c in variant_candidates(variant, root)],
        "model_config": str(m.path / "config.json"),
        "harness": harness_files(),
    }


def job_params(plan: dict, tier: str, model_key: str, workload: str, variant: str, root: Path) -> dict:
    """The ``job`` param of rule ``e2e_bench`` (what workflow/scripts/e2e_bench.py passes to
    :func:`kb_nano.e2e.job.run`): ``model`` (key, hub_id, path, tokenizer, load_format,
    weights), ``workload`` (its params), ``candidates`` (``[{"id", "path"}]``, absolute
    paths), ``engine`` and ``pairs`` from the plan. Raises ``KbNanoError`` for a model or
    workload the plan does not hold or a variant naming a candidate without a file."""
    m = _planned(plan, tier, "models", model_key)
    w = _planned(plan, tier, "workloads", workload)
    return {
        "model": {
            "key": m.key,
            "hub_id": m.hub_id,
            "path": str(m.path),
            "tokenizer": str(m.tokenizer),
            "load_format": m.load_format,
            "weights": m.weights,
        },
        "workload": w.params(),
        "candidates": [{"id": c.id, "path": str((root / c.path).resolve())} for c in variant_candidates(variant, root)],
        "engine": plan["engine"],
        "pairs": plan["pairs"],
    }


def job_gpus(plan: dict, tp: int) -> int:
    """The GPUs a job holds (Snakemake resource ``gpu``): none on a CPU, else one per TP rank."""
    return 0 if plan["device"] == "cpu" else int(tp)
