"""Golden ``fused_moe`` inputs of MoE blocks whose router is not called ``gate``: gpt-oss's
``GptOssMLP`` (``router``, a ``GptOssTopKRouter`` returning logits, scores and indices) and
Llama-4's ``Llama4TextMoe`` (``router``, a linear layer returning scores, then logits).
A real capture (:func:`kb_nano.models.golden.capture`) of each vendored config at small
dims holds, per layer, the block's input and the router logits the ``fused_moe`` baseline
of its semantics takes; the baseline on them chooses the router's experts and reproduces
the block's output in the model run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from workflow_helpers import REPO, copy_workflow, kb_nano

from kb_nano import operators
from kb_nano.models.configs import config_fields, resolve
from kb_nano.models.golden import SEQ_LEN, build_model, capture, load_prompts, tokenize
from kb_nano.models.module_tree import read
from kb_nano.operators.base import TOLERANCES
from kb_nano.operators.moe import FusedMoE

# the vendored config with small dims (the capture keeps 2 of its decoder layers); byte
# token ids < 256 fit the vocabulary, the pad id too
SMALL = dict(hidden_size=64, intermediate_size=48, num_local_experts=8, num_attention_heads=4, head_dim=16)
SMALL.update(num_key_value_heads=2, vocab_size=300, pad_token_id=299)
PROMPTS = 4
LAYERS = 2


def _captured(tmp_path: Path, key: str, extra: dict) -> tuple[dict, dict, torch.nn.Module]:
    """(config fields, captured fused_moe tensors, the model of the capture rebuilt with
    the same weights) of the vendored model ``key`` at :data:`SMALL` dims."""
    fields = {**config_fields(resolve(key, REPO), REPO), **SMALL, **extra}
    capture(fields, {"model": key, "hub_id": None, "config_sha256": "x"}, REPO, tmp_path, num_layers=LAYERS)
    side = json.loads((tmp_path / "fused_moe.json").read_text())
    assert side["layers"] == list(range(LAYERS))
    assert sorted(side["tensors"]) == [
        f"layer{i}.{n}" for i in range(LAYERS) for n in ("hidden_states", "router_logits")
    ]
    tensors = load_file(str(tmp_path / side["file"]))
    return fields, tensors, build_model(fields, LAYERS, None, torch.bfloat16).eval()


def _blocks_io(model: torch.nn.Module, ffn: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's MoE block (child ``ffn``) in a run of ``model`` on the byte tokens of the
    shipped prompts: ``{layer: (its input, its output)}``, each ``[P*L, hidden]``."""
    ids, _ = tokenize(load_prompts(REPO)[0], 300, None)
    seen = {}

    def hook(mod, args, out, layer):
        out = out[0] if isinstance(out, tuple) else out
        seen[layer] = (args[0].reshape(-1, 64).clone(), out.reshape(-1, 64).clone())

    handles = [
        getattr(layer, ffn).register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.inference_mode():
        model(input_ids=ids, logits_to_keep=1, use_cache=False)
    for h in handles:
        h.remove()
    return seen


def _baseline(facts_of, key: str, fields: dict) -> FusedMoE:
    """The ``fused_moe`` baseline with the operator's arguments for the small config
    (its semantics read from the model's module tree), bf16."""
    facts = facts_of(key, hf_config=True)
    facts.update(read(fields), hf_config=fields, hidden_size=64, intermediate_size=48)
    args = operators.get("fused_moe").init_args(facts, 1)
    return FusedMoE(**{**args, "params_dtype": "bfloat16"})


def _close_in_row_units(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` equals ``want`` within the bf16 ``fused`` tolerance in units of each row's
    largest value (the random-weight outputs are far below the absolute tolerance)."""
    scale = want.float().abs().amax(-1, keepdim=True)
    atol, rtol = TOLERANCES["fused"]["bfloat16"]
    torch.testing.assert_close(got.float() / scale, want.float() / scale, atol=atol, rtol=rtol)


def test_gpt_oss_capture_holds_the_router_logits_of_gpt_oss_mlp(tmp_path, facts_of):
    fields, tensors, model = _captured(tmp_path, "gpt-oss-20b", {})
    ours = _baseline(facts_of, "gpt-oss-20b", fields)
    assert ours.swiglu is not None and ours.w13_bias is not None  # the gpt_oss semantics
    run = _blocks_io(model, "mlp")
    for layer in range(LAYERS):
        block = model.model.layers[layer].mlp
        assert type(block).__name__ == "GptOssMLP"
        x, logits = tensors[f"layer{layer}.hidden_states"], tensors[f"layer{layer}.router_logits"]
        assert x.shape == (PROMPTS * SEQ_LEN, 64) and logits.shape == (PROMPTS * SEQ_LEN, 8)
        assert torch.equal(x, run[layer][0])  # the block's input in the model run
        with torch.no_grad():
            want_logits, _, want_ids = block.router(x)
            # the router's logits, bias included (the baseline's router_logits: vLLM's router GEMM)
            assert torch.equal(logits, want_logits) and block.router.bias.abs().sum() > 0
            ours.w13_weight.copy_(block.experts.gate_up_proj.transpose(1, 2))
            ours.w13_bias.copy_(block.experts.gate_up_proj_bias)
            ours.w2_weight.copy_(block.experts.down_proj.transpose(1, 2))
            ours.w2_bias.copy_(block.experts.down_proj_bias)
            got = ours(x.clone(), logits)
            assert torch.equal(ours.select_experts(logits)[1], want_ids)  # the same experts, in order
            # without the router's bias the routing differs: the check can fail
            unbiased = ours.select_experts(F.linear(x, block.router.weight))[1]
        assert not torch.equal(unbiased, want_ids)
        _close_in_row_units(got, run[layer][1])


def test_llama4_capture_holds_the_router_logits_not_the_scores(tmp_path, facts_of):
    fields, tensors, model = _captured(tmp_path, "llama4-scout", {"intermediate_size_mlp": 96})
    ours = _baseline(facts_of, "llama4-scout", fields)
    assert ours.apply_router_weight_on_input and ours.shared_experts is not None  # the llama4 semantics
    run = _blocks_io(model, "feed_forward")
    for layer in range(LAYERS):
        block = model.model.layers[layer].feed_forward
        assert type(block).__name__ == "Llama4TextMoe"
        x, logits = tensors[f"layer{layer}.hidden_states"], tensors[f"layer{layer}.router_logits"]
        assert x.shape == (PROMPTS * SEQ_LEN, 64) and logits.shape == (PROMPTS * SEQ_LEN, 8)
        assert torch.equal(x, run[layer][0])
        shared = block.shared_expert
        with torch.no_grad():
            scores, want_logits = block.router(x)
            ours.w13_weight.copy_(block.experts.gate_up_proj.transpose(1, 2))
            ours.w2_weight.copy_(block.experts.down_proj.transpose(1, 2))
            ours.shared_experts.gate_up_proj.weight.copy_(torch.cat((shared.gate_proj.weight, shared.up_proj.weight)))
            ours.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)
            got_w, got_ids = ours.select_experts(logits)
            got = ours(x.clone(), logits)
            wrong = ours(x.clone(), scores)  # the router's scores in place of its logits
        # the logits (Llama4Router's second output), which the baseline's sigmoid top-1 takes
        assert torch.equal(logits, want_logits) and not torch.equal(logits, scores)
        assert torch.equal(got_ids[:, 0], scores.argmax(-1))
        torch.testing.assert_close(got_w[:, 0].to(torch.bfloat16), scores.amax(-1), rtol=0, atol=0)
        _close_in_row_units(got, run[layer][1])
        with pytest.raises(AssertionError):
            _close_in_row_units(wrong, run[layer][1])


def test_capture_golden_of_a_multimodal_llama4_file_feeds_its_fused_moe_scenario(tmp_path):
    """The vendored Llama-4 file is multimodal (its decoder's fields in ``text_config``):
    ``capture-golden`` captures its text decoder, and the model's ``llama4`` scenario takes
    its inputs from the capture."""
    from kb_nano.kernels.manifest import generate
    from kb_nano.models.golden_inputs import golden_inputs

    work = copy_workflow(tmp_path)
    raw = json.loads((REPO / resolve("llama4-scout", REPO).config_path).read_text())
    raw["text_config"].update(SMALL, intermediate_size_mlp=96)
    (work / "tiny-llama4").mkdir()
    (work / "tiny-llama4/config.json").write_text(json.dumps(raw))
    out = kb_nano(work, "capture-golden", "--model", "tiny-llama4")
    assert out.returncode == 0, out.stderr
    assert "fused_moe of tiny-llama4 (2 of 48 layers, random weights" in out.stdout
    side = work / "results/golden/tiny-llama4/fused_moe.json"
    assert json.loads(side.read_text())["tensors"]["layer1.router_logits"]["shape"] == [PROMPTS * SEQ_LEN, 8]
    (scenario,) = generate(["tiny-llama4"], [1], [16], "auto", work, targets=["fused_moe"])["scenarios"]
    assert scenario["semantics"] == "llama4"
    got = golden_inputs(scenario, {"path": str(side)}, work, "cpu", draw=1)
    tensors = load_file(str(side.with_suffix(".safetensors")))
    rows = torch.arange(16) + 997  # the second draw: layer 1, rows from 997 on
    assert torch.equal(got["router_logits"], tensors["layer1.router_logits"][rows])
    assert torch.equal(got["hidden_states"], tensors["layer1.hidden_states"][rows])


def test_deepseek_v3_capture_records_only_its_moe_layers(tmp_path):
    """DeepSeek-V3's first layers are dense: the fused_moe file lists only the MoE layers it
    holds, so a scenario's draws read captured layers; its ``gate`` computes the logits in
    fp32, the capture holds them in the model dtype (the scenario's input dtype)."""
    from kb_nano.models.golden_inputs import golden_inputs
    from kb_nano.operators.base import normal

    small = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8, n_group=2)
    small.update(topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, num_attention_heads=4)
    small.update(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8)
    small.update(v_head_dim=16, vocab_size=300)
    fields = {**config_fields(resolve("deepseek-v3", REPO), REPO), **small}
    capture(fields, {"model": "ds", "hub_id": None, "config_sha256": "x"}, REPO, tmp_path, num_layers=LAYERS)
    side = json.loads((tmp_path / "fused_moe.json").read_text())
    assert side["layers"] == [1] and sorted(side["tensors"]) == ["layer1.hidden_states", "layer1.router_logits"]
    assert json.loads((tmp_path / "attention.json").read_text())["layers"] == [0, 1]
    tensors = load_file(str(tmp_path / side["file"]))
    x, logits = tensors["layer1.hidden_states"], tensors["layer1.router_logits"]
    gate = build_model(fields, LAYERS, None, torch.bfloat16).model.layers[1].mlp.gate
    with torch.no_grad():
        assert torch.equal(logits, F.linear(x, gate.weight))
        # bf16 vs fp32 accumulation: the two may differ by one or two bf16 ulps (2**-7 relative each)
        torch.testing.assert_close(logits, gate(x)[0].to(torch.bfloat16), atol=0, rtol=2**-6)
    specs = [normal("hidden_states", [8, 64], "bfloat16"), normal("router_logits", [8, 8], "bfloat16")]
    scenario = {"scenario_id": "fused_moe__ds", "target": "fused_moe", "init_args": {}, "inputs": specs}
    got = golden_inputs(scenario, {"path": str(tmp_path / "fused_moe.json")}, tmp_path, "cpu", draw=0)
    assert torch.equal(got["router_logits"], logits[:8])
