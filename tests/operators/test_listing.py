"""``kernels --map``'s tables and ``kernels --list``'s state_dict column (:mod:`kb_nano.operators.listing`): the baselines
built on the meta device have the keys and shapes of a real build and hold no memory, keys
of repeated layers share a line, and the example model is the first that applies."""

from __future__ import annotations

import math

import pytest
import torch
import transformers  # noqa: F401  (imported first: config_imports_only then leaves this process alone)
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.operators.layers import CausalLM, DecoderLayer
from kb_nano.operators.listing import (
    ModelExamples,
    map_tables,
    shape_text,
    state_dict_lines,
    state_dict_shapes,
    state_dict_text,
)

TINY = "config/models/kb-nano/tiny-llama"
REAL_BUILD_MAX_ELEMENTS = 50_000_000  # built for real on the CPU below this (fp32: 200 MB)


def test_meta_build_has_the_real_builds_keys_and_shapes():
    """Every operator's baseline, built on the meta device from the first model it applies
    to (tiny-llama, else a registry model), lists the state_dict of a real CPU build: same
    keys, same order, same shapes (the real build where it is small enough to make)."""
    examples = ModelExamples(REPO, [TINY], [1])
    compared = []
    for name in operators.names():
        op = operators.get(name)
        key, tp, configured, init_args = examples.first(op)
        assert configured == (key == "tiny-llama"), name
        shapes = state_dict_shapes(op, init_args)
        if sum(math.prod(s) for _, s in shapes) > REAL_BUILD_MAX_ELEMENTS:
            continue
        real = op.baseline(**init_args).state_dict()
        assert shapes == [(k, tuple(v.shape)) for k, v in real.items()], name
        compared.append(name)
    assert {"rms_norm", "qk_norm", "embedding", "mlp", "decoder_layer", "model"} <= set(compared)


def test_transformers_baselines_stay_on_the_meta_device():
    """The L3/L4 baselines built under ``torch.device("meta")`` allocate nothing: every
    state_dict tensor is a meta tensor (a real build puts them on the CPU, initialised)."""
    examples = ModelExamples(REPO, [TINY], [1])
    for cls, name in ((DecoderLayer, "decoder_layer"), (CausalLM, "model")):
        init_args = examples.first(operators.get(name))[3]
        with torch.device("meta"):
            module = cls(**init_args)
        tensors = list(module.state_dict().values())
        assert tensors and all(t.is_meta for t in tensors), name
        assert all(not t.is_meta for t in cls(**init_args).state_dict().values())


def test_first_example_is_the_first_configured_model_and_tp_that_applies():
    """The configured models at each configured TP come first; an operator no configured
    model uses takes the registry's first that does (marked not configured); ``(none)``
    for a baseline without parameters."""
    examples = ModelExamples(REPO, ["llama31-8b", "qwen3-8b"], [1, 4])
    get = operators.get
    assert examples.first(get("rms_norm"))[:3] == ("llama31-8b", 1, True)
    assert examples.first(get("qk_norm"))[:3] == ("qwen3-8b", 1, True)  # Llama has no q/k norm
    assert examples.first(get("decoder_layer"))[:3] == ("llama31-8b", 4, True)  # tp=1: too many parameters
    assert examples.first(get("fused_moe"))[:3] == ("mixtral-8x7b", 1, False)
    assert state_dict_text(get("embedding"), examples) == "of llama31-8b tp=1:\nweight [128256, 4096]"
    assert state_dict_text(get("fused_moe"), examples) == (
        "of mixtral-8x7b tp=1 (not configured):\nw13_weight [8, 28672, 4096]\nw2_weight [8, 4096, 14336]"
    )
    assert state_dict_text(get("silu_and_mul"), examples) == "(none)"
    qwen = ModelExamples(REPO, ["qwen3-8b"], [2])
    assert state_dict_text(get("embedding"), qwen) == "of qwen3-8b tp=2:\nweight [75968, 4096]"  # vocab / tp
    with pytest.raises(KbNanoError, match="tp 0: a tensor-parallel degree is a positive integer"):
        ModelExamples(REPO, ["qwen3-8b"], [0])


