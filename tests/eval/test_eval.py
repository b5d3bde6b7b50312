"""Tier 3: the fixed eval workloads, TP skipping, the planned job set, and a real CPU smoke run."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from tracking_helpers import e2e_rows, table_headers
from workflow_helpers import REPO, copy_workflow, kb_nano

from kb_nano.e2e import tier_jobs
from kb_nano.errors import KbNanoError
from kb_nano.eval import plan as eval_plan


def test_fixed_workloads_are_the_standard_ones():
    w = {x.name: x for x in eval_plan.workloads()}
    assert list(w) == ["prefill-heavy", "balanced", "decode-heavy", "single-request", "fixed-batch-32"]
    assert (
        w["prefill-heavy"].random_input_len,
        w["prefill-heavy"].random_output_len,
        w["prefill-heavy"].num_prompts,
    ) == (1024, 512, 1000)
    assert (w["balanced"].random_input_len, w["balanced"].random_output_len) == (512, 512)
    assert (w["decode-heavy"].random_input_len, w["decode-heavy"].random_output_len) == (512, 1024)
    assert (w["single-request"].batch_size, w["single-request"].input_len, w["single-request"].output_len) == (
        1,
        128,
        128,
    )
    assert (w["fixed-batch-32"].batch_size, w["fixed-batch-32"].kind) == (32, "latency")
    assert eval_plan.max_model_len(list(w.values())) == 1536


def test_smoke_scales_down_and_is_recorded_in_the_names():
    w = {x.name: x for x in eval_plan.workloads(smoke=True)}
    assert list(w) == [
        n + ".smoke" for n in ("prefill-heavy", "balanced", "decode-heavy", "single-request", "fixed-batch-32")
    ]
    assert (w["prefill-heavy.smoke"].random_input_len, w["prefill-heavy.smoke"].num_prompts) == (64, 16)
    assert w["fixed-batch-32.smoke"].batch_size == 32 and w["fixed-batch-32.smoke"].num_iters == 3
    with pytest.raises(KbNanoError, match="only with --smoke"):
        eval_plan.workloads(num_prompts=100)
    assert eval_plan.workloads(num_prompts=2000)[0].num_prompts == 2000


@pytest.mark.parametrize(
    ("tp", "pool", "device", "heads", "kv", "needle"),
    [
        (1, 8, "cuda", 32, 8, None),
        (4, 8, "cuda", 32, 8, None),
        (16, 8, "cuda", 32, 8, "the pool is --gpu-pool 8"),
        (4, 1, "cpu", 4, 2, "one CPU engine"),
        (3, 8, "cuda", 32, 8, "does not divide num_attention_heads=32"),
        (8, 8, "cuda", 4, 2, "does not divide num_attention_heads=4"),
    ],
)
def test_tp_skip_reasons(tp, pool, device, heads, kv, needle):
    why = eval_plan.tp_skip_reason(tp, pool, device, heads, kv)
    assert (why is None) if needle is None else (needle in why)


def _eval_config(**ev) -> dict:
    """The embedded config with its eval section on a CPU, one named candidate, and ``ev``."""
    from kb_nano.config import load

    config = load(REPO)
    config["eval"].update({"device": "cpu", "candidates": ["rms_norm/torch_fused"], **ev})
    return config


def test_a_subset_of_workloads_runs_with_the_whole_sweeps_engine():
    """`--workload balanced single-request` plans those two (smoke or not) with the engine
    settings of the whole sweep, so their rows are the whole sweep's; an unknown name is
    one line with the known ones."""
    whole = eval_plan.plan(REPO, _eval_config(smoke=True))
    part = eval_plan.plan(REPO, _eval_config(smoke=True, workloads=["single-request", "balanced.smoke"]))
    assert list(part["workloads"]) == ["balanced.smoke", "single-request.smoke"]  # the sweep's order
    assert part["engine"] == whole["engine"] and part["max_model_len"] == whole["max_model_len"] == 96
    assert set(tier_jobs.shard_paths("eval", part)) < set(tier_jobs.shard_paths("eval", whole))
    with pytest.raises(
        KbNanoError, match=r"--workload balance: not a standard eval workload \(did you mean 'balanced'"
    ):
        eval_plan.plan(REPO, _eval_config(workloads=["balance"]))


def test_smoke_plan_runs_one_pair_eagerly_and_skips_what_one_cpu_engine_cannot_run():
    plan = eval_plan.plan(REPO, _eval_config(smoke=True, tp=[1, 2], pairs=3))
    assert list(plan["models"]) == ["tiny-llama"]  # smoke without eval.models: the tiny Llama
    assert plan["tps"] == {"tiny-llama": [1]}
    assert plan["skipped"] == [["tiny-llama", 2, eval_plan.tp_skip_reason(2, 1, "cpu", 4, 2)]]
    assert "one CPU engine" in plan["skipped"][0][2]
    assert plan["variants"] == ["baseline", "rms_norm.torch_fused"]
    assert plan["pairs"] == 1  # smoke: one pair, whatever eval.pairs says
    assert plan["engine"] == {
        "dtype": "auto",
        "max_model_len": 96,  # prefill-heavy.smoke and decode-heavy.smoke: 64 + 32 tokens
        "enforce_eager": True,
        "seed": 42,
        "device": "cpu",
        "timeout_s": 3600,
    }
    assert tier_jobs.shard_paths("eval", plan) == [
        f"results/eval/tiny-llama/tp1/{w.name}/rms_norm.torch_fused.parquet" for w in eval_plan.workloads(smoke=True)
    ]


def test_full_plan_on_cuda_uses_cuda_graphs_and_the_configured_pairs():
    config = _eval_config(device="cuda", models=["llama31-8b"], tp=[1, 3, 8], pairs=5, gpu_pool=4)
    plan = eval_plan.plan(REPO, config)
    assert plan["tps"] == {"llama31-8b": [1]}
    assert [(key, tp) for key, tp, _ in plan["skipped"]] == [("llama31-8b", 3), ("llama31-8b", 8)]
    assert "does not divide num_attention_heads=32" in plan["skipped"][0][2]
    assert "the pool is --gpu-pool 4" in plan["skipped"][1][2]
    assert plan["pairs"] == 5
    assert plan["engine"]["enforce_eager"] is False and plan["engine"]["max_model_len"] == 1536
    assert tier_jobs.job_gpus(plan, "1") == 1


def test_skipped_rows_one_per_workload_and_variant_of_a_skipped_tp():
    config = _eval_config(smoke=True, tp=[1, 2], candidates=["rms_norm/torch_fused", "silu_and_mul/inplace"])
    plan = eval_plan.plan(REPO, config)
    rows = eval_plan.skipped_rows(plan)
    works = eval_plan.workloads(smoke=True)
    assert len(rows) == len(works) * 2
    assert {(r["model"], r["tp"], r["status"], r["device"]) for r in rows} == {("tiny-llama", 2, "skipped", "cpu")}
    assert {r["error"] for r in rows} == {plan["skipped"][0][2]}
    by_variant = {r["variant"]: r["candidates"] for r in rows}
    assert by_variant == {
        "baseline": "",
        "rms_norm.torch_fused+silu_and_mul.inplace": "rms_norm/torch_fused,silu_and_mul/inplace",
    }
    first = rows[0]
    assert (first["workload"], first["kind"], first["hub_id"]) == (works[0].name, "throughput", None)
    assert json.loads(first["workload_params"]) == works[0].params()
    assert eval_plan.skipped_rows(eval_plan.plan(REPO, _eval_config(smoke=True, tp=[1]))) == []


def test_eval_section_defaults_come_from_the_schema(tmp_path):
    """config/config.yaml has no eval: section; a config file that sets some of its keys
    gets the schema's defaults for the rest (nested sections are filled key by key)."""
    from kb_nano.config import load

    (tmp_path / "ev.yaml").write_text("eval: {smoke: true, device: cpu, candidates: [rms_norm/torch_fused]}\n")
    config = load(REPO, tmp_path / "ev.yaml")
    assert config["eval"] == {
        "models": [],
        "tp": [1, 4],
        "categories": [],
        "workloads": [],
        "candidates": ["rms_norm/torch_fused"],
        "num_prompts": 1000,
        "gpu_pool": 8,
        "seed": 42,
        "smoke": True,
        "pairs": 3,
        "device": "cpu",
        "timeout_s": 3600,
        "output_json": "results/eval.json",
    }
    assert eval_plan.plan(REPO, config)["engine"]["seed"] == 42


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A workflow copy with Tier-1 results on both devices (the default candidate set is
    the fastest per target that passed Tier 1)."""
    from tracking_helpers import row

    from kb_nano.candidates import file_sha256
    from kb_nano.kernels.schema import to_table
    from kb_nano.rows import write_table

    work = copy_workflow(tmp_path_factory.mktemp("eval"))
    rows = [
        row(t, c, device=d, significant=True)
        for d in ("cpu", "cuda")
        for t, c in (("rms_norm", "torch_fused"), ("silu_and_mul", "inplace"))
    ]
    for r in rows:  # measured with the files as they are
        r["candidate_sha256"] = file_sha256(work / "candidates" / f"{r['candidate']}.py")
    (work / "results").mkdir(exist_ok=True)
    write_table(to_table(rows), work / "results/kernels.parquet")
    return work


def test_without_tier1_results_eval_names_what_to_run_first(tmp_path):
    out = kb_nano(copy_workflow(tmp_path), "eval", "--dry-run", "--device", "cpu")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert (
        "passed Tier 1 faster than the baseline on cpu in results/kernels.parquet (with its current file; it "
        "holds the last `kb_nano kernels` run's selection): run `kb_nano kernels` over these models first" in out.stderr
    )


def _job_count(out) -> int:
    """e2e_bench jobs in Snakemake's dry-run job stats (on stdout or stderr)."""
    return int(
        next(line.split()[1] for line in (out.stdout + out.stderr).splitlines() if line.startswith("e2e_bench "))
    )


