"""Norm semantics read from the model's own module tree: the probe, the Gemma-form
baseline against transformers, the manifest's scenarios and a candidate's declaration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kb_nano.kernels.manifest import generate
from kb_nano.kernels.measure import measure_once
from kb_nano.models.configs import config_fields, resolve
from kb_nano.models.module_tree import read
from kb_nano.models.norm_tree import hidden_norm
from kb_nano.operators.norms import RMSNorm

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
TINY.update(num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-6)


@pytest.mark.parametrize(
    ("key", "cls", "offset"),
    [("llama31-8b", "LlamaRMSNorm", 0.0), ("gemma2-2b", "Gemma2RMSNorm", 1.0), ("qwen3-8b", "Qwen3RMSNorm", 0.0)],
)
def test_the_norm_form_comes_from_the_models_own_module(key, cls, offset):
    fields = config_fields(resolve(key, REPO), REPO)
    got = read(fields)["hidden_norm"]
    assert got == {"class": cls, "weight_offset": offset, "reason": None, "eps": fields["rms_norm_eps"]}


def test_gemma3_and_an_unseen_layernorm_model_are_read_not_assumed():
    # Gemma-3 (not vendored): the (1 + w) form is found in Gemma3RMSNorm itself; Phi-MoE
    # normalises with LayerNorm: no RMSNorm form stands in for it
    gemma3 = hidden_norm({"model_type": "gemma3_text", "head_dim": 16, **TINY})
    assert gemma3 == {"class": "Gemma3RMSNorm", "weight_offset": 1.0, "reason": None, "eps": 1e-6}
    phimoe = hidden_norm({"model_type": "phimoe", "num_local_experts": 2, "num_experts_per_tok": 1, **TINY})
    assert phimoe["weight_offset"] is None and phimoe["reason"].startswith("not covered: the model has no RMSNorm")
    assert "LayerNorm" in phimoe["reason"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_form_baseline_equals_transformers_gemma2_rmsnorm(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(0)
    ref = Gemma2RMSNorm(256, eps=1e-6)
    ours = RMSNorm(256, eps=1e-6, weight_offset=1.0)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(256, generator=gen) * 0.5)
        ours.weight.copy_(ref.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = torch.randn(8, 256, generator=gen).to(dtype)
    x[3] = 0  # an all-zero row
    x[5] *= 1e-3  # variance near eps
    residual = torch.randn(8, 256, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        out, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(out, ref(x + residual))
        assert not torch.allclose(RMSNorm(256, eps=1e-6).to(dtype)(x).float(), ref(x).float(), atol=0.1)


def test_gemma_models_get_gemma_scenarios_and_llama_ones_stay_as_they_were():
    m = generate(["gemma2-2b", "llama31-8b"], [1], [64], "auto", REPO, targets=["rms_norm", "fused_add_rms_norm"])
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    gemma = by_id["rms_norm__gemma2-2b__tp1__n64__gemma"]
    assert gemma["semantics"] == "gemma" and gemma["init_args"]["weight_offset"] == 1.0
    assert "fused_add_rms_norm__gemma2-2b__tp1__n64__gemma" in by_id
    llama = by_id["rms_norm__llama31-8b__tp1__n64"]
    assert "semantics" not in llama and llama["init_args"] == {"hidden_size": 4096, "eps": 1e-5}
    assert m["models"]["gemma2-2b"]["hidden_norm"]["class"] == "Gemma2RMSNorm"


GEMMA_CANDIDATE = """
import torch
from torch import nn


