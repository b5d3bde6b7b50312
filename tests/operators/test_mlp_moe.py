"""The L2 mlp and fused_moe blocks equal transformers' ``LlamaMLP`` / ``Gemma2MLP``,
``MixtralSparseMoeBlock`` and ``Qwen3MoeSparseMoeBlock`` at reduced widths, their TP partial
sums add up, and their rules give the real per-rank shapes.
"""

from __future__ import annotations

import pytest
import torch
from operator_helpers import MODELS, randn, shapes
from transformers import (
    Gemma2Config,
    LlamaConfig,
    MixtralConfig,
    Qwen3MoeConfig,
)
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.llama.modeling_llama import LlamaMLP as HFLlamaMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from kb_nano import operators
from kb_nano.operators.base import TOLERANCES, NotApplicable
from kb_nano.operators.mlp import LlamaMLP
from kb_nano.operators.moe import FusedMoE

# --------------------------------------------------------------------------- mlp


def _load_hf_mlp(hf, ours, d):
    with torch.no_grad():
        hf.gate_proj.weight.copy_(ours.gate_up_proj.weight[:d])
        hf.up_proj.weight.copy_(ours.gate_up_proj.weight[d:])
        hf.down_proj.weight.copy_(ours.down_proj.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mlp_equals_transformers_llama_mlp(dtype):
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, hidden_act="silu")
    ours = LlamaMLP(128, 352, "silu")
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        "gate_up_proj.weight": (704, 128),
        "down_proj.weight": (128, 352),
    }
    hf = HFLlamaMLP(cfg)
    _load_hf_mlp(hf, ours, 352)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = randn(7, 128, dtype=dtype, seed=1)
    with torch.no_grad():
        out, want = ours(x), hf(x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(out, want, **tol)


def test_mlp_with_biases_equals_transformers_and_an_ungated_mlp_is_not_covered():
    """Llama's ``mlp_bias``: the module tree finds the biases, the scenario passes
    ``bias=True`` (semantics ``bias``) and the baseline equals transformers' biased
    ``LlamaMLP``; Arcee's MLP without a gate (``down(act(up(x)))``) is not covered, and no
    ``silu_and_mul`` applies to it."""
    from transformers import ArceeConfig

    from kb_nano.models.module_tree import read

    tiny = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    tiny.update(num_hidden_layers=1, vocab_size=128)
    facts = {**tiny, "hidden_act": "silu", **read(LlamaConfig(**tiny, mlp_bias=True).to_dict())}
    op = operators.get("mlp")
    assert op.init_args(facts, 1)["bias"] is True and op.semantics(facts) == "bias"
    ours, hf = LlamaMLP(64, 96, "silu", bias=True), HFLlamaMLP(LlamaConfig(**tiny, mlp_bias=True))
    _load_hf_mlp(hf, ours, 96)
    with torch.no_grad():
        ours.gate_up_proj.bias.copy_(torch.cat([hf.gate_proj.bias, hf.up_proj.bias]))
        ours.down_proj.bias.copy_(hf.down_proj.bias)
        x = randn(3, 64, seed=4)
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-6)
    arcee = {**tiny, "hidden_act": "silu", **read(ArceeConfig(**tiny, hidden_act="silu").to_dict())}
    with pytest.raises(NotApplicable, match="ArceeMLP is not gated"):
        op.init_args(arcee, 1)
    assert not operators.get("silu_and_mul").applies_to(arcee)


def test_mlp_gelu_equals_transformers_gemma2_mlp():
    cfg = Gemma2Config(hidden_size=64, intermediate_size=96, hidden_activation="gelu_pytorch_tanh")
    ours, hf = LlamaMLP(64, 96, "gelu_pytorch_tanh"), Gemma2MLP(cfg)
    _load_hf_mlp(hf, ours, 96)
    x = randn(3, 64, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-6)


def test_mlp_tp_partial_sums_add_up_to_full_mlp():
    full = LlamaMLP(64, 192, "silu")
    x = randn(5, 64, seed=3)
    total = torch.zeros(5, 64)
    for rank in range(4):
        part = LlamaMLP(64, 192, "silu", tp_size=4)
        with torch.no_grad():
            rows = slice(rank * 48, (rank + 1) * 48)
            gate, up = full.gate_up_proj.weight[:192], full.gate_up_proj.weight[192:]
            part.gate_up_proj.weight.copy_(torch.cat((gate[rows], up[rows])))
            part.down_proj.weight.copy_(full.down_proj.weight[:, rows])
            total += part(x)
    with torch.no_grad():
        torch.testing.assert_close(total, full(x), rtol=1e-5, atol=1e-5)


