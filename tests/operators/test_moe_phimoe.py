"""Phi-3.5-MoE's MoE block as a ``fused_moe`` scenario (``phimoe`` semantics): the baseline,
built from the arguments the operator's rules give the vendored Phi-3.5-MoE at small dims,
equals transformers' ``PhimoeSparseMoeBlock`` in eval mode on random rows and on edge rows
(tied router logits, large and tiny logits), its routing equals transformers' ``sparsemixer``
on crafted logits; a candidate that routes by plain softmax top-2 or without sparsemixer's
threshold fails while the shipped one passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from operator_helpers import measure_moe_candidate, randn

from kb_nano.kernels.manifest import generate
from kb_nano.operators.base import NotApplicable
from kb_nano.operators.moe import FusedMoE
from kb_nano.operators.moe_args import phimoe_args
from kb_nano.operators.moe_parts import sparsemixer

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(num_experts=8, hidden_size=32, intermediate_size=48)


def _small():
    """(transformers PhimoeSparseMoeBlock in eval mode, the baseline with the rules' phimoe
    arguments at small dims) with the same weights, in float32; the router has random
    weights, and expert 3's router row is expert 0's, so their logits always tie."""
    from transformers import PhimoeConfig
    from transformers.models.phimoe.modeling_phimoe import PhimoeSparseMoeBlock

    m = generate(["phi35-moe"], [1], [4], "auto", REPO, targets=["fused_moe"])
    (s,) = m["scenarios"]
    assert s["semantics"] == "phimoe" and s["scenario_id"] == "fused_moe__phi35-moe__tp1__n4__phimoe"
    args = {**s["init_args"], **SMALL, "params_dtype": "float32"}
    assert (args["custom_routing_function"], args["jitter_eps"], args["renormalize"], args["top_k"]) == (
        "sparsemixer",
        0.01,
        False,
        2,
    )
    cfg = PhimoeConfig(hidden_size=32, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    assert cfg.router_jitter_noise == args["jitter_eps"] and cfg.hidden_act == "silu"
    block = PhimoeSparseMoeBlock(cfg).float().eval()
    torch.manual_seed(0)
    ours = FusedMoE(**args)
    with torch.no_grad():
        # the same layout as vLLM's: [E, 2I, hidden] (gate rows, then up), [E, hidden, I]
        block.experts.gate_up_proj.copy_(ours.w13_weight)
        block.experts.down_proj.copy_(ours.w2_weight)
        router = randn(8, 32, seed=3, std=0.3)
        router[3] = router[0]
        block.router.weight.copy_(router)
    return block, ours


def _rows(dtype):
    """Random hidden rows plus edge rows: row 0 zero (all logits tied: experts 0 and 1),
    rows 1-3 x 30 (large logits: one expert per pick within the threshold), rows 4-5 x 1e-3
    (tiny logits), and every row's logits of experts 0 and 3 tied."""
    x = randn(24, 32, seed=1)
    x[0] = 0
    x[1:4] *= 30
    x[4:6] *= 1e-3
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phimoe_baseline_equals_transformers_phimoe_sparse_moe_block(dtype):
    block, ours = _small()
    block, ours = block.to(dtype), ours.to(dtype)
    x = _rows(dtype)
    with torch.no_grad():
        logits = F.linear(x, block.router.weight)  # vLLM: the router outside
        _, want_w, want_ids = block.router(x.clone())
        got_w, got_ids = ours.select_experts(logits)
        want, got = block(x[None].clone())[0], ours(x.clone(), logits)
    assert torch.equal(got_ids, want_ids)
    assert got_w.dtype == torch.float32 and torch.equal(got_w, want_w.float())
    # the tied rows: the lower index first; the zero row's weights 1/8 and 1/7 (every logit within)
    assert got_ids[0].tolist() == [0, 1] and not got[0].any()
    torch.testing.assert_close(got_w[0], torch.tensor([1 / 8, 1 / 7]), rtol=0, atol=2e-3)
    assert 0 in got_ids[:, 0] and all(3 not in row or row[0] != 3 for row in got_ids.tolist())
    # large logits: each pick alone within the threshold, weight 1 (not renormalised: sum 2)
    assert torch.equal(got_w[1:4], torch.ones(3, 2))
    assert got.shape == (24, 32) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same weights in bf16 and the same accumulation order: bit for bit
        assert torch.equal(got, want)
    # softmax top-2 (renormalised or not) is another block
    with torch.no_grad():
        for renormalize in (False, True):
            ours.custom_routing_function, ours.renormalize = None, renormalize
            assert not torch.allclose(ours(x.clone(), logits).float(), want.float(), atol=0.05)