class GemmaNorm(nn.Module):
    supported_semantics = ({semantics})

    def __init__(self, hidden_size, eps=1e-6, weight_offset=0.0):
        super().__init__()
        self.eps, self.offset = eps, {offset}
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, residual=None):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).to(x.dtype)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("semantics", "offset", "status"),
    [("'gemma',", "weight_offset", "passed"), ("", "weight_offset", "skipped"), ("'gemma',", "0.0", "incorrect")],
)
def test_a_candidate_runs_gemma_scenarios_only_when_it_declares_them(tmp_path, semantics, offset, status):
    m = generate(["gemma2-2b"], [1], [4], "auto", REPO, targets=["rms_norm"])
    (scenario,) = m["scenarios"]
    path = tmp_path / "gemma_norm.py"
    path.write_text(GEMMA_CANDIDATE.replace("{semantics}", semantics).replace("{offset}", offset))
    settings = {"device": "cpu", "atol": None, "rtol": None, "num_warmup": 1, "num_runs": 3, "num_threads": 1}
    row = measure_once(scenario, "rms_norm/gemma_norm", path, {**settings, "timeout_s": 120}, REPO)
    assert row["status"] == status, row["error"]
    if status == "skipped":
        assert "supported_semantics" in row["error"] and "1 + weight" in row["error"]


def test_attention_layer_kinds_come_from_each_layers_module():
    gemma = read(config_fields(resolve("gemma2-2b", REPO), REPO))["attention_layers"]
    assert gemma == {
        "kinds": [
            {"scale": 0.0625, "sliding_window": 4096, "logits_soft_cap": 50.0, "sinks": False, "layers": 13},
            {"scale": 0.0625, "sliding_window": None, "logits_soft_cap": 50.0, "sinks": False, "layers": 13},
        ],
        "reason": None,
    }
    llama = read(config_fields(resolve("llama31-8b", REPO), REPO))["attention_layers"]
    assert [k["sliding_window"] for k in llama["kinds"]] == [None] and llama["kinds"][0]["layers"] == 32
    # attention sinks (gpt-oss) are part of each kind (probed: tests/models/test_attention_sinks.py)
    oss = read({"model_type": "gpt_oss", "head_dim": 16, "num_local_experts": 2, **TINY})["attention_layers"]
    assert oss["reason"] is None and [(k["sliding_window"], k["sinks"]) for k in oss["kinds"]] == [
        (128, True),
        (None, True),
    ]


def _reference(q, k, v, scale, cap, window, positions_q, n_keys):
    """transformers' Gemma-2 eager attention with its sliding-window causal mask."""
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    allowed = sliding_window_causal_mask_function(window) if window else causal_mask_function
    zero = torch.tensor(0)
    mask = allowed(zero, zero, torch.tensor(list(positions_q))[:, None], torch.arange(n_keys)[None, :])
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, head_dim=q.shape[-1])
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=scale, softcap=cap)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_attention_baseline_equals_transformers_gemma2_with_window_and_cap(window):
    from kb_nano.operators.attention import Attention

    gen = torch.Generator().manual_seed(0)
    h, kv, d, n, scale, cap = 4, 2, 16, 12, 0.25, 5.0
    att = Attention(h, d, scale, kv, cap, per_layer_sliding_window=window)
    q, k, v = (torch.randn(n, w * d, generator=gen) * 2 for w in (h, kv, kv))
    ours = att(q, k, v)
    ref = _reference(
        q.view(1, n, h, d).transpose(1, 2),
        k.view(1, n, kv, d).transpose(1, 2),
        v.view(1, n, kv, d).transpose(1, 2),
        scale,
        cap,
        window,
        range(n),
        n,
    )
    torch.testing.assert_close(ours, ref.reshape(n, h * d), rtol=1e-5, atol=1e-5)
    # decode: each of n sequences has ctx cached keys; its new token sits at position ctx
    ctx = 9
    kc, vc = (torch.randn(n, ctx, kv, d, generator=gen) * 2 for _ in range(2))
    ours = att(q, k, v, kc, vc)
    keys = torch.cat((kc, k.view(n, 1, kv, d)), 1).transpose(1, 2)
    values = torch.cat((vc, v.view(n, 1, kv, d)), 1).transpose(1, 2)
    ref = _reference(q.view(n, 1, h, d).transpose(1, 2), keys, values, scale, cap, window, [ctx], ctx + 1)
    torch.testing.assert_close(ours, ref.reshape(n, h * d), rtol=1e-5, atol=1e-5)


