"""Snakemake adapter: one candidate × scenario -> one Parquet shard (see kb_nano.kernel_job)."""

import json
import os

from kb_nano.kernel_job import run

run(
    scenario=json.loads(snakemake.params.scenario),
    candidate_id=f"{snakemake.wildcards.target}/{snakemake.wildcards.name}",
    candidate_path=snakemake.input.candidate,
    settings={**snakemake.params.settings, "num_threads": snakemake.threads, "golden": snakemake.params.golden},
    output=snakemake.output[0],
    log=snakemake.log[0],
    root=os.getcwd(),
)
