"""Snakemake adapter: plots of the merged kernel results (see kb_nano.tracking.plots)."""

from pathlib import Path

from kb_nano.tracking import read_parquet_rows
from kb_nano.tracking.plots import bandwidth_plot, speedup_plot

rows = read_parquet_rows(Path(snakemake.input.parquet))
speedup_plot(rows, Path(snakemake.output.speedup))
bandwidth_plot(rows, Path(snakemake.output.bandwidth))
with open(snakemake.log[0], "w") as log:
    print(f"{snakemake.params.tier}: plotted {len(rows)} rows -> {', '.join(snakemake.output)}", file=log)