def test_dry_run_shows_the_standard_job_set(work):
    out = kb_nano(work, "eval", "--dry-run", "--device", "cuda")
    assert out.returncode == 0, out.stderr
    # 2 models (llama31-8b, qwen3-8b) x tp 1, 4 x 5 workloads; each job runs the baseline
    # and the candidates alternately
    assert _job_count(out) == 20
    cpu = kb_nano(work, "eval", "--dry-run", "--device", "cpu")
    assert cpu.returncode == 0, cpu.stderr
    assert _job_count(cpu) == 10  # tp 4 does not fit one CPU engine ...
    assert "skip llama31-8b tp=4: tp=4 needs 4 devices" in cpu.stderr  # ... and says so
    one = kb_nano(work, "eval", "--dry-run", "--device", "cuda", "--gpu-pool", "2", "--model", "qwen3-8b")
    assert _job_count(one) == 5 and "skip qwen3-8b tp=4" in one.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--num-prompts", "10"], "only with --smoke"),
        (["--category", "nope"], "unknown category 'nope'"),
        (["--candidate", "rms_norm/nope"], "matches no candidates"),
        (["--model", "llama99"], "unknown model 'llama99'"),
    ],
)
def test_bad_eval_flags_are_one_line(work, args, needle):
    out = kb_nano(work, "eval", "--dry-run", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], out.stderr


