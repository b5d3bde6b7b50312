#!/usr/bin/env bash
# Multi-GPU leasing run (Tier 1): the same kernel sweep twice in a scratch copy of the
# workflow, first with `--resources gpu=N` (N = the host's GPUs), then, its shards deleted,
# with `--resources gpu=1`; nvidia-smi samples every 200 ms throughout. Writes into OUTDIR:
#   kernels_gpu{N}.parquet, kernels_gpu1.parquet  the merged rows of each sweep
#   runs.tsv        per sweep: wall time, exit code, start/end, planned jobs (the report's input)
#   nvidia_smi.csv  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -lms 200
#   machine.txt     date, host, GPUs, driver, versions, the commands run
#   logs.tar.gz     the dry run's and each sweep's Snakemake output, and the job logs
#   MULTI_GPU.md    python bench/multi_gpu_report.py over the files above
#
# Usage, from the repository root:
#   bash bench/multi_gpu.sh [--wheels DIR] OUTDIR
# --wheels DIR: first `pip install --no-index --no-deps --target /tmp/site DIR/*.whl` and put
# /tmp/site first on PYTHONPATH (a GPU machine without Snakemake). The project itself is
# never pip-installed: src/ goes on PYTHONPATH and Snakemake runs as `python -m snakemake`.
# Environment:
#   PYTHON                 interpreter (default python3)
#   KB_NANO_SWEEP_CONFIGS  --configfile list, space-separated (default config/sweeps/multi_gpu.yaml;
#                          later files override earlier ones)
#   KB_NANO_BUDGET_S       seconds from the start by which both sweeps must have ended (default 480):
#                          a sweep still running then is stopped (SIGTERM, SIGKILL 20 s later), the
#                          shards it wrote are kept (runs.tsv: complete 0); one with < 30 s left is skipped
#   KB_NANO_GPU_IDS        a fake device pool (CPU test; see kb_nano/gpus.py): N = its length, no nvidia-smi
# Each sweep gets its own empty TRITON_CACHE_DIR, so both compile their Triton kernels alike.
# Exit status: the report's when it fails (1 = a device was double-booked, 2 = bad input),
# else 1 when a sweep did not complete, else 0. Nothing in the checkout's results/ is touched.
set -uo pipefail

