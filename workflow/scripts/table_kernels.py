"""Snakemake adapter: the merged kernel rows as an HTML table (see kb_nano.tracking.report_table)."""

from kb_nano.interrupts import quiet_on_sigint

quiet_on_sigint()  # first: a Ctrl-C while the rest imports ends quietly too

from pathlib import Path

from kb_nano.tracking import read_parquet_rows
from kb_nano.tracking.report_table import write_kernels_table

rows = read_parquet_rows(Path(snakemake.input.parquet))
write_kernels_table(rows, Path(snakemake.output[0]))
with open(snakemake.log[0], "w") as log:
    print(f"kernels: {len(rows)} rows -> {snakemake.output[0]}", file=log)