def test_state_dict_lines_share_a_line_across_layer_indices():
    shapes = [
        ("embed.weight", (10, 4)),
        *((f"layers.{i}.norm.weight", (4,)) for i in range(3)),
        ("layers.0.proj.weight", (8, 4)),
        ("layers.1.proj.weight", (8, 4)),
        ("layers.2.proj.weight", (6, 4)),  # another shape: its own line
        *((f"layers.{i}.experts.{e}.w", (2,)) for i in (0, 1) for e in (0, 1)),
        ("blocks.0.a.weight", (1,)),
        ("blocks.2.a.weight", (1,)),  # a gap: listed, not a range
        ("heads.0.x.1", (3,)),
        ("heads.1.x.0", (3,)),  # not every combination: one line each
    ]
    assert state_dict_lines(shapes) == [
        "embed.weight [10, 4]",
        "layers.{0..2}.norm.weight [4]",
        "layers.{0,1}.proj.weight [8, 4]",
        "layers.2.proj.weight [6, 4]",
        "layers.{0,1}.experts.{0,1}.w [2]",
        "blocks.{0,2}.a.weight [1]",
        "heads.0.x.1 [3]",
        "heads.1.x.0 [3]",
    ]
    assert state_dict_lines([]) == ["(none)"]


def _rows(table) -> dict[str, list[str]]:
    """A rich table's rows by their first cell (the target)."""
    columns = [list(c._cells) for c in table.columns]
    return {cells[0]: list(cells[1:]) for cells in zip(*columns, strict=True)}


def test_map_tables_give_each_models_operators_and_per_rank_inputs():
    """One table per configured model, in order, titled with its architecture and sizes;
    a row per operator the model uses (a dense model has no fused_moe, a Llama no
    qk_norm) with one column of per-rank input shapes per TP, the token dimension as N,
    and the operator's reason where a TP does not divide the model."""
    llama, qwen = map_tables(ModelExamples(REPO, ["llama31-8b", "qwen3-30b-a3b"], [1, 3]))
    assert llama.title.startswith("llama31-8b (meta-llama/Llama-3.1-8B-Instruct) — LlamaForCausalLM: hidden 4096")
    assert "heads 32/8 kv, head_dim 128, intermediate 14336, vocab 128256, rope llama3" in llama.title
    assert [c.header for c in llama.columns] == [
        "target",
        "level",
        "used in",
        "tp=1 per-rank inputs",
        "tp=3 per-rank inputs",
    ]
    rows = _rows(llama)
    assert "fused_moe" not in rows and "qk_norm" not in rows
    assert rows["silu_and_mul"][0] == "L1"
    assert rows["silu_and_mul"][2:] == ["x[N, 28672]", "n/a: tp=3 does not divide intermediate_size=14336"]
    assert rows["attention"][2] == "query[N, 4096], key[N, 1024], value[N, 1024]"
    moe = _rows(qwen)
    assert moe["fused_moe"][2:] == ["hidden_states[N, 2048], router_logits[N, 128]"] * 2
    assert moe["qk_norm"][2] == "q[N, 4096], k[N, 512]"


def test_map_says_how_many_layers_each_attention_kind_has():
    """A model whose layers differ (Gemma-3's sliding and global layers) shows, per kind,
    how many of its layers are of that kind; a model of one kind shows all of them."""
    (gemma,) = map_tables(ModelExamples(REPO, ["gemma3-4b"], [1]))
    rows = _rows(gemma)
    sliding = rows["attention (sliding1024, sliding_window)"][1]
    full = rows["attention (full)"][1]
    assert sliding.endswith("(29 of 34 layers)") and full.endswith("(5 of 34 layers)")
    (llama,) = map_tables(ModelExamples(REPO, ["llama31-8b"], [1]))
    assert _rows(llama)["attention"][1].endswith("(32 of 32 layers)")


def test_shape_text_names_the_token_dimension_n():
    assert shape_text({"name": "x", "shape": [64, 4096]}) == "x[N, 4096]"
    assert shape_text({"name": "positions", "shape": [1]}) == "positions[N]"
