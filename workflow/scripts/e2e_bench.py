"""Snakemake adapter: one model x TP x workload x variant -> the baseline and the variant alternately, a row per vLLM run (see kb_nano.e2e.job)."""

from kb_nano.interrupts import quiet_on_sigint

quiet_on_sigint()  # first: a Ctrl-C while the rest imports ends quietly too

from kb_nano.candidates import file_sha256
from kb_nano.e2e.job import run

job = snakemake.params.job
run(
    model=job["model"],
    tp=int(snakemake.wildcards.tp),
    workload=job["workload"],
    variant=snakemake.wildcards.variant,
    candidates=[{**c, "sha256": file_sha256(c["path"])} for c in job["candidates"]],
    engine=job["engine"],
    output=snakemake.output.shard,
    vllm_json=snakemake.output.json,
    log=snakemake.log[0],
    pairs=int(job["pairs"]),
)
