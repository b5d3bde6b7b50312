"""kb_nano.models.configs: resolving model specs, loading configs, deriving facts."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from workflow_helpers import REPO

from kb_nano.errors import KbNanoError
from kb_nano.models.configs import (
    ModelRef,
    config_sha256,
    load_config,
    load_index,
    model_facts,
    resolve,
    slug,
)

QWEN3_JSON = REPO / "config/models/Qwen/Qwen3-8B/config.json"


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    return msg


def make_root(tmp_path: Path, index: str | None = None) -> Path:
    """A workflow root holding a copy of the real index and the vendored configs it names."""
    root = tmp_path / "root"
    shutil.copytree(REPO / "config/models", root / "config/models")
    if index is not None:
        (root / "config/models/models.yaml").write_text(index)
    return root


# --------------------------------------------------------------------------- resolve


def test_short_key():
    ref = resolve("llama31-8b", REPO)
    assert ref == ModelRef(
        "llama31-8b",
        "meta-llama/Llama-3.1-8B-Instruct",
        Path("config/models/meta-llama/Llama-3.1-8B-Instruct/config.json"),
    )
    assert not ref.config_path.is_absolute()  # portable in the manifest
    assert (REPO / ref.config_path).is_file()


def test_every_index_key_resolves():
    for key, hub in load_index(REPO).items():
        ref = resolve(key, REPO)
        assert (ref.key, ref.hub_id) == (key, hub)


def test_unique_prefix():
    assert resolve("llama32", REPO).key == "llama32-1b"
    assert resolve("mixtral", REPO).key == "mixtral-8x7b"
    assert resolve("qwen3-3", REPO).key == "qwen3-30b-a3b"


def test_exact_key_wins_over_prefix():
    # "qwen3-8b" is a key and no other key starts with it; "qwen3" is a prefix of two
    assert resolve("qwen3-8b", REPO).key == "qwen3-8b"


@pytest.mark.parametrize(
    "spec,matches",
    [
        ("llama3", ["llama31-70b", "llama31-8b", "llama32-1b"]),
        ("llama31", ["llama31-70b", "llama31-8b"]),
        ("qwen3", ["qwen3-30b-a3b", "qwen3-8b"]),
    ],
)
def test_ambiguous_prefix(spec, matches):
    with pytest.raises(KbNanoError) as exc:
        resolve(spec, REPO)
    msg = one_line_error(exc)
    assert "ambiguous" in msg and repr(spec) in msg
    assert ", ".join(matches) in msg


def test_vendored_hub_id_in_index():
    ref = resolve("Qwen/Qwen3-8B", REPO)
    assert (ref.key, ref.hub_id) == ("qwen3-8b", "Qwen/Qwen3-8B")
    assert ref.config_path == Path("config/models/Qwen/Qwen3-8B/config.json")


def test_vendored_hub_id_not_in_index(tmp_path):
    root = make_root(tmp_path)
    extra = root / "config/models/acme/Tiny-Llama-0.1B"
    extra.mkdir(parents=True)
    shutil.copy(QWEN3_JSON, extra / "config.json")
    ref = resolve("acme/Tiny-Llama-0.1B", root)
    assert ref == ModelRef(
        "tiny-llama-0.1b", "acme/Tiny-Llama-0.1B", Path("config/models/acme/Tiny-Llama-0.1B/config.json")
    )
    assert load_config(ref, root).model_type == "qwen3"


def test_local_directory(tmp_path):
    d = tmp_path / "My_Model-7B"
    d.mkdir()
    shutil.copy(QWEN3_JSON, d / "config.json")
    ref = resolve(str(d), REPO)
    assert ref == ModelRef("my-model-7b", None, d / "config.json")
    assert load_config(ref, REPO).hidden_size == 4096


def test_config_json_path(tmp_path):
    d = tmp_path / "Some.Model"
    d.mkdir()
    shutil.copy(QWEN3_JSON, d / "config.json")
    ref = resolve(str(d / "config.json"), REPO)
    assert ref == ModelRef("some.model", None, d / "config.json")
    # a json file of another name: the key comes from the file name
    other = tmp_path / "qwen-variant.json"
    shutil.copy(QWEN3_JSON, other)
    ref = resolve(str(other), REPO)
    assert ref == ModelRef("qwen-variant", None, other)
    assert load_config(ref, REPO).model_type == "qwen3"


def test_relative_path_is_relative_to_the_root(tmp_path, monkeypatch):
    """resolve must find the same file load_config/config_sha256 read (root / path),
    whatever the current directory."""
    root = make_root(tmp_path)
    local = root / "local/mymodel"
    local.mkdir(parents=True)
    shutil.copy(QWEN3_JSON, local / "config.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ref = resolve("local/mymodel", root)
    assert ref == ModelRef("mymodel", None, Path("local/mymodel/config.json"))
    assert load_config(ref, root).model_type == "qwen3"
    assert config_sha256(ref, root) == hashlib.sha256(QWEN3_JSON.read_bytes()).hexdigest()
    ref = resolve("local/mymodel/config.json", root)
    assert ref.config_path == Path("local/mymodel/config.json")
    # a directory in the current directory but not under the root is not found
    (elsewhere / "cwdonly").mkdir()
    shutil.copy(QWEN3_JSON, elsewhere / "cwdonly/config.json")
    with pytest.raises(KbNanoError):
        resolve("cwdonly", root)


def test_directory_without_config_json_is_unknown(tmp_path):
    with pytest.raises(KbNanoError) as exc:
        resolve(str(tmp_path), REPO)
    assert str(tmp_path) in one_line_error(exc)


@pytest.mark.parametrize(
    "spec", ["gpt5", "meta-llama/Nope"]
)  # (a path: test_a_config_path_that_does_not_exist_says_so)
def test_unknown_model(spec):
    with pytest.raises(KbNanoError) as exc:
        resolve(spec, REPO)
    msg = one_line_error(exc)
    assert msg.startswith(f"unknown model {spec!r}")
    assert "llama31-8b" in msg and "config.json" in msg  # the accepted forms


def test_index_entry_without_vendored_config(tmp_path):
    root = make_root(tmp_path, index="ghost-1b: acme/Ghost-1B\n")
    with pytest.raises(KbNanoError) as exc:
        resolve("ghost-1b", root)
    msg = one_line_error(exc)
    assert "acme/Ghost-1B" in msg and "does not exist" in msg


@pytest.mark.parametrize(
    "text,needle",
    [
        ("llama: [unclosed\n", "not valid YAML"),
        ("- a\n- b\n", "must map"),
        ("llama: 3\n", "must map"),
        ("Llama_8B: meta-llama/Llama-3.1-8B-Instruct\n", "lowercase"),
        ("a__b: meta-llama/Llama-3.1-8B-Instruct\n", "lowercase"),
    ],
)
def test_bad_index(tmp_path, text, needle):
    root = make_root(tmp_path, index=text)
    with pytest.raises(KbNanoError) as exc:
        load_index(root)
    msg = one_line_error(exc)
    assert needle in msg and "models.yaml" in msg


def test_missing_index(tmp_path):
    with pytest.raises(KbNanoError) as exc:
        resolve("llama31-8b", tmp_path)
    assert "models.yaml" in one_line_error(exc)


def test_slug():
    assert slug("Llama-3.1-8B-Instruct") == "llama-3.1-8b-instruct"
    assert slug("My_Model 7B") == "my-model-7b"
    assert slug("--__") == "model"


# --------------------------------------------------------------------------- load_config


def test_load_config_malformed_json(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": \n')
    ref = resolve(str(d), REPO)
    with pytest.raises(KbNanoError) as exc:
        load_config(ref, REPO)
    msg = one_line_error(exc)
    assert str(d / "config.json") in msg and "not a loadable" in msg


def test_load_config_unknown_model_type(tmp_path):
    path = tmp_path / "weird.json"
    path.write_text(json.dumps({"model_type": "no-such-architecture", "hidden_size": 8}))
    with pytest.raises(KbNanoError) as exc:
        load_config(resolve(str(path), REPO), REPO)
    assert str(path) in one_line_error(exc)


def test_config_sha256():
    ref = resolve("qwen3-8b", REPO)
    assert config_sha256(ref, REPO) == hashlib.sha256(QWEN3_JSON.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- model_facts


def facts(key):
    ref = resolve(key, REPO)
    return model_facts(load_config(ref, REPO), ref)


def test_facts_llama31_8b():
    f = facts("llama31-8b")
    assert f == {
        "architecture": "LlamaForCausalLM",
        "model_type": "llama",
        "dtype": "bfloat16",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "num_hidden_layers": 32,
        "rope": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rope_type": "llama3",
        },
        "partial_rotary_factor": 1.0,
        "tie_word_embeddings": False,
    }
    json.dumps(f)  # plain data


def test_facts_derived_head_dim_and_default_rope():
    f = facts("qwen25-7b")  # no head_dim in config.json
    assert f["head_dim"] == 3584 // 28 == 128
    assert f["rope"] == {"rope_theta": 1000000.0, "rope_type": "default"}
    assert f["num_key_value_heads"] == 4
    assert facts("qwen3-8b")["rope"]["rope_type"] == "default"
    assert facts("llama32-1b")["tie_word_embeddings"] is True


def test_facts_dtype_defaults_to_bfloat16(tmp_path):
    raw = json.loads(QWEN3_JSON.read_text())
    del raw["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert (
        model_facts(load_config(resolve(str(tmp_path), REPO), REPO), resolve(str(tmp_path), REPO))["dtype"]
        == "bfloat16"
    )


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size"])
def test_facts_missing_field(field):
    ref = resolve("llama31-8b", REPO)
    # transformers 5 configs are strict dataclasses (no None for an int field): use a
    # plain stand-in with the same attributes, less one.
    attrs = load_config(ref, REPO).to_dict()
    assert model_facts(SimpleNamespace(**attrs), ref) == facts("llama31-8b")
    del attrs[field]
    config = SimpleNamespace(**attrs)
    with pytest.raises(KbNanoError) as exc:
        model_facts(config, ref)
    msg = one_line_error(exc)
    assert repr(field) in msg and str(ref.config_path) in msg


def test_facts_config_without_rms_norm_eps_or_intermediate_size(tmp_path):
    """A LayerNorm architecture (GPT-2 style) has neither: the facts hold None and the
    operators that need them say ``not covered`` (the model's other operators are
    measured), not a refusal of the whole model."""
    from kb_nano import operators
    from kb_nano.operators.base import NotApplicable

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2}))
    ref = resolve(str(tmp_path), REPO)
    got = model_facts(load_config(ref, REPO), ref)
    assert got["rms_norm_eps"] is None and got["intermediate_size"] is None and got["hidden_size"] == 64
    with pytest.raises(NotApplicable, match="no rms_norm_eps"):
        operators.get("rms_norm").init_args(got, 1)
    with pytest.raises(NotApplicable, match="no intermediate_size"):
        operators.get("gelu_and_mul").init_args(got, 1)


def test_a_config_path_that_does_not_exist_says_so(tmp_path):
    """A ``--model`` meant as a path (it ends in ``.json`` or starts like a path) that is
    not there says "no such file", not "unknown model"."""
    for spec in (str(tmp_path / "nope/config.json"), "./nope", "nope.json"):
        with pytest.raises(KbNanoError, match="no such file"):
            resolve(spec, REPO)


def test_a_mistyped_target_or_model_gets_a_suggestion():
    """Unknown names say which known one is closest (``difflib``), and nothing when none is."""
    from kb_nano import operators

    with pytest.raises(KbNanoError, match=r"unknown target 'silu_mul' \(did you mean 'silu_and_mul'\?\)"):
        operators.check_target("silu_mul")
    with pytest.raises(KbNanoError, match=r"unknown model 'lama31-8b' \(did you mean 'llama31-8b'\?\)"):
        resolve("lama31-8b", REPO)
    with pytest.raises(KbNanoError) as exc:
        resolve("zzz", REPO)
    assert "did you mean" not in str(exc.value)


def documented_models() -> tuple[dict[str, str], list[str]]:
    """The vendored models the docs name: docs/usage.md's Models table (key -> Hub id)
    and the keys of the README's "model configs are vendored (...)" list."""
    import re

    usage = (REPO / "docs/usage.md").read_text()
    table = dict(re.findall(r"^\| `([a-z0-9.-]+)` \| `([^`]+)` \|$", usage, flags=re.MULTILINE))
    readme = " ".join((REPO / "README.md").read_text().split())
    listed = re.search(r"the model configs are vendored \((.*?); their Hub ids", readme)
    assert listed, "README: the list of vendored model keys is missing"
    return table, re.findall(r"`([^`]+)`", listed.group(1))


def test_the_docs_list_the_vendored_models_of_the_registry():
    """README.md and docs/usage.md name exactly the models of config/models/models.yaml,
    and every config.json vendored under config/models/ is one of them (or the embedded
    tiny Llama, which has no key)."""
    index = load_index(REPO)
    table, readme_keys = documented_models()
    assert table == index, "docs/usage.md's Models table differs from config/models/models.yaml"
    assert sorted(readme_keys) == sorted(index), "README's vendored-model list differs from models.yaml"
    vendored = {
        str(p.parent.relative_to(REPO / "config/models")) for p in (REPO / "config/models").rglob("config.json")
    }
    assert vendored == {*index.values(), "kb-nano/tiny-llama"}
