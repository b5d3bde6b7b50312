# Tier 2: vLLM's own benchmarks with candidates swapped into the engine (kb_nano.e2e.job).
# Planned lazily (input functions), so a Tier-1 run never depends on the e2e section.
# Named target: `snakemake e2e` (what `kb_nano e2e ...` builds with a config override).
# Planned by kb_nano.e2e.plan (Tier 2) and kb_nano.eval.plan (Tier 3); each job's shard paths,
# inputs and params: kb_nano.e2e.tier_jobs, called by the input functions of common.smk.


# One job per model x TP x workload x variant of Tier 2 (tier "e2e") and of the Tier-3 eval
# sweep (tier "eval", workflow/rules/eval.smk): the same measurement, other workloads.
rule e2e_bench:
    input:
        unpack(e2e_job_inputs),
    output:
        shard="results/{tier}/{model}/tp{tp}/{workload}/{variant}.parquet",
        json="results/{tier}/{model}/tp{tp}/{workload}/{variant}.json",
    log:
        "results/logs/{tier}/{model}/tp{tp}/{workload}/{variant}.log",
    wildcard_constraints:
        tier="e2e|eval",
        model="[A-Za-z0-9_.-]+",
        tp="[0-9]+",
        workload="[A-Za-z0-9_.+-]+",
        variant="[A-Za-z0-9_.+-]+",
    conda:
        ENV_E2E
    # vLLM on a CPU uses every core: one e2e job at a time unless --cores is larger.
    threads: workflow.cores
    resources:
        gpu=e2e_gpus,
    params:
        job=e2e_params,
    script:
        "../scripts/e2e_bench.py"


rule merge_e2e:
    input:
        shards=lambda wildcards: tier_shards("e2e"),
    output:
        parquet="results/e2e.parquet",
        json=E2E_OUTPUT_JSON,
    log:
        "results/logs/merge_e2e.log",
    localrule: True
    conda:
        ENV
    params:
        tier="e2e",
        skipped=[],
    script:
        "../scripts/merge_e2e.py"


rule log_mlflow_e2e:
    input:
        parquet="results/e2e.parquet",
        json=E2E_OUTPUT_JSON,
        code=sorted(str(p) for p in (kbw.PACKAGE_DIR / "tracking").glob("*.py")),
    output:
        marker_path("e2e"),
    log:
        "results/logs/log_mlflow_e2e.log",
    localrule: True
    conda:
        ENV
    params:
        tier="e2e",
        tracking_uri=TRACKING_URI,
        config={k: v for k, v in config.items() if k != "mlflow_tracking_uri"},
    script:
        "../scripts/log_mlflow.py"


rule e2e:
    input:
        "results/e2e.parquet",
        E2E_OUTPUT_JSON,
        marker_path("e2e"),
        # every shard as a target: a deleted one is measured again (Snakemake does not
        # rebuild a missing input of an up-to-date merge)
        lambda wildcards: tier_shards("e2e"),