def test_gemma_attention_scenarios_make_the_cap_and_the_window_bind():
    from kb_nano.kernels.inputs import make_inputs
    from kb_nano.operators.attention import Attention

    m = generate(["gemma2-2b"], [1], [4], "auto", REPO, targets=["attention"], context_lens=[16])
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    assert sorted(by_id) == sorted(
        f"attention__gemma2-2b__tp1__n4{ctx}__{kind}"
        for ctx in ("", "__ctx16", "__ctx8191")
        for kind in ("sliding4096", "full")
    )
    sliding = by_id["attention__gemma2-2b__tp1__n4__ctx8191__sliding4096"]
    assert sliding["semantics"] == "sliding_window" and sliding["init_args"]["per_layer_sliding_window"] == 4096
    assert "semantics" not in by_id["attention__gemma2-2b__tp1__n4__ctx8191__full"]
    values, _ = make_inputs(sliding, torch.Generator().manual_seed(0), "cpu", None, REPO, draw=0)
    args = sliding["init_args"]
    with torch.no_grad():
        ref = Attention(**args)(*values).float()
        for wrong in ({**args, "logits_soft_cap": None}, {**args, "per_layer_sliding_window": None}):
            out = Attention(**wrong)(*values).float()
            assert ((out - ref).abs() - (2e-2 + 1e-2 * ref.abs())).max() > 0.1  # beyond the tolerance


def test_gemma3_q_k_norms_are_found_in_its_attention_and_measured_in_gemma_form(tmp_path):
    import json

    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from kb_nano.operators.norms import QKNorm

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "head_dim": 16, **TINY})
    )
    m = generate([str(tmp_path)], [1], [4], "auto", REPO, targets=["qk_norm", "rms_norm"])
    (qk,) = [s for s in m["scenarios"] if s["target"] == "qk_norm"]
    assert qk["scenario_id"].endswith("__gemma") and qk["init_args"]["weight_offset"] == 1.0
    gen = torch.Generator().manual_seed(0)
    ours, ref = QKNorm(4, 2, 16, 1e-6, weight_offset=1.0), Gemma3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, generator=gen))
        ours.q_norm.weight.copy_(ref.weight)
        ours.k_norm.weight.copy_(ref.weight)
        q, k = torch.randn(3, 64, generator=gen), torch.randn(3, 32, generator=gen)
        got_q, got_k = ours(q, k)
        torch.testing.assert_close(got_q, ref(q.view(3, 4, 16)).view(3, 64))
        torch.testing.assert_close(got_k, ref(k.view(3, 2, 16)).view(3, 32))
    # no q/k norm in Llama's attention: qk_norm does not apply (read from the tree, not the model type)
    llama = generate(["llama31-8b"], [1], [4], "auto", REPO, targets=["qk_norm"])
    assert llama["scenarios"][0]["applicable"] is False


OUTSIDE_LLAMA = ("gemma3-4b", "deepseek-v3", "gpt-oss-20b", "llama4-scout", "phi35-moe")


