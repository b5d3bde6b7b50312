# Plots of the merged results and the single MLflow writer (docs/architecture.md, "Tracking").
# The tier is a parameter of both scripts, so e2e/eval tiers reuse them.
from kb_nano.tracking import marker_path, resolve_tracking_uri

try:
    TRACKING_URI = resolve_tracking_uri(Path(".").resolve(), config)
except KbNanoError as exc:
    raise WorkflowError(f"kb-nano: {exc}") from None


report: "../report/workflow.rst"


rule plot_kernels:
    input:
        parquet="results/kernels.parquet",
        code=[
            str(kbw.PACKAGE_DIR / f"tracking/{m}.py")
            for m in ("plots", "speedup_plots", "perf_plots", "plot_style")
        ],
    output:
        speedup=report(
            "results/plots/kernels_speedup.png",
            caption="../report/kernels_speedup.rst",
            category="Kernels",
            labels={"figure": "speedup per scenario"},
        ),
        bandwidth=report(
            "results/plots/kernels_bandwidth.png",
            caption="../report/kernels_bandwidth.rst",
            category="Kernels",
            labels={"figure": "achieved bandwidth / FLOP rate"},
        ),
        perf_time=report(
            "results/plots/kernels_perf_time.png",
            caption="../report/kernels_perf_time.rst",
            category="Kernels",
            labels={"figure": "time per call vs num_tokens"},
        ),
        perf_gbs=report(
            "results/plots/kernels_perf_gbs.png",
            caption="../report/kernels_perf_gbs.rst",
            category="Kernels",
            labels={"figure": "GB/s vs num_tokens"},
        ),
    log:
        "results/logs/plot_kernels.log",
    localrule: True
    conda:
        ENV
    params:
        tier="kernels",
    script:
        "../scripts/plot_kernels.py"


rule table_kernels:
    input:
        parquet="results/kernels.parquet",
        code=[
            str(kbw.PACKAGE_DIR / f"tracking/{m}.py")
            for m in ("report_table", "plot_style")
        ],
    output:
        report(
            "results/kernels_table.html",
            caption="../report/kernels_table.rst",
            category="Kernels",
            labels={"figure": "merged results table"},
        ),
    log:
        "results/logs/table_kernels.log",
    localrule: True
    conda:
        ENV
    script:
        "../scripts/table_kernels.py"


rule log_mlflow_kernels:
    input:
        parquet="results/kernels.parquet",
        json=config["output_json"],
        manifest=MANIFEST,
        plots=rules.plot_kernels.output,
        table=rules.table_kernels.output,
        code=sorted(str(p) for p in (kbw.PACKAGE_DIR / "tracking").glob("*.py")),
    output:
        marker_path("kernels"),
    log:
        "results/logs/log_mlflow_kernels.log",
    localrule: True
    conda:
        ENV
    params:
        tier="kernels",
        manifest_digest=MANIFEST_DATA["inputs_digest"],
        tracking_uri=TRACKING_URI,
        config={k: v for k, v in config.items() if k != "mlflow_tracking_uri"},
    script:
        "../scripts/log_mlflow.py"
