"""Snakemake adapter: merge e2e shards into results/e2e.parquet and the JSON (kb_nano.merge.merge_e2e)."""

from pathlib import Path

from kb_nano.merge import merge_e2e

rows = merge_e2e([Path(p) for p in snakemake.input.shards], Path(snakemake.output.parquet), Path(snakemake.output.json))
with open(snakemake.log[0], "w") as log:
    print(f"merged {len(snakemake.input.shards)} e2e shards = {len(rows)} rows", file=log)