def test_each_vendored_architecture_is_measured_in_its_own_form_or_not_covered():
    m = generate(list(OUTSIDE_LLAMA) + ["mixtral-8x7b"], [1], [4], "auto", REPO, context_lens=[16])
    rows = {s["scenario_id"]: s for s in m["scenarios"]}

    def reason(sid):
        assert not rows[sid]["applicable"], sid
        return rows[sid]["reason"]

    def shapes(sid):
        assert rows[sid]["applicable"], rows[sid]["reason"]
        return [i["shape"] for i in rows[sid]["inputs"]]

    # DeepSeek-V3: the dense layers' MLP and MLA (its own kind) are measured; its MoE block is
    # measured with its own semantics (grouped sigmoid top-k, bias, scaling, shared experts)
    assert rows["mlp__deepseek-v3__tp1__n4"]["init_args"]["intermediate_size"] == 18432
    assert shapes("silu_and_mul__deepseek-v3__tp1__n4") == [[4, 2 * 18432]]
    assert shapes("attention__deepseek-v3__tp1__n4__mla") == [[4, 128, 192], [4, 128, 192], [4, 128, 128]]
    assert shapes("attention__deepseek-v3__tp1__n4__ctx16__mla") == [[4, 128, 576], [4, 17, 576]]
    moe = rows["fused_moe__deepseek-v3__tp1__n4__deepseek_v3"]
    assert moe["semantics"] == "deepseek_v3" and shapes(moe["scenario_id"]) == [[4, 7168], [4, 256]]
    assert {k: moe["init_args"][k] for k in ("num_expert_group", "topk_group", "scoring_func")} == {
        "num_expert_group": 8,
        "topk_group": 4,
        "scoring_func": "sigmoid",
    }
    assert moe["init_args"]["routed_scaling_factor"] == 2.5 and moe["init_args"]["e_score_correction_bias"]
    assert m["models"]["deepseek-v3"]["mlp_blocks"]["moe"] == {
        "class": "DeepseekV3MoE",
        "semantics": "deepseek_v3",
        "reason": None,
        "experts": {"act": "silu", "bias": False},
    }
    # gpt-oss: attention with sinks per layer kind; its MoE block measured with its own
    # semantics (biased experts, clamped SwiGLU read from the experts module), that activation
    # as swigluoai_and_mul (num_tokens * top_k rows); no stand-in silu_and_mul
    assert rows["attention__gpt-oss-20b__tp1__n4__sliding128"]["semantics"] == "sliding_window+sinks"
    assert shapes("attention__gpt-oss-20b__tp1__n4__full") == [[4, 64 * 64], [4, 8 * 64], [4, 8 * 64]]
    assert reason("silu_and_mul__gpt-oss-20b__tp1__n4") == "GptOssForCausalLM does not use silu_and_mul"
    assert shapes("swigluoai_and_mul__gpt-oss-20b__tp1__n4") == [[16, 2 * 2880]]
    oss = rows["fused_moe__gpt-oss-20b__tp1__n4__gpt_oss"]
    assert oss["semantics"] == "gpt_oss" and shapes(oss["scenario_id"]) == [[4, 2880], [4, 32]]
    assert {k: oss["init_args"][k] for k in ("activation", "has_bias", "swiglu_alpha", "swiglu_limit")} == {
        "activation": "swigluoai",
        "has_bias": True,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    }
    assert m["models"]["gpt-oss-20b"]["mlp_blocks"]["moe"]["experts"]["act"] == "swigluoai"
    # Llama-4: its rotation by interleaved pairs (vLLM is_neox_style=False); its MoE block is
    # measured with its own semantics (the top-1 sigmoid weight on the expert's input, the shared
    # expert), silu_and_mul as its experts' activation
    pairs = rows["rotary_embedding__llama4-scout__tp1__n4__interleaved"]
    assert pairs["semantics"] == "interleaved" and pairs["init_args"]["is_neox_style"] is False
    assert shapes(pairs["scenario_id"]) == [[4], [4, 40 * 128], [4, 8 * 128]]
    # ... its attention: chunked layers (with rotation) and full ones, a decode long enough for the chunks
    assert rows["attention__llama4-scout__tp1__n4__ctx12288__chunked8192"]["semantics"] == "chunked_attention"
    assert shapes("attention__llama4-scout__tp1__n4__full") == [[4, 40 * 128], [4, 8 * 128], [4, 8 * 128]]
    assert rows["qk_norm__llama4-scout__tp1__n4__no_weight"]["init_args"]["has_weight"] is False
    # rotary: gpt-oss's yarn and Phi-3.5-MoE's longrope are measured with their scaling;
    # Gemma-3's per-layer-type rope is one kind per layer type; DeepSeek-V3's MLA turns the rope
    # slice of each query head and one shared key head, by pairs
    assert rows["rotary_embedding__gpt-oss-20b__tp1__n4"]["init_args"]["rope_scaling"]["rope_type"] == "yarn"
    assert shapes("rotary_embedding__gpt-oss-20b__tp1__n4") == [[4], [4, 64 * 64], [4, 8 * 64]]
    assert rows["rotary_embedding__phi35-moe__tp1__n4"]["init_args"]["rope_scaling"]["rope_type"] == "longrope"
    assert shapes("rotary_embedding__deepseek-v3__tp1__n4__interleaved") == [[4], [4, 128 * 64], [4, 64]]
    full = rows["rotary_embedding__gemma3-4b__tp1__n4__full"]["init_args"]
    assert full["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and full["base"] == 1e6
    assert rows["rotary_embedding__gemma3-4b__tp1__n4__sliding1024"]["init_args"]["base"] == 1e4
    llama4 = rows["fused_moe__llama4-scout__tp1__n4__llama4"]
    assert llama4["semantics"] == "llama4" and shapes(llama4["scenario_id"]) == [[4, 5120], [4, 16]]
    assert llama4["init_args"]["apply_router_weight_on_input"] and llama4["init_args"]["scoring_func"] == "sigmoid"
    assert llama4["init_args"]["shared_experts_intermediate_size"] == 8192
    assert shapes("silu_and_mul__llama4-scout__tp1__n4") == [[4, 2 * 8192]]
    # Phi-3.5-MoE normalises with LayerNorm (layer_norm, no stand-in rms_norm); its MoE block is
    # measured with its own semantics (sparsemixer top-2 routing), silu_and_mul as its experts'
    # activation
    assert reason("rms_norm__phi35-moe__tp1__n4") == "PhiMoEForCausalLM does not use rms_norm"
    assert shapes("layer_norm__phi35-moe__tp1__n4") == [[4, 4096]]
    phi = rows["fused_moe__phi35-moe__tp1__n4__phimoe"]
    assert phi["semantics"] == "phimoe" and shapes(phi["scenario_id"]) == [[4, 4096], [4, 16]]
    assert {k: phi["init_args"][k] for k in ("custom_routing_function", "jitter_eps", "renormalize", "top_k")} == {
        "custom_routing_function": "sparsemixer",
        "jitter_eps": 0.01,
        "renormalize": False,
        "top_k": 2,
    }
    assert shapes("silu_and_mul__phi35-moe__tp1__n4") == [[8, 2 * 6400]]
    # Gemma-3 (multimodal file: its text decoder): gemma-form norms, sliding and full layers
    assert rows["qk_norm__gemma3-4b__tp1__n4__gemma"]["init_args"]["weight_offset"] == 1.0
    assert {"attention__gemma3-4b__tp1__n4__sliding1024", "attention__gemma3-4b__tp1__n4__full"} <= set(rows)
    # Mixtral: the experts' activation, num_tokens * top_k rows of one expert's width
    assert shapes("silu_and_mul__mixtral-8x7b__tp1__n4") == [[8, 2 * 14336]]
    for s in m["scenarios"]:  # every scenario is measured or says why not
        assert s["applicable"] or s["reason"], s["scenario_id"]


@pytest.mark.slow
def test_a_cpu_sweep_over_other_architectures_measures_or_says_not_covered(tmp_path):
    import json

    from workflow_helpers import copy_workflow, kb_nano

    work = copy_workflow(tmp_path)
    proc = kb_nano(
        work,
        *(
            "kernels",
            "--target",
            "rms_norm",
            "qk_norm",
            "layer_norm",
            "--model",
            "gemma3-4b",
            "phi35-moe",
            "qwen3-30b-a3b",
            "llama4-scout",
        ),
        *("--tp", "1", "--num-tokens", "1", "--all-rows"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {
        (r["scenario_id"], r["candidate"]): r for r in json.loads((work / "results/kernels.json").read_text())["rows"]
    }
    # Llama-form candidates are skipped on Gemma-form norms, with the reason
    gemma = rows[("rms_norm__gemma3-4b__tp1__n1__gemma", "rms_norm/torch_fused")]
    assert gemma["status"] == "skipped" and "supported_semantics" in gemma["error"]
    assert rows[("qk_norm__gemma3-4b__tp1__n1__gemma", "qk_norm/fused_rms")]["status"] == "skipped"
    # Phi-3.5-MoE's LayerNorm is measured as layer_norm; no RMSNorm stand-in
    phi = [r for (sid, _), r in rows.items() if sid == "rms_norm__phi35-moe__tp1__n1"]
    assert phi and all(r["status"] == "skipped" and "does not use rms_norm" in r["error"] for r in phi)
    assert rows[("layer_norm__phi35-moe__tp1__n1", "layer_norm/var_mean_fp32")]["status"] == "passed"
    # the Llama-form model still passes; Llama-4's weightless q/k norm passes with a candidate declaring it
    assert rows[("rms_norm__qwen3-30b-a3b__tp1__n1", "rms_norm/torch_fused")]["status"] == "passed"
    assert rows[("qk_norm__llama4-scout__tp1__n1__no_weight", "qk_norm/fused_rms")]["status"] == "passed"


def test_rotates_halves_probes_the_rotation_not_its_name():
    """transformers' ``rotate_half`` form and gpt-oss's halves (half-width cos/sin, no
    ``rotate_half`` in its file) both rotate by halves; interleaved pairs do not."""
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama

    from kb_nano.models.module_tree import rotates_halves

    def interleaved(q, k, cos, sin):
        def turn(x):
            c, s = cos[:, None, :, ::2], sin[:, None, :, ::2]
            x1, x2 = x[..., ::2], x[..., 1::2]
            return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)

        return turn(q), turn(k)

    assert not hasattr(modeling_gpt_oss, "rotate_half")
    assert rotates_halves(modeling_llama.apply_rotary_pos_emb)
    assert rotates_halves(modeling_gpt_oss.apply_rotary_pos_emb)
    assert not rotates_halves(interleaved)
    assert not rotates_halves(None)


def test_a_config_transformers_cannot_build_is_not_covered_with_the_reason(tmp_path):
    """A field the model's constructor rejects (``pad_token_id`` outside the vocabulary)
    gives ``not covered`` rows naming it, not a traceback from the manifest."""
    import json

    from kb_nano.models.configs import config_fields, resolve

    fields = config_fields(resolve("llama32-1b", REPO), REPO)
    (tmp_path / "config.json").write_text(json.dumps({**fields, "pad_token_id": fields["vocab_size"] + 5}))
    m = generate([str(tmp_path)], [1], [1], "auto", REPO, targets=["rms_norm", "decoder_layer"])
    for s in m["scenarios"]:
        assert not s["applicable"], s["scenario_id"]
        assert (
            "transformers cannot build LlamaConfig's model from this config (AssertionError: Padding_idx" in s["reason"]
        )


def test_a_q_k_norm_over_the_whole_projection_is_not_covered():
    """Olmo-2 normalises q and k over all heads at once (weights [heads * head_dim]): not
    kb-nano's per-head ``qk_norm``, so not covered rather than measured per head."""
    from transformers import Olmo2Config

    fields = Olmo2Config(**TINY, pad_token_id=None).to_dict()
    got = read(fields)["qk_norm"]
    assert got["weight_offset"] is None and "whole q/k projection" in got["reason"]
    assert "(weights [64] and [32])" in got["reason"]
    from transformers import CohereConfig

    cohere = read(CohereConfig(**TINY, use_qk_norm=True, pad_token_id=None).to_dict())["qk_norm"]
    assert "a weight of its own for each head (weights [4, 16] and [2, 16])" in cohere["reason"]


def test_fused_add_rms_norm_only_where_the_residual_is_added_before_the_norm():
    """Llama's layers add the residual and then normalise (vLLM's fused_add_rms_norm);
    Olmo-2's normalise each sublayer's output and add the residual after it (no fused add:
    the operator does not apply); Granite scales the sublayer's output before the add
    (``residual_multiplier``: not covered)."""
    from transformers import GraniteConfig, LlamaConfig, Olmo2Config

    from kb_nano import operators
    from kb_nano.operators.base import NotApplicable

    op = operators.get("fused_add_rms_norm")
    llama = read(LlamaConfig(**TINY).to_dict())
    assert llama["residual_add"] == {"form": "pre_norm", "reason": None} and op.applies_to({**TINY, **llama})
    olmo = read(Olmo2Config(**TINY, pad_token_id=None).to_dict())
    assert olmo["residual_add"]["form"] == "post_norm" and "no input_layernorm" in olmo["residual_add"]["reason"]
    assert not op.applies_to({**TINY, **olmo})
    granite = read(GraniteConfig(**TINY, residual_multiplier=0.22).to_dict())
    assert granite["residual_add"]["form"] == "scaled" and op.applies_to({**TINY, **granite})
    with pytest.raises(NotApplicable, match=r"residual_multiplier, 0.22\)"):
        op.init_args({**TINY, **granite}, 1)
    from transformers import CONFIG_MAPPING

    minicpm3 = read(CONFIG_MAPPING["minicpm3"](num_hidden_layers=2).to_dict())  # residual + h * scale_depth / sqrt(L)
    assert minicpm3["residual_add"]["form"] == "scaled" and "scale_depth" in minicpm3["residual_add"]["reason"]


def test_a_layernorm_subclass_with_its_own_forward_is_not_covered():
    """Nemotron's ``LayerNorm1P`` (an ``nn.LayerNorm`` subclass scaling by ``weight + 1``)
    is probed, not taken for ``F.layer_norm``."""
    from transformers import NemotronConfig

    got = read(NemotronConfig(**TINY, norm_eps=1e-5, pad_token_id=None).to_dict())["layer_norm"]
    assert got["class"] == "NemotronLayerNorm1P" and "computes something else" in got["reason"]


def test_a_config_with_read_only_fields_or_no_layers_list_is_not_covered_not_a_crash():
    """Falcon's ``head_dim`` is a read-only property and its decoder layers are
    ``transformer.h``: one rank's config at tp 2 and the decoder layer say ``not covered``."""
    from transformers import FalconConfig

    from kb_nano import operators
    from kb_nano.operators.base import NotApplicable
    from kb_nano.operators.hf_modules import hf_config

    fields = FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128).to_dict()
    assert hf_config(dict(fields), tp_size=1).head_dim == 16
    with pytest.raises(NotApplicable, match="head_dim is read-only"):
        hf_config(dict(fields), tp_size=2)
    facts = {"hf_config": fields, "model_type": "falcon", "num_attention_heads": 4, "num_key_value_heads": 4}
    with pytest.raises(NotApplicable, match="no `layers` list"):
        operators.get("decoder_layer").init_args({**facts, "hidden_size": 64, "dtype": "float32"}, 1)


def test_fused_qkv_attention_modules_are_read_with_their_own_kv_heads_and_norms():
    """GPT-NeoX (``layers.<i>.attention``) and Falcon (``h.<i>.self_attention``) fuse q, k
    and v in ``query_key_value``: their attention is measured, with the KV heads the module
    computes with (Falcon keeps 2 of 4 in ``num_kv_heads``, not in a
    ``num_key_value_heads`` config field: read as 4 before) and its scale; Falcon's
    LayerNorms (``h.<i>.ln_attn``, ``ln_f``) are found; ALiBi is not covered."""
    from transformers import FalconConfig, GPTNeoXConfig

    falcon = FalconConfig(
        hidden_size=64, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True, num_hidden_layers=2
    )
    got = read(falcon.to_dict())
    assert got["num_key_value_heads"] == 2
    assert got["attention_layers"]["reason"] is None
    assert [(k["scale"], k["layers"]) for k in got["attention_layers"]["kinds"]] == [(0.25, 2)]
    assert got["layer_norm"] == {"class": "LayerNorm", "eps": 1e-5, "bias": True}
    multi_query = read(FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2).to_dict())
    assert multi_query["num_key_value_heads"] == 1  # Falcon-7B's multi-query attention
    alibi = read(FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True).to_dict())
    assert "ALiBi" in alibi["attention_layers"]["reason"]
    neox = read(
        GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2).to_dict()
    )
    assert "num_key_value_heads" not in neox  # the config's (4: multi-head)
    assert [(k["scale"], k["layers"]) for k in neox["attention_layers"]["kinds"]] == [(0.25, 2)]


