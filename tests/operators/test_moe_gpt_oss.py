"""gpt-oss's MoE block as a ``fused_moe`` scenario (``gpt_oss`` semantics): the baseline
equals transformers' ``GptOssMLP`` built from the vendored config with small dims, its TP
shards sum to the whole, the module tree reads the clamped SwiGLU from the experts module,
the scenario's inputs make the clamp bind, and a candidate without the clamp, the biases or
the interleaved gate/up columns fails while one that computes them passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from operator_helpers import measure_moe_candidate

from kb_nano import operators
from kb_nano.kernels.manifest import generate
from kb_nano.models.module_tree import read
from kb_nano.operators.base import TOLERANCES, make_tensor
from kb_nano.operators.moe import SWIGLU_INPUT_STD, FusedMoE

REPO = Path(__file__).resolve().parents[2]
# the vendored gpt-oss config with small dims: 8 experts, top-4, experts 48 wide
SMALL = dict(hidden_size=64, intermediate_size=48, num_local_experts=8, num_hidden_layers=2)
SMALL.update(layer_types=["sliding_attention", "full_attention"])


def _small(facts_of):
    """(transformers GptOssMLP, the baseline from the operator's rules) with the same
    weights, in float32; the router has random weights and a random bias."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    facts = facts_of("gpt-oss-20b", hf_config=True)
    fields = {**facts["hf_config"], **SMALL}
    facts.update(read(fields), hf_config=fields, hidden_size=64, intermediate_size=48)
    op = operators.get("fused_moe")
    args = op.init_args(facts, 1)
    assert op.semantics(facts) == "gpt_oss"
    assert (args["activation"], args["has_bias"], args["swiglu_limit"], args["top_k"]) == ("swigluoai", True, 7.0, 4)
    cfg = GptOssConfig(**{k: v for k, v in fields.items() if k not in ("quantization_config",)})
    cfg._experts_implementation = "eager"
    block = GptOssMLP(cfg).float()
    torch.manual_seed(0)
    ours = FusedMoE(**{**args, "params_dtype": "float32"})
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        # transformers keeps [E, in, out] with gate/up interleaved along out; vLLM [E, out, in]
        block.experts.gate_up_proj.copy_(ours.w13_weight.transpose(1, 2))
        block.experts.gate_up_proj_bias.copy_(ours.w13_bias)
        block.experts.down_proj.copy_(ours.w2_weight.transpose(1, 2))
        block.experts.down_proj_bias.copy_(ours.w2_bias)
        block.router.weight.copy_(torch.randn(8, 64, generator=gen) * 0.1)
        block.router.bias.copy_(torch.randn(8, generator=gen))
    return block, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_baseline_equals_transformers_gpt_oss_mlp(facts_of, dtype):
    block, ours = _small(facts_of)
    block, ours = block.to(dtype), ours.to(dtype)
    x = (torch.randn(12, 64, generator=torch.Generator().manual_seed(1)) * SWIGLU_INPUT_STD).to(dtype)
    with torch.no_grad():
        logits = F.linear(x, block.router.weight, block.router.bias)  # vLLM: the router outside
        _, want_w, want_ids = block.router(x)
        got_w, got_ids = ours.select_experts(logits)
        want, got = block(x[None])[0][0], ours(x.clone(), logits)
        pre = F.linear(x.float(), ours.w13_weight[0].float(), ours.w13_bias[0].float())
    assert (pre[:, ::2] > 7).any() and (pre[:, 1::2].abs() > 7).any()  # the clamp binds
    # the same experts with the same weights (softmax over the top-k logits)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w.to(dtype), want_w, **({} if dtype == torch.float32 else dict(rtol=0, atol=0)))
    assert got.shape == (12, 64) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # transformers rounds the routing weights to bf16 and adds each bias after its GEMM's
        # rounding; vLLM (the baseline) keeps fp32 weights and adds the bias in the GEMM
        atol, rtol = TOLERANCES["fused"]["bfloat16"]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    # the clamp is part of it: without the limit the output differs
    with torch.no_grad():
        ours.swiglu = (1.702, float("inf"))
        assert not torch.allclose(ours(x.clone(), logits).float(), want.float(), atol=0.02, rtol=0.016)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_baseline_equals_transformers_gpt_oss_mlp_on_edge_rows(facts_of, dtype):
    """A zero hidden row (the router's bias alone routes it, the experts' biases alone reach
    the output), rows x 4 (pre-activations far past the limit, a one-hot softmax) and
    x 1e-3 (the clamp idle)."""
    block, ours = _small(facts_of)
    block, ours = block.to(dtype), ours.to(dtype)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(5)) * SWIGLU_INPUT_STD
    x[0] = 0
    x[1:4] *= 4
    x[4:6] *= 1e-3
    x = x.to(dtype)
    with torch.no_grad():
        logits = F.linear(x, block.router.weight, block.router.bias)
        got_w, got_ids = ours.select_experts(logits)
        want, got = block(x[None])[0][0], ours(x.clone(), logits)
        want_ids = block.router(x)[2]
    assert torch.equal(got_ids, want_ids)
    assert got_w[1:4, 0].min() > 0.99 and got[0].abs().amax() > 0  # one-hot; the zero row's biases
    # in units of each row's largest value: the large rows' outputs are far above the others'
    scale = want.float().abs().amax(-1, keepdim=True).clamp(min=1e-3)
    tol = (
        dict(rtol=1e-5, atol=1e-5)
        if dtype == torch.float32
        else dict(zip(("atol", "rtol"), TOLERANCES["fused"]["bfloat16"]))
    )
    torch.testing.assert_close(got.float() / scale, want.float() / scale, **tol)


