"""Each config key's default and description live in the schema alone
(workflow/schemas/config.schema.yaml): the Snakefile and the CLI fill the same effective
config from it, and the CLI's flags take their help, types and choices from it."""

from __future__ import annotations

import copy

import pytest
import yaml
from workflow_helpers import REPO, copy_workflow, kb_nano

from kb_nano.config import SCHEMA_FILE, load

# The effective config of the embedded default, frozen from config/config.yaml as it was
# before the defaults moved into the schema (every key written out there).
EMBEDDED = {
    "models": ["llama31-8b", "qwen3-8b"],
    "tp": [1, 4],
    "num_tokens": [1, 64],
    "context_lens": [256],
    "dtype": "auto",
    "targets": [
        "rms_norm",
        "fused_add_rms_norm",
        "qk_norm",
        "silu_and_mul",
        "rotary_embedding",
        "embedding",
        "decoder_layer",
        "model",
    ],
    "categories": [],
    "candidates": [],
    "device": "auto",
    "atol": None,
    "rtol": None,
    "num_warmup": 10,
    "num_runs": 100,
    "timeout_s": 600,
    "num_trials": 3,
    "seed": None,
    "cuda_graph": True,
    "speedup_basis": "auto",
    "ci_target": 0.02,
    "max_timing_s": 1.0,
    "float32_matmul_precision": "highest",
    "memory_limit_gb": None,
    "roofline": {"copy_gbps": None, "matmul_tflops": None},
    "use_golden": True,
    "golden": {"num_layers": 2, "weights": {}},
    "output_json": "results/kernels.json",
    "mlflow_tracking_uri": "",
    "e2e": {
        "models": ["config/models/kb-nano/tiny-llama"],
        "tp": [1],
        "workloads": [
            {
                "name": "latency-smoke",
                "kind": "latency",
                "input_len": 32,
                "output_len": 16,
                "batch_size": 4,
                "num_iters_warmup": 1,
                "num_iters": 3,
            },
            {
                "name": "throughput-smoke",
                "kind": "throughput",
                "dataset_name": "random",
                "random_input_len": 32,
                "random_output_len": 16,
                "num_prompts": 16,
            },
            {
                "name": "serve-smoke",
                "kind": "serve",
                "dataset_name": "random",
                "random_input_len": 32,
                "random_output_len": 16,
                "num_prompts": 16,
                "request_rate": None,
                "max_concurrency": 4,
            },
        ],
        "candidates": [],
        "baseline_only": False,
        "pairs": 3,
        "load_format": "auto",
        "dtype": "auto",
        "max_model_len": 512,
        "enforce_eager": True,
        "seed": 0,
        "device": "auto",
        "timeout_s": 900,
        "output_json": "results/e2e.json",
    },
    "eval": {
        "models": [],
        "tp": [1, 4],
        "categories": [],
        "workloads": [],
        "candidates": [],
        "num_prompts": 1000,
        "gpu_pool": 8,
        "seed": 42,
        "smoke": False,
        "pairs": 3,
        "device": "auto",
        "timeout_s": 3600,
        "output_json": "results/eval.json",
    },
}


def _keys(node: dict, prefix: str = "") -> dict:
    """Dotted key -> schema entry of every property, through object sections."""
    out = {}
    for name, entry in node.get("properties", {}).items():
        out[prefix + name] = entry
        if entry.get("type") == "object" and "properties" in entry:
            out.update(_keys(entry, f"{prefix}{name}."))
    return out


def _leaves(config: dict, prefix: str = "") -> set:
    out = set()
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_every_key_has_a_description_and_its_default_in_one_place():
    """Every schema property (the sections' keys and the workload fields too) says what it
    means; every key has a schema default unless config/config.yaml sets it (the run's
    selection), and no key has both."""
    schema = yaml.safe_load((REPO / SCHEMA_FILE).read_text())
    keys = _keys(schema)
    fields = schema["properties"]["e2e"]["properties"]["workloads"]["items"]["properties"]
    for key, entry in [*keys.items(), *((f"e2e.workloads[].{k}", v) for k, v in fields.items())]:
        assert len(entry.get("description", "")) > 10, f"{key}: no description"
    embedded = _leaves(yaml.safe_load((REPO / "config/config.yaml").read_text()))
    assert embedded == {"models", "tp", "num_tokens", "context_lens", "targets"}
    without_default = {k for k, e in keys.items() if "default" not in e}
    assert without_default == embedded
    assert set(schema["required"]) <= embedded  # a default satisfies the others


