"""kb_nano.e2e.swap: candidates applied bottom-up to a model's module tree, subsumption
warnings, the active module map, weights carried over, outputs unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.candidates import discover, load_class
from kb_nano.e2e import swap
from kb_nano.e2e.swap import Subsumed, SubsumptionWarning, SwapError
from kb_nano.e2e.swap_matches import Match, active_matches
from kb_nano.errors import KbNanoError
from kb_nano.kernels.inputs import randomize_constant_parameters
from kb_nano.operators.activations import SiluAndMul
from kb_nano.operators.layers import CausalLM, DecoderLayer
from kb_nano.operators.norms import RMSNorm
from kb_nano.operators.rotary import RotaryEmbedding

CANDIDATES = {c.id: c for c in discover(REPO)}
RMS = "rms_norm/torch_fused"
LAYER = "decoder_layer/sdpa_fused"
MODEL = "model/sdpa"

SMALL = dict(
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=300,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def hf_llama() -> nn.Module:
    cfg = LlamaConfig(**SMALL)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    randomize_constant_parameters(model, seed=1)  # norms are ones after init
    return model


def hf_qwen3() -> nn.Module:
    cfg = Qwen3Config(**SMALL, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    randomize_constant_parameters(model, seed=1)
    return model


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def ids(batch=2, seq=9):
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(3))


class FusedMLP(nn.Module):
    """An inline ``mlp`` candidate: kb-nano's LlamaMLP signature and vLLM keys."""

    def __init__(
        self,
        hidden_size,
        intermediate_size,
        hidden_act,
        quant_config=None,
        bias=False,
        prefix="",
        reduce_results=True,
        tp_size=1,
    ):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size // tp_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size // tp_size, hidden_size, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in caught if issubclass(w.category, SubsumptionWarning)]


# --------------------------------------------------------------------------- the done-when test


def test_rms_norm_then_decoder_layer_subsumption_and_module_map():
    model = hf_llama()
    x = ids()
    want = logits(model, x)
    result, warned = record(lambda: swap.apply(model, [CANDIDATES[LAYER], CANDIDATES[RMS]]))  # order does not matter

    # one warning per replaced layer, naming both candidates and the module paths
    assert len(warned) == 2
    for i, w in enumerate(warned):
        msg = str(w.message)
        assert f"{LAYER} replaces model.layers.{i}," in msg
        assert f"{RMS} at model.layers.{i}.input_layernorm, model.layers.{i}.post_attention_layernorm" in msg
    # the final module map: the layers run the L3 candidate, the final norm the L1 one
    assert result.active == {"model.norm": RMS, "model.layers.0": LAYER, "model.layers.1": LAYER}
    assert result.subsumed == [
        Subsumed(RMS, f"model.layers.{i}.{norm}", LAYER, f"model.layers.{i}")
        for i in (0, 1)
        for norm in ("input_layernorm", "post_attention_layernorm")
    ]
    assert result.model is model
    assert type(model.model.norm).__name__ == "FusedRMSNorm"
    assert [type(layer).__name__ for layer in model.model.layers] == ["SdpaFusedDecoderLayer"] * 2
    # the candidates got the weights: the swapped model computes the same logits
    torch.testing.assert_close(logits(model, x), want, rtol=1e-5, atol=1e-5)


def test_qwen3_qk_norms_are_subsumed_too():
    model = hf_qwen3()
    x = ids(batch=1, seq=12)
    want = logits(model, x)
    result, warned = record(lambda: swap.apply(model, [CANDIDATES[RMS], CANDIDATES[LAYER]]))
    assert result.active == {"model.norm": RMS, "model.layers.0": LAYER, "model.layers.1": LAYER}
    lower = sorted(s.lower_path for s in result.subsumed if s.higher_path == "model.layers.0")
    assert lower == [
        f"model.layers.0.{p}"
        for p in ("input_layernorm", "post_attention_layernorm", "self_attn.k_norm", "self_attn.q_norm")
    ]
    assert "model.layers.0.self_attn.q_norm" in str(warned[0].message)
    torch.testing.assert_close(logits(model, x), want, rtol=1e-5, atol=1e-5)