@pytest.mark.parametrize("columns", [80, 120, 250])
def test_eval_tables_fit_the_terminal(monkeypatch, capsys, columns):
    """`kb_nano eval`'s output at $COLUMNS (merged rows built directly, no vLLM): no line
    wider, the per-job tables fitted as Tier 2's; in the summary workload, ratio, spread
    and failed always stay, the p75..p25 ratio and model×TPs are left out first, then
    kind and the settings (which fold before), and the caption says which."""
    from kb_nano.eval.merge import summarize_eval
    from kb_nano.eval.table import print_eval

    rows = e2e_rows()
    skipped = {**rows[0], "tp": 4, "status": "skipped", "error": "tp=4 > the 1 device of this run"}
    monkeypatch.setenv("COLUMNS", str(columns))
    print_eval({"rows": [*rows, skipped], "summary": {"per_workload": summarize_eval(rows)}})
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns, out
    flat = " ".join(out.split())
    *jobs, summary = (head.split(" | ") for head in table_headers(out))
    assert len(jobs) == 3 and all("speedup" in head and "95% interval" in head for head in jobs)
    assert "skipped tiny-llama tp=4: tp=4 > the 1 device of this run" in flat
    assert "0.916x" in flat and "0.916-0.916" in flat and "1.118x" in flat
    key = ["workload", "ratio (geomean)", "spread min-max", "failed"]
    if columns == 250:
        assert summary == ["workload", "kind", "settings", "model×TPs", *key[1:3], "p75..p25 ratio", "failed"]
        assert "input_len 32, output_len 8, batch_size 2, num_prompts 4, max_concurrency 2" in out
    elif columns == 120:
        assert summary == ["workload", "kind", "settings", *key[1:]]
        assert "left out at 120 columns: model×TPs, p75..p25 ratio (a wider terminal shows them)" in flat
    else:
        assert summary == key
        assert "left out at 80 columns: kind, settings, model×TPs, p75..p25 ratio (a wider" in flat


@pytest.mark.slow
def test_eval_smoke_on_cpu_runs_every_workload_and_prints_the_ratios(tmp_path):
    pytest.importorskip("vllm")
    work = copy_workflow(tmp_path)
    # two of the five workloads, one of each kind (every workload is planned:
    # test_smoke_plan_runs_one_pair_eagerly_and_skips_what_one_cpu_engine_cannot_run)
    out = kb_nano(
        work, "eval", "--smoke", "--candidate", "rms_norm/torch_fused", "--workload", "balanced", "single-request"
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    doc = json.loads((work / "results/eval.json").read_text())
    rows = pd.read_parquet(work / "results/eval.parquet")
    ran = rows[rows["status"] != "skipped"]
    assert len(ran) == 4 and set(ran["status"]) == {"ok"}, ran[["workload", "variant", "status", "error"]]
    assert set(ran["workload"]) == {"balanced.smoke", "single-request.smoke"}
    assert set(ran["variant"]) == {"baseline", "rms_norm.torch_fused"}
    skipped = rows[rows["status"] == "skipped"]
    assert len(skipped) == 4 and set(skipped["tp"]) == {4}  # tp 4 on a CPU, with the reason
    summary = doc["summary"]["per_workload"]
    assert all(s["n"] == 1 and s["geomean"] > 0 for s in summary.values()), summary
    assert "kb-nano eval: candidate / baseline per workload" in out.stdout
    assert "MLflow: new run" in out.stdout and "kb_nano/eval" in out.stdout
    calls = json.loads(ran[ran["variant"] != "baseline"].iloc[0]["candidate_calls"])
    assert calls["rms_norm/torch_fused"]["calls"] > 0  # the candidate ran inside the engine