def test_the_effective_config_of_an_empty_config_file_is_the_embedded_default(tmp_path):
    """config/config.yaml and the schema's defaults give exactly the config the old fully
    written config/config.yaml gave, through the CLI's loader and through Snakemake's own
    validate() (what the Snakefile calls); a config file that sets one key of a section
    keeps the section's other keys."""
    from snakemake.utils import update_config, validate

    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    assert load(REPO, empty) == EMBEDDED
    assert load(REPO) == EMBEDDED
    snakefile_config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    validate(snakefile_config, str(REPO / SCHEMA_FILE))
    assert snakefile_config == EMBEDDED
    one = tmp_path / "one.yaml"
    one.write_text("e2e: {pairs: 5}\ngolden: {num_layers: 0}\nnum_runs: 7\n")
    want = copy.deepcopy(EMBEDDED)
    want["e2e"]["pairs"], want["golden"]["num_layers"], want["num_runs"] = 5, 0, 7
    assert load(REPO, one) == want
    layered = yaml.safe_load((REPO / "config/config.yaml").read_text())
    update_config(layered, yaml.safe_load(one.read_text()))
    validate(layered, str(REPO / SCHEMA_FILE))
    assert layered == want


def test_help_shows_the_schemas_description_and_default(tmp_path):
    """`kb_nano kernels --help` shows a flag's help and default from the schema of the
    workflow it runs (an edited default shows, and is what the run gets)."""
    work = copy_workflow(tmp_path)
    path = work / SCHEMA_FILE
    path.write_text(
        path.read_text().replace(
            "    default: 10\n    description: untimed calls per side",
            "    default: 7\n    description: untimed calls per side, edited",
        )
    )
    out = kb_nano(work, "kernels", "--help")
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    assert "--num-warmup NUM_WARMUP untimed calls per side, edited (default 7)" in flat, out.stdout
    assert "--cuda-graph, --no-cuda-graph CUDA: also time K calls per CUDA-graph replay" in flat
    assert "(default llama31-8b qwen3-8b, in config/config.yaml)" in flat  # the selection's default
    assert load(work)["num_warmup"] == 7


@pytest.mark.parametrize(
    ("argv", "given"),
    [
        (
            ["kernels", "--tp", "1", "4", "--num-warmup", "3", "--no-cuda-graph", "--atol", "0.5", "--seed", "9"],
            {"tp": [1, 4], "num_warmup": 3, "cuda_graph": False, "atol": 0.5, "seed": 9},
        ),
        (
            ["kernels", "--memory-limit-gb", "4", "--speedup-basis", "eager"],
            {"memory_limit_gb": 4.0, "speedup_basis": "eager"},
        ),
        (
            ["generate-inputs", "--target", "rms_norm", "--category", "norm"],
            {"targets": ["rms_norm"], "categories": ["norm"]},
        ),
    ],
)
def test_the_flag_table_gives_typed_overrides(argv, given):
    """Each flag of the table parses to its key's schema type and only the flags given
    become overrides."""
    from kb_nano import flags
    from kb_nano.cli.parser import build_parser

    args = build_parser(REPO).parse_args(argv)
    assert flags.given(args, flags.KERNELS) == given


def test_section_flags_and_their_checks():
    """e2e and eval flags set their section's keys; --pairs keeps argparse's own check."""
    from kb_nano import flags
    from kb_nano.cli.parser import build_parser

    parser = build_parser(REPO)
    e2e = parser.parse_args(["e2e", "serve", "--tensor-parallel-size", "2", "--pairs", "4", "--request-rate", "2.5"])
    assert flags.given(e2e, flags.E2E) == {"tp": [2], "pairs": 4}
    assert flags.given(e2e, flags.workload_flags("serve")) == {"request_rate": 2.5}
    ev = parser.parse_args(["eval", "--smoke", "--candidates", "rms_norm/torch_fused", "--device", "cpu"])
    assert flags.given(ev, flags.EVAL) == {"smoke": True, "candidates": ["rms_norm/torch_fused"], "device": "cpu"}
    assert flags.given(parser.parse_args(["eval"]), flags.EVAL) == {}  # absent: the config's values stay
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "--pairs", "0"])
    assert flags.FLAG_FOR_KEY["num_runs"] == "--num-runs" and flags.FLAG_FOR_KEY["models"] == "--model"
