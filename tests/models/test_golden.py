"""Golden-tensor capture (kb_nano.models.golden) and kernel scenarios that read it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from workflow_helpers import REPO, copy_workflow, kb_nano

from kb_nano.models.golden import GOLDEN_DIR, capture
from kb_nano.models.golden_inputs import GoldenMismatch, golden_inputs
from kb_nano.models.golden_summary import summary_lines
from kb_nano.operators.attention import Attention
from kb_nano.operators.base import normal

P, L, H, KV, D = 3, 16, 8, 2, 64


def _synthetic(tmp_path: Path) -> dict:
    """A golden attention file with known values: [P, L, heads, d] per layer."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in (0, 1):
        tensors[f"layer{layer}.query"] = torch.randn(P, L, H, D, generator=g).to(torch.bfloat16)
        tensors[f"layer{layer}.key"] = torch.randn(P, L, KV, D, generator=g).to(torch.bfloat16)
        tensors[f"layer{layer}.value"] = torch.randn(P, L, KV, D, generator=g).to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "attention.safetensors"))
    (tmp_path / "attention.json").write_text(
        json.dumps({"file": "attention.safetensors", "layers": [0, 1], "sha256": "x"})
    )
    return tensors


def _scenario(num_heads, num_kv_heads, n, context_len=None):
    specs = [
        normal("query", [n, num_heads * D], "bfloat16"),
        normal("key", [n, num_kv_heads * D], "bfloat16"),
        normal("value", [n, num_kv_heads * D], "bfloat16"),
    ]
    if context_len is not None:
        specs += [
            normal("key_cache", [n, context_len, num_kv_heads, D], "bfloat16"),
            normal("value_cache", [n, context_len, num_kv_heads, D], "bfloat16"),
        ]
    return {
        "scenario_id": "attention__x",
        "target": "attention",
        "inputs": specs,
        "init_args": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_size": D, "scale": D**-0.5},
    }


