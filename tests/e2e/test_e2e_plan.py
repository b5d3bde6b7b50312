"""Tier 2 (vLLM end to end) planning: the workloads' vLLM flags and errors, the default
candidate set, unswappable candidates, models without weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from workflow_helpers import REPO, TINY, copy_workflow

from kb_nano.e2e import plan as e2e_plan
from kb_nano.e2e import workloads
from kb_nano.e2e.vllm_plugin import swappable
from kb_nano.errors import KbNanoError
from kb_nano.rows import write_table

# ----------------------------------------------------------------------------- workloads


def test_workload_flags_are_vllm_flags():
    w = workloads.from_flags("latency", None, input_len=8, output_len=4, batch_size=2, num_iters=2)
    assert w.name == "latency_in8_out4_bs2_warm1_it2"
    assert workloads.bench_args(w) == [
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "2",
    ]
    t = workloads.from_flags("throughput", None, input_len=64, output_len=8, num_prompts=5)
    assert workloads.bench_args(t) == [
        "--dataset-name",
        "random",
        "--random-input-len",
        "64",
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "0.0",
        "--num-prompts",
        "5",
    ]
    s = workloads.from_flags("serve", None, input_len=16, num_prompts=4, max_concurrency=2)
    assert s.name == "serve_random_in16_out16_n4_r0.0_rateinf_c2"
    assert workloads.bench_args(s)[-4:] == ["--num-prompts", "4", "--max-concurrency", "2"]  # no --request-rate: inf


def test_workload_errors_are_one_line():
    with pytest.raises(KbNanoError, match="kind must be one of"):
        workloads.from_dict({"name": "x", "kind": "prefill"})
    with pytest.raises(KbNanoError, match="unknown workload field"):
        workloads.from_dict({"name": "x", "kind": "latency", "input_length": 3})
    with pytest.raises(KbNanoError, match="batch_size must be a positive integer"):
        workloads.from_dict({"name": "x", "kind": "latency", "batch_size": 0})


# ----------------------------------------------------------------------------- planning


def _tier1(work: Path, rows: list[dict]) -> None:
    """Write ``rows`` as the workflow's merged Tier-1 results, each measured with its
    candidate file as it is now (``candidate_sha256``)."""
    from kb_nano.candidates import file_sha256
    from kb_nano.kernels.schema import to_table

    for r in rows:
        r["candidate_sha256"] = file_sha256(work / "candidates" / f"{r['candidate']}.py")
    (work / "results").mkdir(exist_ok=True)
    write_table(to_table(rows), work / "results/kernels.parquet")


def test_default_candidate_set_is_the_fastest_that_passed_tier1(tmp_path):
    """Without --candidates the variant swaps in, per target vLLM can swap and the model
    uses, the candidate that passed Tier 1 fastest on the device when it is faster than
    the baseline: a new candidate file changes nothing until Tier 1 measured it, a
    candidate that failed there (an import_error, one incorrect row) is never picked,
    however fast its other rows, and a target whose best is slower, or faster on average
    without a row significantly faster, keeps vLLM's kernel."""
    from tracking_helpers import row

    work = copy_workflow(tmp_path)
    assert e2e_plan.candidate_set(work, [], "cpu", [TINY]) == []  # no Tier-1 results yet
    assert "run `kb_nano kernels` over these models first" in e2e_plan.describe_choice(work, "cpu", [], [TINY])
    (work / "candidates/rms_norm/zz_copy.py").write_bytes((work / "candidates/rms_norm/torch_fused.py").read_bytes())
    rows = [
        row("rms_norm", "torch_fused", speedup=1.5, significant=True),
        row("rms_norm", "torch_fused", n=64, speedup=1.2),
        row("rms_norm", "triton_rowwise", speedup=9.0, device="cuda"),  # another device
        row("silu_and_mul", "inplace", speedup=0.9),  # the only one that passed, slower than the baseline
        row("silu_and_mul", "inplace", n=64, speedup=1.3, significant=True),
        row("fused_add_rms_norm", "fp32_sum", speedup=2.0),
        row("fused_add_rms_norm", "fp32_sum", n=64, status="incorrect"),
        row("rotary_embedding", "rotate_half", status="import_error"),
        row("gelu_and_mul", "inplace", speedup=1.1, significant=True),  # Llama has no GeGLU
    ]
    _tier1(work, rows)
    cands = e2e_plan.candidate_set(work, [], "cpu", [TINY])
    assert [c.id for c in cands] == ["rms_norm/torch_fused", "silu_and_mul/inplace"]
    assert all(swappable(c.target)[0] for c in cands)
    crashed = row("silu_and_mul", "inplace", n=64, status="crashed", device=None)  # a job's row: the judge died
    _tier1(work, [*rows, crashed])
    assert "silu_and_mul/inplace" not in [c.id for c in e2e_plan.candidate_set(work, [], "cpu", [TINY])]
    _tier1(work, rows)
    line = e2e_plan.describe_choice(work, "cpu", cands, [TINY])
    assert "rms_norm/torch_fused (1.34x over 2 rows, 1 significantly faster)" in line
    assert "silu_and_mul/inplace (1.08x over 2 rows, 1 significantly faster)" in line
    assert "gelu_and_mul/inplace" in [c.id for c in e2e_plan.candidate_set(work, [], "cpu", ["gemma2-2b"])]
    _tier1(
        work, [*rows, row("rms_norm", "zz_copy", speedup=1.8, significant=True)]
    )  # Tier 1 measured the new file: faster
    ids = [c.id for c in e2e_plan.candidate_set(work, [], "cpu", [TINY])]
    assert ids == ["rms_norm/zz_copy", "silu_and_mul/inplace"]
    # the file edited since: its rows are stale, the runner-up is swapped in
    (work / "candidates/rms_norm/zz_copy.py").write_text((work / "candidates/rms_norm/zz_copy.py").read_text() + "#\n")
    ids = [c.id for c in e2e_plan.candidate_set(work, [], "cpu", [TINY])]
    assert ids == ["rms_norm/torch_fused", "silu_and_mul/inplace"]
    name = e2e_plan.variant_name(cands)
    assert [c.id for c in e2e_plan.variant_candidates(name, work)] == [c.id for c in cands]
    (work / "candidates/rms_norm/torch_fused.py").unlink()  # no candidate of rms_norm has current rows now
    assert [c.id for c in e2e_plan.candidate_set(work, [], "cpu", [TINY])] == ["silu_and_mul/inplace"]
    # passed, but slower than the baseline; faster on average by noise alone (no row significantly)
    _tier1(work, [row("rms_norm", "zz_copy", speedup=0.9), row("silu_and_mul", "inplace", speedup=1.08)])
    assert e2e_plan.candidate_set(work, [], "cpu", [TINY]) == []
    line = e2e_plan.describe_choice(work, "cpu", [], [TINY])
    assert "left out: rms_norm/zz_copy (0.9x over 1 rows, 0 significantly faster), silu_and_mul/inplace" in line


def test_unswappable_candidate_is_refused_with_the_reason():
    with pytest.raises(
        KbNanoError, match="attention/gqa_grouped: not swappable into vLLM: vLLM attention is a backend"
    ):
        e2e_plan.candidate_set(REPO, ["attention/gqa_grouped"], "cpu")
    with pytest.raises(KbNanoError, match="supports cuda; this run is on cpu"):
        e2e_plan.candidate_set(REPO, ["rms_norm/triton_rowwise"], "cpu")


def test_model_without_weights_runs_with_random_weights():
    m = e2e_plan.model(TINY, REPO)
    assert (m.key, m.load_format, m.weights) == ("tiny-llama", "dummy", "random (--load-format dummy)")
    assert m.tokenizer == Path(TINY)
    hub = e2e_plan.model("llama31-8b", REPO)  # vendored config only: embedded tokenizer
    assert hub.tokenizer == e2e_plan.EMBEDDED_TOKENIZER and hub.load_format == "dummy"