die() { echo "error: $*" >&2; exit 2; }
wheels=
if [ "${1:-}" = "--wheels" ]; then wheels=${2:?--wheels needs a directory}; shift 2; fi
out=${1:?usage: bash bench/multi_gpu.sh [--wheels DIR] OUTDIR}
[ -f Snakefile ] && [ -d src/kb_nano ] || die "run from the kb-nano repository root (no Snakefile or src/kb_nano in $PWD)"
mkdir -p "$out" && out=$(cd "$out" && pwd) || die "cannot create $out"
py=$(command -v "${PYTHON:-python3}") || die "no ${PYTHON:-python3} on PATH"
case $py in /*) ;; *) py=$PWD/$py ;; esac
configs=${KB_NANO_SWEEP_CONFIGS:-config/sweeps/multi_gpu.yaml}
budget=${KB_NANO_BUDGET_S:-480}
t_start=$(date +%s)
repo=$PWD
work= smi_pid=
trap '[ -z "$work" ] || rm -rf "$work"; [ -z "$smi_pid" ] || kill "$smi_pid" 2>/dev/null' EXIT

if [ -n "$wheels" ]; then
    compgen -G "$wheels/*.whl" >/dev/null || die "--wheels $wheels: no .whl files there"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
        || die "pip could not install $wheels/*.whl into /tmp/site"
    export PYTHONPATH=/tmp/site:$repo/src
else
    export PYTHONPATH=$repo/src${PYTHONPATH:+:$PYTHONPATH}
fi
# nvidia-smi numbers GPUs in PCI bus order; make CUDA_VISIBLE_DEVICES ids name the same GPUs.
export CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1

fake=${KB_NANO_GPU_IDS:-}
if [ -n "$fake" ]; then
    n=$(tr ',' '\n' <<<"$fake" | grep -c .)
else
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    [ "$n" -ge 1 ] || die "nvidia-smi -L lists no GPU (set KB_NANO_GPU_IDS=0,1,.. for a fake pool on a CPU host)"
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -lms 200 >"$out/nvidia_smi.csv" 2>&1 &
    smi_pid=$!
fi

# Versions, and (real GPUs) one CUDA context on each device before the first sweep, so that
# neither sweep pays the driver's first start.
versions=$(KB_NANO_WARM=$([ -n "$fake" ] && echo 0 || echo "$n") "$py" - 2>&1 <<'EOF'
import os, sys
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
import pandas, pyarrow
for i in range(int(os.environ["KB_NANO_WARM"])):
    try:
        torch.zeros(1, device=f"cuda:{i}")
    except Exception as exc:
        sys.exit(f"CUDA device {i}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
print(torch.cuda.device_count())
print(f"python {sys.version.split()[0]} | torch {torch.__version__} | triton {triton_version} | "
      f"CUDA devices {torch.cuda.device_count()} | pandas {pandas.__version__} | pyarrow {pyarrow.__version__}")
EOF
) || die "preflight ($py: torch, pandas, pyarrow, a CUDA context on each GPU): ${versions##*$'\n'}"
cuda_n=${versions%%$'\n'*}
[ -n "$fake" ] || [ "$cuda_n" = "$n" ] || die "nvidia-smi lists $n GPU(s) but torch sees $cuda_n"

work=$(mktemp -d /tmp/kb_nano_multi_gpu.XXXXXX)
wf=$work/workflow
mkdir -p "$wf" "$work/logs"
for f in Snakefile workflow config candidates profiles envs; do cp -r "$repo/$f" "$wf/" || die "cannot copy $f"; done
# Snakemake: the target first (--configfile and --resources take lists); config files that
# are not part of the copied workflow are copied next to its Snakefile.
smk=("$py" -m snakemake results/kernels.parquet --cores all --configfile)
i=0
for c in $configs; do
    if [ -f "$wf/$c" ]; then smk+=("$c")
    elif [ -f "$c" ]; then i=$((i + 1)) && cp "$c" "$wf/extra_config_$i.yaml" && smk+=("extra_config_$i.yaml")
    else die "config file $c not found"; fi
done

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "host: $(hostname), kernel $(uname -r), $(nproc) CPU cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p'))"
    echo "commit: $(git -C "$repo" rev-parse HEAD 2>/dev/null || echo 'unknown (no .git here)')"
    if [ -n "$fake" ]; then echo "GPUs: fake pool KB_NANO_GPU_IDS=$fake (jobs run on the CPU)"
    else nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv; fi
    echo "${versions#*$'\n'} | snakemake $("$py" -m snakemake --version)"
    echo "wheels: ${wheels:-none} | PYTHONPATH=$PYTHONPATH | CUDA_DEVICE_ORDER=$CUDA_DEVICE_ORDER"
} >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

(cd "$wf" && "${smk[@]}" --dry-run) >"$work/logs/dryrun.log" 2>&1 \
    || { cat "$work/logs/dryrun.log" >&2; die "the dry run failed (above)"; }
planned=$(awk '$1 == "kernel_bench" {print $2; exit}' "$work/logs/dryrun.log")
[ -n "$planned" ] || die "the dry run plans no kernel_bench job"
echo "sweep: $planned kernel jobs; both sweeps end by $budget s from the start"

printf 'gpus\texit_code\twall_s\tstart_epoch\tend_epoch\tstart_local\tend_local\tplanned_jobs\tparquet\tcomplete\n' >"$out/runs.tsv"
incomplete=0
run_sweep() {  # $1: the N of --resources gpu=N
    local g=$1 left rc wall s_epoch s_day s_time e_epoch e_day e_time complete=1
    left=$((t_start + budget - $(date +%s)))
    if [ "$left" -lt 30 ]; then
        echo "sweep gpu=$g: skipped, $left s left of the budget"
        incomplete=1
        return
    fi
    rm -rf "$wf/results/kernels" "$wf/results/kernels.parquet" "$wf/results/kernels.json" "$wf/results/logs"
    echo "command: (in the scratch copy, TRITON_CACHE_DIR empty) ${smk[*]} --resources gpu=$g" >>"$out/machine.txt"
    echo "sweep gpu=$g: start (stopped after $left s at the latest)"
    read -r s_epoch s_day s_time < <(date '+%s.%N %Y/%m/%d %H:%M:%S.%N')
    (cd "$wf" && TRITON_CACHE_DIR=$work/triton_gpu$g timeout -k 20 "$left" "${smk[@]}" --resources gpu="$g") \
        >"$work/logs/snakemake_gpu$g.log" 2>&1
    rc=$?
    read -r e_epoch e_day e_time < <(date '+%s.%N %Y/%m/%d %H:%M:%S.%N')
    if [ -f "$wf/results/kernels.parquet" ]; then
        cp "$wf/results/kernels.parquet" "$out/kernels_gpu$g.parquet"
    else  # stopped or failed: keep the shards written so far
        complete=0
        "$py" - "$wf/results/kernels" "$out/kernels_gpu$g.parquet" <<'EOF'
import sys
from pathlib import Path

from kb_nano.schema import read_rows, write_table

write_table(read_rows(sorted(Path(sys.argv[1]).rglob("*.parquet"))), Path(sys.argv[2]))
EOF
        (cd "$wf" && "${smk[@]}" --unlock) >/dev/null 2>&1
    fi
    [ "$rc" -eq 0 ] && [ "$complete" -eq 1 ] || incomplete=1
    [ -d "$wf/results/logs" ] && mv "$wf/results/logs" "$work/logs/jobs_gpu$g"
    wall=$(awk -v a="$s_epoch" -v b="$e_epoch" 'BEGIN {printf "%.3f", b - a}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$g" "$rc" "$wall" "$s_epoch" "$e_epoch" \
        "$s_day ${s_time:0:15}" "$e_day ${e_time:0:15}" "$planned" "kernels_gpu$g.parquet" "$complete" >>"$out/runs.tsv"
    echo "sweep gpu=$g: exit $rc, wall $wall s, complete=$complete"
}
run_sweep "$n"
run_sweep 1

if [ -n "$smi_pid" ]; then kill "$smi_pid" 2>/dev/null; wait "$smi_pid" 2>/dev/null; smi_pid=; fi
tar -czf "$out/logs.tar.gz" -C "$work" logs
smi_arg=()
[ -s "$out/nvidia_smi.csv" ] && smi_arg=(--smi "$out/nvidia_smi.csv")
"$py" "$repo/bench/multi_gpu_report.py" --runs "$out/runs.tsv" "${smi_arg[@]}" --machine "$out/machine.txt" >"$out/MULTI_GPU.md"
rc=$?
sed '/^## Jobs$/,$d' "$out/MULTI_GPU.md"  # the per-job table stays in the file
echo "total $(($(date +%s) - t_start)) s; in $out: $(cd "$out" && ls | tr '\n' ' ')"
[ "$rc" -eq 0 ] || exit "$rc"
[ "$incomplete" -eq 0 ] || { echo "error: a sweep did not complete (runs.tsv; Snakemake output in logs.tar.gz)" >&2; exit 1; }