def test_l1_only_stays_active_everywhere():
    model = hf_llama()
    x = ids()
    want = logits(model, x)
    result, warned = record(lambda: swap.apply(model, [(RMS, load_class(CANDIDATES[RMS].path, "rms_norm"))]))
    assert not warned and not result.subsumed
    assert sorted(result.active) == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]
    torch.testing.assert_close(logits(model, x), want, rtol=1e-5, atol=1e-5)


def test_l2_mlp_weights_map_to_vllm_layout_and_back():
    """transformers gate_proj/up_proj -> kb-nano mlp's gate_up_proj; an L3 candidate over it
    gets the transformers keys back."""
    assert "mlp" in operators.CATALOG
    model = hf_llama()
    x = ids()
    want = logits(model, x)
    result = swap.apply(model, [("mlp/fused", FusedMLP)])
    assert result.active == {"model.layers.0.mlp": "mlp/fused", "model.layers.1.mlp": "mlp/fused"}
    assert set(model.model.layers[0].mlp.state_dict()) == {"gate_up_proj.weight", "down_proj.weight"}
    torch.testing.assert_close(logits(model, x), want, rtol=1e-5, atol=1e-5)
    # a later apply() on the same model sees the candidates already in it
    result, warned = record(lambda: swap.apply(model, [CANDIDATES[LAYER]]))
    assert result.active == {"model.layers.0": LAYER, "model.layers.1": LAYER}
    assert result.subsumed == [
        Subsumed("mlp/fused", f"model.layers.{i}.mlp", LAYER, f"model.layers.{i}") for i in (0, 1)
    ]
    assert len(warned) == 2
    torch.testing.assert_close(logits(model, x), want, rtol=1e-5, atol=1e-5)
    # nothing left to match: the layers are candidates, their submodules are theirs
    result = swap.apply(model, [CANDIDATES[RMS]])
    assert result.active == {"model.norm": RMS, "model.layers.0": LAYER, "model.layers.1": LAYER}


def test_all_levels_on_the_l4_baseline():
    config = {
        **SMALL,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    }
    torch.manual_seed(0)
    model = CausalLM(config, num_hidden_layers=2)
    randomize_constant_parameters(model, seed=1)
    n = 10
    tokens = torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(4))
    positions = torch.randint(0, SMALL["max_position_embeddings"], (n,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = model(tokens, positions)

    # L1 + L2 + L3 inside the kb-nano CausalLM (transformers modules inside)
    result, warned = record(lambda: swap.apply(model, [CANDIDATES[RMS], ("mlp/fused", FusedMLP), CANDIDATES[LAYER]]))
    assert result.active == {"model.norm": RMS, "model.layers.0": LAYER, "model.layers.1": LAYER}
    assert {(s.lower, s.higher) for s in result.subsumed} == {(RMS, LAYER), ("mlp/fused", LAYER)}
    msg = str(warned[0].message)
    assert "mlp/fused at model.layers.0.mlp" in msg and f"{RMS} at model.layers.0.input_layernorm" in msg
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens, positions), want, rtol=1e-5, atol=1e-5)

    # L4 over all of it: the root is replaced, every lower candidate is subsumed
    result, warned = record(lambda: swap.apply(model, [CANDIDATES[RMS], CANDIDATES[LAYER], CANDIDATES[MODEL]]))
    assert result.active == {"": MODEL}
    assert type(result.model).__name__ == "SdpaCausalLM" and result.model is not model
    assert {s.higher_path for s in result.subsumed} == {""}
    assert {s.lower for s in result.subsumed} == {RMS, LAYER}
    assert len(warned) == 1 and str(warned[0].message).startswith(f"{MODEL} replaces <root>,")
    with torch.inference_mode():
        torch.testing.assert_close(result.model(tokens, positions), want, rtol=1e-5, atol=1e-5)


