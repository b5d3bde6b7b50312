"""The attention half of the module tree on Llama-4 Scout: its layers with rotation are
chunked-attention layers (their weightless q/k norm is the ``qk_norm`` operator's), its
layers without rotation are full attention (the temperature scaling of their queries
happens before vLLM's ``Attention``); a layer type kb-nano does not compute is still not
covered."""

from __future__ import annotations

import pytest
from workflow_helpers import REPO

from kb_nano.models import module_tree
from kb_nano.models.configs import config_fields, resolve


@pytest.fixture(scope="module")
def scout_fields():
    return config_fields(resolve("llama4-scout", REPO), REPO)


def _read(fields: dict) -> dict:
    return module_tree.read(fields)


def test_llama4_scout_has_chunked_and_full_layers_and_a_weightless_qk_norm(scout_fields):
    got = _read(dict(scout_fields))
    layers = got["attention_layers"]
    assert layers["reason"] is None
    scale = 128**-0.5
    assert layers["kinds"] == [
        {
            "scale": scale,
            "sliding_window": None,
            "attention_chunk_size": 8192,
            "logits_soft_cap": None,
            "sinks": False,
            "layers": 36,
        },
        {"scale": scale, "sliding_window": None, "logits_soft_cap": None, "sinks": False, "layers": 12},
    ]
    want = {"class": "Llama4TextL2Norm", "weight_offset": 0.0, "has_weight": False, "reason": None, "eps": 1e-5}
    assert got["qk_norm"] == want


def test_llama4_without_qk_norm_has_the_same_kinds_and_no_qk_norm(scout_fields):
    """Llama-4 Maverick's form (``use_qk_norm`` false)."""
    got = _read({**scout_fields, "use_qk_norm": False})
    assert [k["layers"] for k in got["attention_layers"]["kinds"]] == [36, 12] and got["qk_norm"] is None


def test_a_layer_type_kb_nano_does_not_compute_is_not_covered(scout_fields):
    types = ["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"] * 12
    types[5] = "compressed_sparse_attention"
    got = _read({**scout_fields, "layer_types": types})["attention_layers"]
    assert got["kinds"] == [] and "layer 5 is 'compressed_sparse_attention'" in got["reason"]


def _small(config) -> dict:
    """The fields of a transformers config (:data:`SMALL`: 2 layers, hidden 256, 4 heads of 64)."""
    return config.to_dict()


def _windows(fields: dict) -> list[tuple]:
    return [(k["sliding_window"], k["layers"]) for k in _read(fields)["attention_layers"]["kinds"]]


SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32064,  # above Phi-3's default pad_token_id
    "max_position_embeddings": 4096,
}


def test_a_window_the_forward_takes_from_the_config_is_read():
    """Mistral's, Phi-3's and Starcoder2's attention modules pass their config's
    ``sliding_window`` on every layer (no attribute of their own): the layers are sliding;
    a window of at least ``max_position_embeddings`` (Phi-3.5-MoE's mask) hides no key."""
    from transformers import MistralConfig, Phi3Config, Starcoder2Config

    assert _windows(_small(MistralConfig(**SMALL, sliding_window=64))) == [(64, 2)]
    assert _windows(_small(Phi3Config(**SMALL, sliding_window=64))) == [(64, 2)]
    assert _windows(_small(Starcoder2Config(**SMALL, sliding_window=64))) == [(64, 2)]
    assert _windows(_small(MistralConfig(**SMALL, sliding_window=None))) == [(None, 2)]
    assert _windows(_small(MistralConfig(**SMALL, sliding_window=4096))) == [(None, 2)]


def test_a_window_attribute_counts_on_sliding_layers_only():
    """Exaone-4 sets ``sliding_window`` on every attention module and passes it on its
    ``sliding_attention`` layers only: one sliding and one full kind."""
    from transformers import Exaone4Config

    fields = _small(Exaone4Config(**SMALL, sliding_window=64, layer_types=["sliding_attention", "full_attention"]))
    assert _windows(fields) == [(64, 1), (None, 1)]
