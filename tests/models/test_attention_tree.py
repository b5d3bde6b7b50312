"""The attention half of the module tree: an attention module with the standard parts is
still not covered when its layer type or its own attributes say it computes something else
(Llama-4: chunked attention, temperature-tuned queries on its layers without rotation).
"""

from __future__ import annotations

import pytest
from workflow_helpers import REPO

from kb_nano.models import module_tree
from kb_nano.models.configs import config_fields, resolve


@pytest.fixture(scope="module")
def scout_fields():
    return config_fields(resolve("llama4-scout", REPO), REPO)


def _attention(fields: dict) -> dict:
    return module_tree.read(fields)["attention_layers"]


def test_llama4_scout_attention_names_its_l2_norm(scout_fields):
    got = _attention(dict(scout_fields))
    assert got["kinds"] == []
    assert got["reason"] == "not covered: Llama4TextAttention has qk_norm (Llama4TextL2Norm)"


def test_llama4_without_qk_norm_is_still_not_covered(scout_fields):
    """Llama-4 Maverick's form (``use_qk_norm`` false): standard parts, chunked attention
    on its rotated layers."""
    got = _attention({**scout_fields, "use_qk_norm": False})
    assert got["kinds"] == [] and "layer 0 is 'chunked_attention'" in got["reason"]


def test_llama4_temperature_tuning_is_not_covered(scout_fields):
    """Every layer typed full attention, no q/k norm: the layers without rotation still
    scale their queries by position."""
    fields = {**scout_fields, "use_qk_norm": False, "layer_types": ["full_attention"] * 48}
    got = _attention(fields)
    assert got["kinds"] == [] and "layer 3 scales its queries by position" in got["reason"]
    # and without the tuning the layers are plain causal attention
    plain = _attention({**fields, "attn_temperature_tuning": False})
    assert plain["reason"] is None and sum(k["layers"] for k in plain["kinds"]) == 48