def test_prefill_inputs_are_the_first_tokens_of_one_prompt_and_rank0_heads(tmp_path):
    t = _synthetic(tmp_path)
    golden = {"path": str(tmp_path / "attention.json"), "sha256": "x"}
    got = golden_inputs(_scenario(H // 2, KV // 2, 10), golden, tmp_path, "cpu", draw=0)  # tp = 2
    assert torch.equal(got["query"], t["layer0.query"][0, :10, : H // 2].reshape(10, -1))
    assert torch.equal(got["key"], t["layer0.key"][0, :10, : KV // 2].reshape(10, -1))
    second = golden_inputs(_scenario(H // 2, KV // 2, 10), golden, tmp_path, "cpu", draw=1)
    assert torch.equal(second["query"], t["layer1.query"][1, :10, : H // 2].reshape(10, -1))
    with pytest.raises(GoldenMismatch, match="prefill of 17 tokens > 16"):
        golden_inputs(_scenario(H, KV, L + 1), golden, tmp_path, "cpu", draw=0)


def test_decode_from_golden_equals_the_prefill_row_at_that_position(tmp_path):
    """Causal attention: decoding position C against a cache of positions < C is row C of
    the prefill, so golden prefill tensors are valid decode inputs."""
    t = _synthetic(tmp_path)
    golden = {"path": str(tmp_path / "attention.json"), "sha256": "x"}
    c, n = 9, 5  # 5 sequences (more than the 3 prompts: they cycle)
    attn = Attention(H, D, D**-0.5, KV)
    dec = golden_inputs(_scenario(H, KV, n, context_len=c), golden, tmp_path, "cpu", draw=0)
    assert dec["key_cache"].shape == (n, c, KV, D)
    out_dec = attn(dec["query"], dec["key"], dec["value"], dec["key_cache"], dec["value_cache"]).float()
    for j in range(n):  # sequence j = prompt j % P of layer 0, prefilled up to position c
        q, k, v = (t[f"layer0.{name}"][j % P, : c + 1].reshape(c + 1, -1) for name in ("query", "key", "value"))
        out_pre = attn(q, k, v).float()
        torch.testing.assert_close(out_dec[j], out_pre[c], atol=1e-2, rtol=1e-2)
    with pytest.raises(GoldenMismatch, match="decode context 16"):
        golden_inputs(_scenario(H, KV, 1, context_len=L), golden, tmp_path, "cpu", draw=0)


TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "vocab_size": 300,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def test_capture_of_a_moe_model_writes_router_logits_attention_and_logits(tmp_path):
    meta = {"model": "tiny-moe", "hub_id": None, "config_sha256": "x"}
    written = capture(TINY_MOE, meta, REPO, tmp_path, num_layers=2)
    assert sorted(p.name for p in written) == ["attention.json", "fused_moe.json", "sampler.json"]
    side = json.loads((tmp_path / "fused_moe.json").read_text())
    assert side["num_hidden_layers"] == {"captured": 2, "model": 3}
    assert side["tensors"]["layer1.router_logits"]["shape"] == [4 * 512, 8]
    assert side["tensors"]["layer0.hidden_states"]["shape"] == [4 * 512, 64]
    assert side["prompts"]["tokenization"] == "utf8-bytes"
    assert side["sha256"] == hashlib.sha256((tmp_path / "fused_moe.safetensors").read_bytes()).hexdigest()
    assert json.loads((tmp_path / "sampler.json").read_text())["tensors"]["logits"]["shape"] == [4 * 16, 300]
    scenario = {
        "scenario_id": "fused_moe__x",
        "target": "fused_moe",
        "init_args": {},
        "inputs": [normal("hidden_states", [64, 64], "bfloat16"), normal("router_logits", [64, 8], "bfloat16")],
    }
    got = golden_inputs(scenario, {"path": str(tmp_path / "fused_moe.json")}, tmp_path, "cpu", draw=0)
    assert got["router_logits"].shape == (64, 8) and torch.isfinite(got["router_logits"].float()).all()
    # the captured router logits are real: different tokens route to different experts
    assert got["router_logits"].float().argmax(-1).unique().numel() > 1


def test_summary_lines_describe_each_captured_file(tmp_path):
    """`capture-golden`'s summary: one line per file of each model (operator, layers,
    weights, prompts, dtype, the first three tensors' shapes and how many more), then the
    operators whose scenarios now read them; a model without files adds no line."""
    meta = {"model": "tiny-moe", "hub_id": None, "config_sha256": "x"}
    capture(TINY_MOE, meta, REPO, tmp_path / GOLDEN_DIR / "tiny-moe", num_layers=2)
    lines = summary_lines(tmp_path, ["tiny-moe", "other"])
    assert len(lines) == 4
    assert lines[0] == (
        f"{tmp_path / GOLDEN_DIR / 'tiny-moe/attention.safetensors'}: attention of tiny-moe "
        "(2 of 3 layers, random weights, 4 prompts x 512 tokens, bfloat16): "
        "layer0.key [4, 512, 2, 64], layer0.query [4, 512, 4, 64], layer0.value [4, 512, 2, 64] (+3 more)"
    )
    assert lines[1].endswith(
        "layer0.hidden_states [2048, 64], layer0.router_logits [2048, 8], layer1.hidden_states [2048, 64] (+1 more)"
    )
    assert lines[2].endswith(
        "sampler of tiny-moe (2 of 3 layers, random weights, 4 prompts x 512 tokens, bfloat16): logits [64, 300]"
    )
    assert lines[3] == "attention, fused_moe, sampler scenarios of tiny-moe, other now use them (input_source = golden)"


def test_capture_golden_rule_error_reaches_the_terminal(tmp_path):
    """A capture that fails inside the rule (an empty prompt set) shows its one-line error
    in kb_nano's output through Snakemake (the job's stderr), not only in the rule's log,
    and ends with the CLI's line that the workflow failed."""
    work = copy_workflow(tmp_path)
    (work / "config/golden/prompts.yaml").write_text("prompts: []\n")
    out = kb_nano(work, "capture-golden", "--model", "qwen3-8b")
    assert out.returncode == 1, out.stderr
    message = "config/golden/prompts.yaml: 'prompts' must be a non-empty list of strings"
    lines = out.stderr.splitlines()
    assert f"kb-nano error: {message}" in lines, out.stderr
    assert lines[-1] == "error: the Snakemake workflow failed (exit 1); see the messages above"
    assert (work / "results/logs/capture_golden/qwen3-8b.log").read_text() == f"error: {message}\n"


@pytest.mark.slow
def test_capture_golden_cli_is_deterministic_and_feeds_attention_rows(tmp_path):
    work = copy_workflow(tmp_path)
    run = [
        "kernels",
        "--target",
        "attention",
        "--model",
        "qwen3-8b",
        "--tp",
        "4",
        "--num-tokens",
        "1",
        "--num-warmup",
        "0",
        "--num-runs",
        "2",
    ]
    before = kb_nano(work, *run)
    assert before.returncode == 0, before.stderr
    rows = pd.read_parquet(work / "results/kernels.parquet")
    assert set(rows["input_source"]) == {"random"}

    out = kb_nano(work, "capture-golden", "--model", "Qwen/Qwen3-8B")
    assert out.returncode == 0, out.stderr
    gdir = work / "results/golden/qwen3-8b"
    assert sorted(p.name for p in gdir.glob("[!.]*")) == [
        "attention.json",
        "attention.safetensors",
        "sampler.json",
        "sampler.safetensors",
    ]
    side = json.loads((gdir / "attention.json").read_text())
    assert side["model"] == "qwen3-8b" and side["hub_id"] == "Qwen/Qwen3-8B"
    assert side["num_hidden_layers"] == {"captured": 2, "model": 36}
    assert side["tensors"]["layer0.query"]["shape"] == [4, 512, 32, 128]
    assert "attention of qwen3-8b" in out.stdout
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in gdir.glob("[!.]*")}

    again = kb_nano(work, "capture-golden", "--model", "qwen3-8b", "--force")
    assert again.returncode == 0, again.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in gdir.glob("[!.]*")} == digests

    after = kb_nano(work, *run)
    assert after.returncode == 0, after.stderr
    rows = pd.read_parquet(work / "results/kernels.parquet")
    assert len(rows) == 2 and set(rows["input_source"]) == {"golden"}, rows[["scenario_id", "input_source"]]
    assert set(rows["status"]) == {"passed"}, rows[["scenario_id", "status", "error"]]
    assert "golden" in after.stdout  # the table says so

    (work / "off.yaml").write_text("use_golden: false\n")
    off = kb_nano(work, *run, "--configfile", "off.yaml")
    assert off.returncode == 0, off.stderr
    assert set(pd.read_parquet(work / "results/kernels.parquet")["input_source"]) == {"random"}


def test_capture_golden_bad_weights_is_one_line(tmp_path):
    work = copy_workflow(tmp_path)
    out = kb_nano(work, "capture-golden", "--model", "qwen3-8b", "--weights", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: --weights") and len(out.stderr.strip().splitlines()) == 1