def test_gpt_oss_tp_shards_sum_to_the_whole_with_w2_bias_on_rank_0():
    args = dict(num_experts=8, top_k=4, hidden_size=32, intermediate_size=48, has_bias=True, activation="swigluoai")
    full = FusedMoE(**args)
    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(6, 32, generator=gen) * SWIGLU_INPUT_STD, torch.randn(6, 8, generator=gen)
    total = torch.zeros(6, 32)
    with torch.no_grad():
        for rank in range(2):
            part = FusedMoE(**args, tp_size=2)
            cols, rows = slice(rank * 48, (rank + 1) * 48), slice(rank * 24, (rank + 1) * 24)
            # vLLM's weight loader: interleaved gate/up columns 2 * start : 2 * end, w2_bias on rank 0
            part.w13_weight.copy_(full.w13_weight[:, cols])
            part.w13_bias.copy_(full.w13_bias[:, cols])
            part.w2_weight.copy_(full.w2_weight[:, :, rows])
            part.w2_bias.copy_(full.w2_bias if rank == 0 else torch.zeros_like(full.w2_bias))
            total += part(x, logits)
        torch.testing.assert_close(total, full(x, logits), rtol=1e-5, atol=1e-5)


def test_gpt_oss_experts_are_read_from_the_module_and_an_unclamped_one_is_not_covered():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP

    from kb_nano.models.ffn_tree import experts_facts, moe_block

    with torch.device("meta"):
        block = GptOssMLP(GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, swiglu_limit=5.0))
    want = {"act": "swigluoai", "bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 5.0}
    assert experts_facts(block.experts) == want
    assert moe_block(block)["reason"] is None and moe_block(block)["semantics"] == "gpt_oss"

    class Unclamped(GptOssExperts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    block.experts.__class__ = Unclamped
    assert experts_facts(block.experts)["act"] is None
    assert moe_block(block)["reason"] == "not covered: GptOssMLP whose experts' activation is not swigluoai"


def test_gpt_oss_scenarios_shard_the_experts_and_reach_the_clamp():
    m = generate(["gpt-oss-20b"], [4], [64], "auto", REPO, targets=["fused_moe", "silu_and_mul"])
    rows = {s["target"]: s for s in m["scenarios"]}
    s = rows["fused_moe"]
    assert s["scenario_id"] == "fused_moe__gpt-oss-20b__tp4__n64__gpt_oss" and s["semantics"] == "gpt_oss"
    args = s["init_args"]
    assert (args["num_experts"], args["top_k"], args["intermediate_size"], args["tp_size"]) == (32, 4, 2880, 4)
    assert (args["activation"], args["has_bias"], args["swiglu_alpha"], args["swiglu_limit"]) == (
        "swigluoai",
        True,
        1.702,
        7.0,
    )
    with torch.device("meta"):
        meta = FusedMoE(**args)
    assert meta.w13_weight.shape == (32, 2 * 720, 2880) and meta.w13_bias.shape == (32, 2 * 720)
    assert meta.w2_weight.shape == (32, 2880, 720) and meta.w2_bias.shape == (32, 2880)
    # the experts' activation is not SiLU-and-mul: no stand-in silu_and_mul (swigluoai_and_mul
    # measures it: test_swigluoai.py)
    assert not rows["silu_and_mul"]["applicable"]
    assert rows["silu_and_mul"]["reason"] == "GptOssForCausalLM does not use silu_and_mul"
    # the hidden states the judge draws, on the baseline's weights (two experts of them):
    # the limit binds on some gate and up values of every token; the output's rms is that of
    # the other MoE scenarios (~0.1), whose bf16 roundings the tolerance absorbs
    gen = torch.Generator().manual_seed(0)
    x = make_tensor(s["inputs"][0], gen, "cpu").float()
    torch.manual_seed(0)
    two = FusedMoE(**{**args, "num_experts": 2, "top_k": 2, "params_dtype": "float32"})
    with torch.no_grad():
        pre = F.linear(x, two.w13_weight[0], two.w13_bias[0])
        out = two(x, torch.randn(64, 2, generator=gen))
    gate, up = pre[:, ::2], pre[:, 1::2]
    assert 0.005 < (gate > 7).float().mean() < 0.1 and 0.01 < (up.abs() > 7).float().mean() < 0.1
    assert ((gate > 7) | (up.abs() > 7)).any(-1).all()
    assert 0.05 < out.pow(2).mean().sqrt() < 0.3


# the shipped candidate with one part of gpt-oss's experts dropped: (old, new) lines
BROKEN = {
    "no_clamp": ("gate = gate_up[..., ::2].clamp(max=limit)", "gate = gate_up[..., ::2]"),
    "no_up_clamp": ("up = gate_up[..., 1::2].clamp(-limit, limit)", "up = gate_up[..., 1::2]"),
    "no_bias": (
        "y = F.linear(x, self.w13_weight[e], None if self.w13_bias is None else self.w13_bias[e])",
        "y = F.linear(x, self.w13_weight[e])",
    ),
    "no_w2_bias": (
        "y = F.linear(y, self.w2_weight[e], None if self.w2_bias is None else self.w2_bias[e])",
        "y = F.linear(y, self.w2_weight[e])",
    ),
    "halves": (
        "gate = gate_up[..., ::2].clamp(max=limit)\n        up = gate_up[..., 1::2].clamp(-limit, limit)",
        "gate, up = gate_up.chunk(2, dim=-1)\n        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)",
    ),
    "silu_only": ('"deepseek_v3", "gpt_oss", ', '"deepseek_v3", '),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("candidate", "status"),
    [
        ("sorted_experts", "passed"),
        ("no_clamp", "incorrect"),
        ("no_up_clamp", "incorrect"),
        ("no_bias", "incorrect"),
        ("no_w2_bias", "incorrect"),
        ("halves", "incorrect"),
        ("silu_only", "skipped"),
    ],
)
def test_a_candidate_without_the_clamp_the_biases_or_the_interleaving_fails(tmp_path, candidate, status):

    m = generate(["gpt-oss-20b"], [4], [16], "auto", REPO, targets=["fused_moe"])
    (scenario,) = m["scenarios"]
    # the real routing (32 experts, top-4) on narrow experts; the hidden states' std and the
    # weights' init as the scenario has them
    scenario["init_args"].update(hidden_size=256, intermediate_size=512)
    scenario["inputs"][0]["shape"] = [16, 256]
    row = measure_moe_candidate(scenario, candidate, [BROKEN[candidate]] if candidate in BROKEN else None, tmp_path)
    assert row["status"] == status, row["error"]
    if status == "skipped":
        assert "supported_semantics" in row["error"] and "gpt_oss" in row["error"]