def test_mlp_rules_and_applies_to(facts_of):
    args, s = shapes("mlp", facts_of("llama31-8b", hf_config=True), 4, n=2)
    assert args == {"hidden_size": 4096, "intermediate_size": 14336, "hidden_act": "silu", "tp_size": 4}
    assert s == {"x": [2, 4096]}
    m = LlamaMLP(**{**args, "hidden_size": 8, "intermediate_size": 16})
    assert m.gate_up_proj.weight.shape == (8, 8) and m.down_proj.weight.shape == (8, 4)
    assert operators.get("mlp").init_args(facts_of("gemma2-2b", hf_config=True), 1)["hidden_act"] == "gelu_pytorch_tanh"
    applies = {m: operators.get("mlp").applies_to(facts_of(m, hf_config=True)) for m in MODELS}
    assert {m for m, a in applies.items() if not a} == {"mixtral-8x7b", "qwen3-30b-a3b"}
    with pytest.raises(NotApplicable, match="intermediate_size"):
        operators.get("mlp").init_args(facts_of("llama31-8b", hf_config=True), 3)


# --------------------------------------------------------------------------- fused_moe


def _small_moe(kind):
    common = dict(hidden_size=64, num_experts_per_tok=2, hidden_act="silu")
    if kind == "mixtral":
        cfg = MixtralConfig(intermediate_size=96, num_local_experts=8, **common)
        block, e = MixtralSparseMoeBlock(cfg), 8
    else:
        cfg = Qwen3MoeConfig(moe_intermediate_size=48, num_experts=16, norm_topk_prob=True, **common)
        block, e = Qwen3MoeSparseMoeBlock(cfg), 16
    cfg._experts_implementation = "eager"
    i = block.experts.gate_up_proj.shape[1] // 2
    ours = FusedMoE(e, 2, 64, i, renormalize=True)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(ours.w13_weight)
        block.experts.down_proj.copy_(ours.w2_weight)
        block.gate.weight.copy_(randn(e, 64, seed=9, std=0.3))
    return block, ours


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_equals_transformers_sparse_moe_block(kind, dtype):
    block, ours = _small_moe(kind)
    block, ours = block.to(dtype), ours.to(dtype)
    x = randn(1, 11, 64, dtype=dtype, seed=1)
    with torch.no_grad():
        want = block(x)[0]
        router_logits = torch.nn.functional.linear(x[0], block.gate.weight)  # vLLM: self.gate(x) outside
        out = ours(x[0].clone(), router_logits)
    assert out.shape == (11, 64) and out.dtype == dtype
    if kind == "mixtral" or dtype == torch.float32:
        # Mixtral keeps fp32 routing weights as the baseline does; fp32 has nothing to round
        tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    else:
        # Qwen3-MoE rounds the routing weights to bf16 before scaling each expert's output
        tol = dict(zip(("atol", "rtol"), TOLERANCES["fused"]["bfloat16"]))
    torch.testing.assert_close(out, want, **tol)


def test_fused_moe_without_renormalize_and_tp_partial_sums():
    full = FusedMoE(8, 2, 32, 64, renormalize=False)
    x, logits = randn(6, 32, seed=1), randn(6, 8, seed=2)
    w, ids = full.select_experts(logits)
    torch.testing.assert_close(w, torch.softmax(logits, -1).topk(2).values)
    total = torch.zeros(6, 32)
    for rank in range(2):
        part = FusedMoE(8, 2, 32, 64, renormalize=False, tp_size=2)
        rows = slice(rank * 32, (rank + 1) * 32)
        with torch.no_grad():
            part.w13_weight.copy_(
                torch.cat((full.w13_weight[:, :64][:, rows], full.w13_weight[:, 64:][:, rows]), dim=1)
            )
            part.w2_weight.copy_(full.w2_weight[:, :, rows])
            total += part(x, logits)
    with torch.no_grad():
        torch.testing.assert_close(total, full(x, logits), rtol=1e-5, atol=1e-6)


def test_fused_moe_rules_real_shapes(facts_of):
    op = operators.get("fused_moe")
    args, s = shapes("fused_moe", facts_of("mixtral-8x7b", hf_config=True), 4, n=2)
    assert args == {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "params_dtype": "bfloat16",
        "renormalize": True,
        "tp_size": 4,
    }
    assert s == {"hidden_states": [2, 4096], "router_logits": [2, 8]}
    args, s = shapes("fused_moe", facts_of("qwen3-30b-a3b", hf_config=True), 8, n=2)
    assert (args["num_experts"], args["top_k"], args["intermediate_size"], args["renormalize"]) == (128, 8, 768, True)
    with torch.device("meta"):
        m = FusedMoE(**args)
    assert m.w13_weight.shape == (128, 2 * 96, 2048) and m.w2_weight.shape == (128, 2048, 96)
    assert m.w13_weight.dtype == torch.bfloat16
    applies = {m: op.applies_to(facts_of(m, hf_config=True)) for m in MODELS}
    assert {m for m, a in applies.items() if a} == {"mixtral-8x7b", "qwen3-30b-a3b"}
    # without the raw config fields (kernels --map) a MoE model still counts as MoE
    bare = {k: v for k, v in facts_of("mixtral-8x7b", hf_config=True).items() if k != "hf_config"}
    assert op.applies_to(bare)
    with pytest.raises(NotApplicable, match="expert fields"):
        op.init_args(bare, 1)
    with pytest.raises(NotApplicable, match="intermediate_size"):
        op.init_args(facts_of("qwen3-30b-a3b", hf_config=True), 5)
