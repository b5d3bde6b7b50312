"""The shipped L3 / L4 candidates (decoder_layer/sdpa_fused, model/sdpa) against the baselines,
and the Tier-1 engine's rows for them on manifest scenarios."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from layer_model_helpers import (
    LAYER_CANDIDATE,
    MODEL_CANDIDATE,
    TINY_LLAMA,
    TINY_QWEN3,
    gen,
    perturb_norms,
)
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.candidates import load_class
from kb_nano.kernels.manifest import generate
from kb_nano.kernels.measure import measure_once as measure
from kb_nano.operators.base import tolerance_for
from kb_nano.operators.layers import (
    CausalLM,
    DecoderLayer,
)

# --------------------------------------------------------------------------- candidates


def _errors(base, cand, inputs):
    """(candidate vs bf16 baseline, bf16 baseline vs float64, candidate vs float64) max-abs errors."""
    with torch.inference_mode():
        truth = copy.deepcopy(base).double()(*[t.double() if t.is_floating_point() else t for t in inputs])
        b = copy.deepcopy(base).to(torch.bfloat16)(
            *[t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs]
        )
        c = copy.deepcopy(cand).to(torch.bfloat16)(
            *[t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs]
        )
    err = lambda x, y: float((x.double() - y.double()).abs().max())  # noqa: E731
    return err(c, b), err(b, truth), err(c, truth)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN3], ids=["llama", "qwen3"])
def test_decoder_layer_candidate_sdpa_fused(config):
    cls = load_class(LAYER_CANDIDATE, "decoder_layer")
    torch.manual_seed(0)
    base = DecoderLayer(config, tp_size=2)
    perturb_norms(base)
    cand = cls(config, tp_size=2)
    cand.load_state_dict(base.state_dict(), strict=True)
    n = 24
    x = torch.randn(n, config["hidden_size"], generator=gen(9))
    positions = torch.randint(0, config["max_position_embeddings"], (n,), generator=gen(10))
    with torch.inference_mode():
        torch.testing.assert_close(cand(x, positions), base(x, positions), rtol=1e-5, atol=1e-5)  # float32
    vs_base, base_err, cand_err = _errors(base, cand, [x, positions])
    # bf16: as accurate as the transformers module itself (both against float64)
    assert cand_err <= 1.5 * base_err + 1e-3
    atol, rtol = tolerance_for(operators.get("decoder_layer"), "bfloat16")
    assert vs_base <= atol


def test_model_candidate_sdpa():
    cls = load_class(MODEL_CANDIDATE, "model")
    torch.manual_seed(0)
    base = CausalLM(TINY_QWEN3)
    perturb_norms(base)
    cand = cls(TINY_QWEN3)
    cand.load_state_dict(base.state_dict(), strict=True)
    assert cand.hf_config._attn_implementation == "sdpa" and base.hf_config._attn_implementation == "eager"
    n = 20
    ids = torch.randint(0, TINY_QWEN3["vocab_size"], (n,), generator=gen(11))
    positions = torch.randint(0, TINY_QWEN3["max_position_embeddings"], (n,), generator=gen(12))
    with torch.inference_mode():
        torch.testing.assert_close(cand(ids, positions), base(ids, positions), rtol=1e-5, atol=1e-5)
    vs_base, base_err, cand_err = _errors(base, cand, [ids, positions])
    assert cand_err <= 1.5 * base_err + 1e-3


def test_measure_rows_for_l3_l4(tmp_path):
    """The Tier-1 engine end to end on manifest scenarios (tiny configs, real rules)."""
    cfg_dir = tmp_path / "tiny-llama"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    m = generate([str(cfg_dir)], [1, 2], [16], "auto", REPO)
    scenarios = {s["scenario_id"]: s for s in m["scenarios"] if s["level"] >= 3}
    assert sorted(scenarios) == [
        "decoder_layer__tiny-llama__tp1__n16",
        "decoder_layer__tiny-llama__tp2__n16",
        "model__tiny-llama__tp1__n16",
        "model__tiny-llama__tp2__n16",
    ]
    settings = {
        "device": "cpu",
        "atol": None,
        "rtol": None,
        "num_warmup": 1,
        "num_runs": 3,
        "num_threads": 1,
        "timeout_s": 300,
    }
    for sid, path, target in (
        ("decoder_layer__tiny-llama__tp2__n16", LAYER_CANDIDATE, "decoder_layer"),
        ("model__tiny-llama__tp1__n16", MODEL_CANDIDATE, "model"),
    ):
        row = measure(scenarios[sid], f"{target}/{path.stem}", path, settings, REPO)
        assert row["status"] == "passed", row["error"]
        assert row["baseline_ms"] > 0 and row["candidate_ms"] > 0
        assert (row["atol"], row["rtol"]) == tolerance_for(operators.get(target), "bfloat16")
    assert not scenarios["model__tiny-llama__tp2__n16"]["applicable"]