def test_sparsemixer_equals_transformers_on_crafted_logits():
    """Ties at the top (exact and after the first pick), logits just inside and just outside
    the threshold, negative rows, a zero row, huge logits, fp32 and bf16."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

    logits = torch.tensor(
        [
            [2.0, 2.0, 1.0, -1.0, 0.5, 2.0],  # three tied at the top
            [1.0, 3.0, 3.0, 0.0, -2.0, 0.2],  # the top two tied
            [3.0, 2.95, 2.9, 2.85, 0.0, 2.0],  # 1.7 % and 3.3 % below: one inside, one outside
            [-1.0, -0.5, -0.51, -3.0, -0.49, -2.0],  # all negative
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all zero: 0 / 0 counts as within
            [1e4, -1e4, 9.9e3, 0.0, 3e4, 2.99e4],  # huge
        ]
    )
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        want_w, want_ids = hf_sparsemixer(x, jitter_eps=0.01, training=False)
        got_w, got_ids = sparsemixer(x, 0.01)
        assert torch.equal(got_ids, want_ids), dtype
        assert torch.equal(got_w, want_w.float()), dtype
        # a wider threshold takes more experts into each softmax: other weights
        wide_w, wide_ids = sparsemixer(x, 0.05)
        assert torch.equal(wide_ids, got_ids) and not torch.equal(wide_w, got_w)
    assert sparsemixer(logits, 0.01)[1][:2].tolist() == [[0, 1], [1, 2]]


def test_phimoe_scenarios_shard_the_experts_and_refuse_what_vllm_routes_otherwise():
    m = generate(["phi35-moe"], [8], [64], "auto", REPO, targets=["fused_moe", "silu_and_mul"])
    rows = {s["target"]: s for s in m["scenarios"]}
    s = rows["fused_moe"]
    assert s["scenario_id"] == "fused_moe__phi35-moe__tp8__n64__phimoe"
    args = s["init_args"]
    assert (args["num_experts"], args["top_k"], args["intermediate_size"], args["tp_size"]) == (16, 2, 6400, 8)
    assert [i["shape"] for i in s["inputs"]] == [[64, 4096], [64, 16]]
    with torch.device("meta"):
        meta = FusedMoE(**args)
    assert meta.w13_weight.shape == (16, 2 * 800, 4096) and meta.w2_weight.shape == (16, 4096, 800)
    assert meta.shared_experts is None and meta.w13_bias is None
    # the experts' SiLU-and-mul: num_tokens * top_k rows of 800
    assert rows["silu_and_mul"]["applicable"] and [i["shape"] for i in rows["silu_and_mul"]["inputs"]] == [[128, 1600]]
    for bad, match in (
        ({"top_k": 3}, "top_k=2"),
        ({"renormalize": True}, "renormalize"),
        ({"custom_routing_function": "x"}, "not supported"),
    ):
        with pytest.raises(ValueError, match=match):
            FusedMoE(**{**args, **bad})
    with pytest.raises(NotApplicable, match="num_experts_per_tok=1"):
        phimoe_args({"num_experts_per_tok": 1}, 1)
    with pytest.raises(NotApplicable, match="router_jitter_noise=0.05 .*they differ"):
        phimoe_args({"num_experts_per_tok": 2, "router_jitter_noise": 0.05}, 1)


# the shipped candidate with one part of Phi-3.5-MoE's routing changed: [(old, new) lines]
BROKEN = {
    "softmax_top2": [
        (
            "self.sparsemixer = float(jitter_eps) if custom_routing_function else None",
            "self.sparsemixer = None",
        )
    ],
    "no_threshold": [("> 2 * eps", "> float('inf')")],
    "no_phimoe": [('"llama4", "phimoe")', '"llama4")')],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("candidate", "status"),
    [
        ("sorted_experts", "passed"),
        ("softmax_top2", "incorrect"),
        ("no_threshold", "incorrect"),
        ("no_phimoe", "skipped"),
    ],
)
def test_a_candidate_routing_by_softmax_top2_fails(tmp_path, candidate, status):
    m = generate(["phi35-moe"], [8], [16], "auto", REPO, targets=["fused_moe"])
    (scenario,) = m["scenarios"]
    # the real routing (16 experts, sparsemixer top-2) on narrow experts
    scenario["init_args"].update(hidden_size=256, intermediate_size=512)
    scenario["inputs"][0]["shape"] = [16, 256]
    row = measure_moe_candidate(scenario, candidate, BROKEN.get(candidate), tmp_path)
    assert row["status"] == status, row["error"]
    if status == "skipped":
        assert "supported_semantics" in row["error"] and "phimoe" in row["error"]
