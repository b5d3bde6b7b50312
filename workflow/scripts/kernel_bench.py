"""Snakemake adapter: one candidate × scenario -> one Parquet shard (see kb_nano.kernel_job)."""

import json
import os
import sys

from kb_nano.errors import KbNanoError
from kb_nano.kernel_job import run

try:
    run(
        scenario=json.loads(snakemake.params.scenario),
        candidate_id=f"{snakemake.wildcards.target}/{snakemake.wildcards.name}",
        candidate_path=snakemake.input.candidate,
        settings={**snakemake.params.settings, "num_threads": snakemake.threads},
        output=snakemake.output[0],
        log=snakemake.log[0],
        root=os.getcwd(),
        gpus=int(snakemake.resources.get("gpu", 0)),
    )
except KbNanoError as exc:  # GPU lease problems: one line, no row (the job reruns next time)
    sys.exit(f"error: {exc}")
