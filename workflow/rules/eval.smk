# Tier 3: the standardized eval sweep (kb_nano.eval.plan): fixed workloads x model x TP x
# {baseline, candidates}, measured by the e2e_bench rule (tier "eval"), merged into
# results/eval.parquet + eval.json and logged to MLflow (kb_nano/eval).
# Named target: `snakemake eval` (what `kb_nano eval` builds with a config override).


rule merge_eval:
    input:
        shards=lambda wildcards: tier_shards("eval"),
    output:
        parquet="results/eval.parquet",
        json=EVAL_OUTPUT_JSON,
    log:
        "results/logs/merge_eval.log",
    localrule: True
    conda:
        ENV
    params:
        tier="eval",
        skipped=lambda wildcards: eval_skipped_rows(),
    script:
        "../scripts/merge_e2e.py"


rule log_mlflow_eval:
    input:
        parquet="results/eval.parquet",
        json=EVAL_OUTPUT_JSON,
        code=sorted(str(p) for p in (kbw.PACKAGE_DIR / "tracking").glob("*.py")),
    output:
        marker_path("eval"),
    log:
        "results/logs/log_mlflow_eval.log",
    localrule: True
    conda:
        ENV
    params:
        tier="eval",
        tracking_uri=TRACKING_URI,
        config={k: v for k, v in config.items() if k != "mlflow_tracking_uri"},
    script:
        "../scripts/log_mlflow.py"


rule eval:
    default_target: False
    input:
        "results/eval.parquet",
        EVAL_OUTPUT_JSON,
        marker_path("eval"),
        # every shard as a target: a deleted one is measured again (Snakemake does not
        # rebuild a missing input of an up-to-date merge)
        lambda wildcards: tier_shards("eval"),
    localrule: True
