"""Snakemake adapter: merge e2e/eval shards into results/{tier}.parquet and the JSON (kb_nano.e2e.merge.merge_e2e)."""

from kb_nano.interrupts import quiet_on_sigint

quiet_on_sigint()  # first: a Ctrl-C while the rest imports ends quietly too

from pathlib import Path

from kb_nano.e2e.merge import merge_e2e

tier = snakemake.params.tier
rows = merge_e2e(
    [Path(p) for p in snakemake.input.shards],
    Path(snakemake.output.parquet),
    Path(snakemake.output.json),
    tier=tier,
    skipped=list(snakemake.params.skipped),
)
with open(snakemake.log[0], "w") as log:
    print(
        f"merged {len(snakemake.input.shards)} {tier} shards + {len(snakemake.params.skipped)} skipped = {len(rows)} rows",
        file=log,
    )