def test_what_unseen_architectures_compute_is_read_not_assumed():
    """Semantics of configs outside the vendored set, each once measured wrong or a
    traceback: Bloom's ALiBi (not covered); DeepSeek-V3.2's MLA rotates interleaved pairs
    although its config has no ``rope_interleave``; MiMo-V2-Flash's values are narrower than
    its keys (not covered); Laguna rotates part of each head on its full layers only (the
    layer type's own ``partial_rotary_factor``); Jamba has no rotary module and a Mamba
    layer 0 (rotary and decoder_layer not covered, no traceback from its read-only
    ``layer_types``); OPT-350m's embedding and lm_head are narrower than hidden_size."""
    from transformers import CONFIG_MAPPING, BloomConfig, DeepseekV32Config, JambaConfig

    from kb_nano import operators
    from kb_nano.operators.base import NotApplicable

    bloom = read(BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=100).to_dict())
    assert "ALiBi" in bloom["attention_layers"]["reason"]
    v32 = DeepseekV32Config(
        num_hidden_layers=2, hidden_size=256, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=100, n_routed_experts=4,
    )  # fmt: skip
    turn = read(v32.to_dict())["rotary"]
    assert turn["neox"] is False and turn["reason"] is None  # interleaved pairs
    mimo = read(CONFIG_MAPPING["mimo_v2_flash"](num_hidden_layers=4).to_dict())
    assert "values of 128 per head and queries/keys of 192" in mimo["attention_layers"]["reason"]
    laguna = CONFIG_MAPPING["laguna"](num_hidden_layers=4).to_dict()
    facts = {"hf_config": laguna, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 128}
    facts |= {"partial_rotary_factor": 1.0, "max_position_embeddings": 4096, "dtype": "float32", **read(laguna)}
    op = operators.get("rotary_embedding")
    facts["rope"] = laguna["rope_parameters"]
    dims = {kind: op.init_args({**facts, **over}, 1)["rotary_dim"] for kind, over in op.layer_kinds(facts)}
    assert dims == {"full": 64, "sliding512": 128}
    jamba = JambaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=100, num_experts=4,
    ).to_dict()  # fmt: skip
    got = read(jamba)
    assert got["rotary_module"] is False
    with pytest.raises(NotApplicable, match="no rotary_emb module"):
        op.init_args({**facts, **got, "rope": {"rope_theta": 1e4}}, 1)
    from transformers import OPTConfig

    opt = read(OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                         vocab_size=100, word_embed_proj_dim=32).to_dict())  # fmt: skip
    opt_facts = {**opt, "vocab_size": 100, "hidden_size": 64, "dtype": "float32"}
    assert operators.get("embedding").init_args(opt_facts, 1)["embedding_dim"] == 32  # OPT-350m's narrow rows
    assert operators.get("lm_head").init_args(opt_facts, 1)["embedding_dim"] == 32
    jamba_facts = {"hf_config": jamba, "model_type": "jamba", "hidden_size": 64, "dtype": "float32"}
    with pytest.raises(NotApplicable, match="not covered"):
        operators.get("decoder_layer").init_args({**jamba_facts, "num_attention_heads": 4}, 1)


def test_an_mlp_that_scales_inside_is_not_covered():
    """Falcon-H1's MLP computes ``down(up(x) * act(gate(x) * 0.9)) * 0.7`` (its
    ``mlp_multipliers``): ``mlp`` is not covered (it passed without the scales before)."""
    from transformers import CONFIG_MAPPING

    from kb_nano import operators
    from kb_nano.operators.base import NotApplicable

    fields = CONFIG_MAPPING["falcon_h1"](
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=100, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mlp_multipliers=[0.9, 0.7],
    ).to_dict()  # fmt: skip
    got = read(fields)
    assert got["mlp_blocks"]["dense"][0]["scaled"] == ["down_multiplier=0.7", "gate_multiplier=0.9"]
    facts = {**TINY, **got, "hidden_act": "silu", "dtype": "float32", "hf_config": fields}
    with pytest.raises(NotApplicable, match=r"scales inside the block \(down_multiplier=0.7"):
        operators.get("mlp").init_args(facts, 1)