def test_swap_inside_kb_nano_decoder_layer_reaches_the_transformers_module():
    torch.manual_seed(0)
    layer = DecoderLayer({**SMALL, "model_type": "llama", "hidden_act": "silu"}, tp_size=2)
    randomize_constant_parameters(layer, seed=2)
    x = torch.randn(5, SMALL["hidden_size"], generator=torch.Generator().manual_seed(6))
    pos = torch.arange(5)
    with torch.inference_mode():
        want = layer(x, pos)
    result = swap.apply(layer, [CANDIDATES[RMS]])
    assert result.active == {"input_layernorm": RMS, "post_attention_layernorm": RMS}
    assert layer._inner.input_layernorm is layer.input_layernorm  # what forward calls
    assert type(layer._inner.input_layernorm).__name__ == "FusedRMSNorm"
    with torch.inference_mode():
        torch.testing.assert_close(layer(x, pos), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- kb-nano L1 baselines


class Block(nn.Module):
    """kb-nano's L1 baselines wired together (vLLM calling conventions)."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(64, eps=1e-6)
        self.act = SiluAndMul()
        self.rotary = RotaryEmbedding(16, 16, 128, 10000.0, True, "float32")

    def forward(self, x, positions):
        q, _ = self.rotary(positions, self.norm(x))
        return self.act(torch.cat((q, q), dim=-1))


def test_kb_nano_baselines_are_matched():
    torch.manual_seed(0)
    block = Block()
    randomize_constant_parameters(block, seed=3)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(7))
    pos = torch.tensor([0, 5, 9, 100, 127, 3])
    with torch.no_grad():
        want = block(x, pos)
    chosen = [CANDIDATES[c] for c in ("rms_norm/torch_fused", "silu_and_mul/inplace", "rotary_embedding/rotate_half")]
    result, warned = record(lambda: swap.apply(block, chosen))
    assert not warned
    assert result.active == {
        "norm": "rms_norm/torch_fused",
        "act": "silu_and_mul/inplace",
        "rotary": "rotary_embedding/rotate_half",
    }
    assert type(block.rotary).__name__ == "RotateHalfRotaryEmbedding" and block.rotary.head_size == 16
    with torch.no_grad():
        torch.testing.assert_close(block(x, pos), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- table and errors


def test_table_ignores_absent_targets_and_classes():
    table = [
        Match("kb_nano.operators.norms:RMSNorm", "rms_norm", lambda m: {}),
        Match("kb_nano.operators.norms:RMSNorm", "not_a_target", lambda m: {}),
        Match("no.such.module:Thing", "silu_and_mul", lambda m: {}),
    ]
    rows = active_matches(table)
    assert list(rows) == [RMSNorm] and rows[RMSNorm].target == "rms_norm"
    # the default table: every row's target is registered and its class importable
    for cls, row in active_matches().items():
        assert row.target in operators.CATALOG and isinstance(cls, type)
    targets = {row.target for row in active_matches().values()}
    assert {"rms_norm", "silu_and_mul", "rotary_embedding", "embedding", "decoder_layer", "model"} <= targets
    # a candidate whose target matches nothing is simply not active
    result = swap.apply(nn.Sequential(nn.Linear(4, 4)), [CANDIDATES[RMS]])
    assert result.active == {} and result.subsumed == []


def test_errors():
    model = hf_llama()
    rms = load_class(CANDIDATES[RMS].path, "rms_norm")
    with pytest.raises(SwapError, match="two candidates for target rms_norm"):
        swap.apply(model, [("rms_norm/a", rms), ("rms_norm/b", rms)])
    with pytest.raises(KbNanoError, match="unknown target 'rmsnorm'"):
        swap.apply(model, [("rmsnorm/a", rms)])

    class WrongKeys(nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(hidden_size))

    with pytest.raises(SwapError, match=r"rms_norm/wrong at model.layers.0.input_layernorm: state_dict does not match"):
        swap.apply(model, [("rms_norm/wrong", WrongKeys)])


def test_decoder_layer_adapter_refuses_cache_and_padding():
    model = hf_llama()
    swap.apply(model, [CANDIDATES[LAYER]])
    x = ids(batch=2, seq=4)
    with torch.inference_mode(), pytest.raises(NotImplementedError, match="KV cache"):
        model(input_ids=x, use_cache=True)
    padding = torch.ones(2, 4, dtype=torch.long)
    padding[0, 0] = 0
    with torch.inference_mode(), pytest.raises(NotImplementedError, match="causal mask without padding"):
        model(input_ids=x, attention_mask=padding, use_cache=False)


def test_bf16_model_keeps_dtype_and_device():
    model = hf_llama().to(torch.bfloat16)
    with pytest.warns(SubsumptionWarning):
        swap.apply(model, [CANDIDATES[RMS], CANDIDATES[LAYER]])
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert layer.rotary_emb.inv_freq.dtype == torch.float32
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert not layer.training
    out = logits(model, ids())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
