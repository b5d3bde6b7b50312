"""Llama-4's MoE block as a ``fused_moe`` scenario (``llama4`` semantics): the baseline,
built from the arguments the operator's rules give the vendored Llama-4 Scout at small dims,
equals transformers' ``Llama4TextMoe``; a candidate that scales the expert's output instead
of its input, or routes by softmax, fails while one that computes the block passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from operator_helpers import measure_moe_candidate

from kb_nano.kernels.manifest import generate
from kb_nano.operators.base import TOLERANCES
from kb_nano.operators.moe import FusedMoE

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(num_experts=8, hidden_size=32, intermediate_size=48, shared_experts_intermediate_size=48)


def _small():
    """(transformers Llama4TextMoe, the baseline with the rules' llama4 arguments at small
    dims) with the same weights, in float32; the router has random weights."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    m = generate(["llama4-scout"], [1], [4], "auto", REPO, targets=["fused_moe"])
    (s,) = m["scenarios"]
    assert s["semantics"] == "llama4" and s["scenario_id"] == "fused_moe__llama4-scout__tp1__n4__llama4"
    args = {**s["init_args"], **SMALL, "params_dtype": "float32"}
    assert (args["scoring_func"], args["renormalize"], args["apply_router_weight_on_input"], args["top_k"]) == (
        "sigmoid",
        False,
        True,
        1,
    )
    cfg = Llama4TextConfig(hidden_size=32, intermediate_size=48, num_local_experts=8, num_experts_per_tok=1)
    block = Llama4TextMoe(cfg).float()
    torch.manual_seed(0)
    ours = FusedMoE(**args)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        # transformers keeps [E, in, out] (gate columns, then up); vLLM [E, out, in]
        block.experts.gate_up_proj.copy_(ours.w13_weight.transpose(1, 2))
        block.experts.down_proj.copy_(ours.w2_weight.transpose(1, 2))
        gate, up = ours.shared_experts.gate_up_proj.weight.chunk(2)
        block.shared_expert.gate_proj.weight.copy_(gate)
        block.shared_expert.up_proj.weight.copy_(up)
        block.shared_expert.down_proj.weight.copy_(ours.shared_experts.down_proj.weight)
        block.router.weight.copy_(torch.randn(8, 32, generator=gen) * 0.3)
    return block, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama4_baseline_equals_transformers_llama4_text_moe(dtype):
    block, ours = _small()
    block, ours = block.to(dtype), ours.to(dtype)
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[11] *= 8  # a large logit: a saturating sigmoid weight
    with torch.no_grad():
        logits = F.linear(x, block.router.weight)  # vLLM: the router outside
        scores, _ = block.router(x)
        got_w, got_ids = ours.select_experts(logits)
        want, got = block(x[None])[0], ours(x.clone(), logits)
    # the same expert with the same weight (sigmoid of its logit; the others score 0)
    assert torch.equal(got_ids[:, 0], scores.argmax(-1))
    torch.testing.assert_close(got_w[:, 0].to(dtype), scores.amax(-1), rtol=0, atol=0)
    assert got.shape == (12, 32) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # transformers sums every expert's output (zeros but one) and the shared one in bf16
        atol, rtol = TOLERANCES["fused"]["bfloat16"]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    # the weight scales the input: scaling the output instead is another block
    with torch.no_grad():
        ours.apply_router_weight_on_input = False
        assert not torch.allclose(ours(x.clone(), logits).float(), want.float(), atol=0.05)


def test_llama4_scenarios_shard_the_experts_and_the_shared_expert():
    m = generate(["llama4-scout"], [8], [64], "auto", REPO, targets=["fused_moe", "silu_and_mul"])
    rows = {s["target"]: s for s in m["scenarios"]}
    s = rows["fused_moe"]
    assert s["scenario_id"] == "fused_moe__llama4-scout__tp8__n64__llama4"
    args = s["init_args"]
    assert (args["num_experts"], args["top_k"], args["intermediate_size"], args["tp_size"]) == (16, 1, 8192, 8)
    assert args["shared_experts_intermediate_size"] == 8192
    with torch.device("meta"):
        meta = FusedMoE(**args)
    assert meta.w13_weight.shape == (16, 2 * 1024, 5120) and meta.w2_weight.shape == (16, 5120, 1024)
    assert meta.shared_experts.gate_up_proj.weight.shape == (2 * 1024, 5120)
    # the experts' (and the shared expert's) SiLU-and-mul: num_tokens * top_k rows of 1024
    assert [i["shape"] for i in rows["silu_and_mul"]["inputs"]] == [[64, 2 * 1024]]
    with pytest.raises(ValueError, match="top_k=1"):
        FusedMoE(**{**args, "top_k": 2})


# the shipped candidate with one part of Llama-4's block changed: [(old, new) lines]
BROKEN = {
    "weight_on_output": [
        ("if self.weight_on_input:\n                x = x * ", "if False:\n                x = x * "),
        (
            "out[rows] = y.float() if self.weight_on_input else y * weights.view(-1)[rows, None]",
            "out[rows] = y * weights.view(-1)[rows, None]",
        ),
    ],
    "softmax": [
        ('self.sigmoid_topk = scoring_func == "sigmoid" and not use_grouped_topk', "self.sigmoid_topk = False")
    ],
    "no_llama4": [('"gpt_oss", "llama4", ', '"gpt_oss", ')],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("candidate", "status"),
    [
        ("sorted_experts", "passed"),
        ("weight_on_output", "incorrect"),
        ("softmax", "incorrect"),
        ("no_llama4", "skipped"),
    ],
)
def test_a_candidate_scaling_the_output_or_routing_by_softmax_fails(tmp_path, candidate, status):

    m = generate(["llama4-scout"], [8], [16], "auto", REPO, targets=["fused_moe"])
    (scenario,) = m["scenarios"]
    # the real routing (16 experts, top-1, shared expert) on narrow experts
    scenario["init_args"].update(hidden_size=256, intermediate_size=512, shared_experts_intermediate_size=512)
    scenario["inputs"][0]["shape"] = [16, 256]
    row = measure_moe_candidate(scenario, candidate, BROKEN.get(candidate), tmp_path)
    assert row["status"] == status, row["error"]
    if status == "skipped":
        assert "supported_semantics" in row["error"] and "llama4" in row["error"]
