"""DeepSeek-V3's MoE block as a ``fused_moe`` scenario (``deepseek_v3`` semantics): the
baseline equals transformers' ``DeepseekV3MoE`` built from the vendored config with small
dims, the scenario's inputs make the groups and the bias decide the experts, and a
candidate that ignores either fails while one that computes them passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from operator_helpers import measure_moe_candidate

from kb_nano import operators
from kb_nano.kernels.manifest import generate
from kb_nano.models.module_tree import read
from kb_nano.operators.base import TOLERANCES, make_tensor
from kb_nano.operators.moe import SCORE_BIAS_STD, FusedMoE
from kb_nano.operators.moe_parts import grouped_topk

REPO = Path(__file__).resolve().parents[2]
# the vendored DeepSeek-V3 config with small dims: 32 experts in 4 groups (2 kept), top-4,
# one shared expert; hidden = experts so that an identity gate makes the router logits
# the hidden states (transformers' router takes hidden states, the baseline logits)
SMALL = dict(hidden_size=32, n_routed_experts=32, n_group=4, topk_group=2, num_experts_per_tok=4)
SMALL.update(moe_intermediate_size=16, intermediate_size=64, num_hidden_layers=2, first_k_dense_replace=1)


def _small(facts_of):
    """(transformers DeepseekV3MoE, the baseline from the operator's rules) with the same
    weights, in float32."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    facts = facts_of("deepseek-v3", hf_config=True)
    fields = {**facts["hf_config"], **SMALL}
    facts.update(read(fields), hf_config=fields, hidden_size=32, intermediate_size=64)
    args = operators.get("fused_moe").init_args(facts, 1)
    assert operators.get("fused_moe").semantics(facts) == "deepseek_v3"
    assert args["routed_scaling_factor"] == 2.5 and args["shared_experts_intermediate_size"] == 16
    cfg = DeepseekV3Config(**{k: v for k, v in fields.items() if k not in ("quantization_config", "auto_map")})
    cfg._experts_implementation = "eager"
    block = DeepseekV3MoE(cfg).float()
    torch.manual_seed(0)
    ours = FusedMoE(**{**args, "params_dtype": "float32"})
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(ours.w13_weight)
        block.experts.down_proj.copy_(ours.w2_weight)
        block.gate.e_score_correction_bias.copy_(ours.e_score_correction_bias)
        block.gate.weight.copy_(torch.eye(32))
        gate, up = ours.shared_experts.gate_up_proj.weight.chunk(2)
        block.shared_experts.gate_proj.weight.copy_(gate)
        block.shared_experts.up_proj.weight.copy_(up)
        block.shared_experts.down_proj.weight.copy_(ours.shared_experts.down_proj.weight)
    return block, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_baseline_equals_transformers_deepseek_v3_moe(facts_of, dtype):
    block, ours = _small(facts_of)
    block, ours = block.to(dtype), ours.to(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 32, generator=gen)
    x[8] = 0.7  # all router logits equal: the bias alone picks the groups and experts
    x[9] *= 8  # saturating sigmoid scores
    x[10] = -x[10].abs() - 4  # tiny scores: renormalisation carries the weights
    x[11] *= 1e-3
    x = x.to(dtype)
    with torch.no_grad():
        _, want_w, want_ids = block.gate(x)
        got_w, got_ids = ours.select_experts(x)
        want, got = block(x[None])[0], ours(x.clone(), x.clone())
    # the same experts with the same weights (transformers scales them in the router)
    assert torch.equal(got_ids.sort(-1).values, want_ids.sort(-1).values)
    order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
    torch.testing.assert_close(got_w.gather(1, order_got) * 2.5, want_w.gather(1, order_want), rtol=1e-6, atol=1e-7)
    assert got.shape == (12, 32) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        # vLLM scales the rounded routed output, transformers the fp32 weights, and the shared
        # output is added to it: bf16 roundings apart, each an ulp of the row's largest terms
        # (|out| up to ~5 on the shifted row), so compared in units of the row's largest value
        scale = want.float().abs().amax(-1, keepdim=True).clamp(min=1)
        atol, rtol = TOLERANCES["fused"]["bfloat16"]
        torch.testing.assert_close(got.float() / scale, want.float() / scale, atol=atol, rtol=rtol)
    # the shared experts and the scaling are part of it
    assert not torch.allclose(got.float(), (want - block.shared_experts(x[None])[0]).float(), atol=0.05)


def test_deepseek_v3_scenarios_make_the_groups_and_the_bias_choose(facts_of):
    m = generate(["deepseek-v3"], [8], [64], "auto", REPO, targets=["fused_moe"])
    (s,) = m["scenarios"]
    assert s["scenario_id"] == "fused_moe__deepseek-v3__tp8__n64__deepseek_v3" and s["semantics"] == "deepseek_v3"
    args = s["init_args"]
    assert (args["num_experts"], args["top_k"], args["num_expert_group"], args["topk_group"]) == (256, 8, 8, 4)
    assert (args["intermediate_size"], args["shared_experts_intermediate_size"], args["tp_size"]) == (2048, 2048, 8)
    with torch.device("meta"):
        m = FusedMoE(**args)
    assert m.w13_weight.shape == (256, 2 * 256, 7168) and m.w2_weight.shape == (256, 7168, 256)
    assert m.shared_experts.gate_up_proj.weight.shape == (2 * 256, 7168)
    gen = torch.Generator().manual_seed(0)
    logits = make_tensor(s["inputs"][1], gen, "cpu")
    bias = (torch.randn(256, generator=gen) * SCORE_BIAS_STD).to(logits.dtype)

    def chosen(bias, groups=True):
        if groups:
            return grouped_topk(logits, 8, True, 8, 4, "sigmoid", 1.0, bias)[1].sort(-1).values
        return (logits.float().sigmoid() + bias.float()).topk(8).indices.sort(-1).values

    ids = chosen(bias)
    assert (ids != chosen(bias, groups=False)).any(-1).float().mean() > 0.5
    assert (ids != chosen(bias * 0)).any(-1).float().mean() > 0.9


# the shipped candidate with one part of DeepSeek-V3's routing dropped: (old, new) lines
BROKEN = {
    "no_groups": (
        'masked = grouped.masked_fill((rank >= keep)[..., None], float("-inf")).flatten(1)',
        "masked = grouped.flatten(1)",
    ),
    "no_bias": (
        "biased = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()",
        "biased = scores",
    ),
    "softmax_only": ('supported_semantics = ("deepseek_v3", ', "supported_semantics = ("),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("candidate", "status"),
    [("sorted_experts", "passed"), ("no_groups", "incorrect"), ("no_bias", "incorrect"), ("softmax_only", "skipped")],
)
def test_a_candidate_ignoring_the_groups_or_the_bias_fails(tmp_path, candidate, status):

    m = generate(["deepseek-v3"], [8], [16], "auto", REPO, targets=["fused_moe"])
    (scenario,) = m["scenarios"]
    # the real routing (256 experts in 8 groups, top-8, bias, scaling) on narrow experts
    scenario["init_args"].update(hidden_size=128, intermediate_size=128, shared_experts_intermediate_size=128)
    scenario["inputs"][0]["shape"] = [16, 128]
    row = measure_moe_candidate(scenario, candidate, [BROKEN[candidate]] if candidate in BROKEN else None, tmp_path)
    assert row["status"] == status, row["error"]
    if status == "skipped":
        assert "supported_semantics" in row["error"] and "e_score_correction_bias" in row["error"]
