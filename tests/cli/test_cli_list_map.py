"""kb_nano kernels --list and --map, and what --model selects."""

from __future__ import annotations

from tracking_helpers import table_headers
from workflow_helpers import kb_nano


def test_list_shows_every_operator(work):
    out = kb_nano(work, "kernels", "--list")
    assert out.returncode == 0, out.stderr
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "embedding"):
        assert name in out.stdout
    level1 = kb_nano(work, "kernels", "--list", "--level", "1")
    assert "rms_norm" in level1.stdout and "L1" in level1.stdout


def test_map_and_list_keep_transformers_config_warnings_off_the_terminal(work):
    """Reading a config with generation fields and the old ``torch_dtype`` key (Gemma-3's
    multimodal file) and building it on the meta device prints no transformers warnings."""
    for args in (("--map", "--model", "gemma3-4b", "--target", "rms_norm"), ("--list",)):
        out = kb_nano(work, "kernels", *args)
        assert out.returncode == 0, out.stderr
        assert "[transformers]" not in out.stderr, out.stderr


def test_list_shows_the_candidate_contract(work):
    """`kernels --list` shows each baseline's constructor and forward signatures: what a
    candidate must accept."""
    from kb_nano import operators
    from kb_nano.operators.base import contract

    out = kb_nano(work, "kernels", "--list")
    assert out.returncode == 0, out.stderr
    assert "candidate contract" in out.stdout
    for text in (
        "RMSNorm(hidden_size: int, eps: float = 1e-06, weight_offset: float =",
        "forward(x: torch.Tensor, residual: torch.Tensor | None = None)",
        "SiluAndMul()",  # no __init__ of its own: nn.Module's takes no arguments
        "forward(x: torch.Tensor) -> torch.Tensor",
        "QKNorm(num_heads: int, num_kv_heads: int, head_dim: int, eps: float =",
    ):
        assert text in out.stdout, out.stdout
    for name in operators.names():
        baseline = operators.get(name).baseline
        init, forward = contract(baseline)
        assert init.startswith(baseline.__name__ + "(") and forward.startswith("forward(")
        assert "self" not in init + forward and "'" not in forward
    assert contract(operators.get("attention").baseline)[1] == (
        "forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None, key_cache: torch.Tensor "
        "| None = None, value_cache: torch.Tensor | None = None) -> torch.Tensor"
    )


def _column(out: str, header: str) -> dict[str, str]:
    """The cells of ``header``'s column of the one rich table in ``out``, by the first
    column's value, each cell's wrapped lines joined with single spaces."""
    lines = out.splitlines()
    col = table_headers(out)[0].split(" | ").index(header)
    cells: dict[str, list[str]] = {}
    key = ""
    first = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("┡"))
    for line in lines[first + 1 :]:
        if line.lstrip().startswith("└"):
            break
        parts = [p.strip() for p in line.strip().strip("│").split("│")]
        key = parts[0] or key
        cells.setdefault(key, []).append(parts[col])
    return {k: " ".join(" ".join(v).split()) for k, v in cells.items()}


def test_list_shows_the_baseline_state_dict_shapes(work, monkeypatch, capsys):
    """`kernels --list` shows each baseline's state_dict keys with their per-rank shapes
    for the first configured model and TP it applies to (built on the meta device),
    naming that model; a registry model outside the configuration where none of them
    uses the operator; `(none)` without parameters; `--model`/`--tp` choose the model.
    On a narrow terminal this column is the first left out, and no line is wider."""
    from kb_nano.cli.parser import main

    monkeypatch.setenv("KB_NANO_ROOT", str(work))
    header = "baseline state_dict: keys, per-rank shapes"

    def listing(columns: int, *flags: str) -> str:
        monkeypatch.setenv("COLUMNS", str(columns))
        assert main(["kernels", "--list", *flags]) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= columns, out
        return out

    out = listing(250)
    cells = _column(out, header)
    assert cells["rms_norm"] == "of llama31-8b tp=1: weight [4096]"
    assert cells["qk_norm"] == "of qwen3-8b tp=1: q_norm.weight [128] k_norm.weight [128]"
    assert cells["embedding"] == "of llama31-8b tp=1: weight [128256, 4096]"
    for name in ("silu_and_mul", "gelu_and_mul", "rotary_embedding", "sampler", "attention"):
        assert cells[name] == "(none)", name
    assert cells["fused_moe"].startswith("of mixtral-8x7b tp=1 (not configured): w13_weight [8, 28672, 4096]")
    assert cells["decoder_layer"].startswith("of llama31-8b tp=4: self_attn.q_proj.weight [1024, 4096]")
    assert cells["model"].startswith("of llama32-1b tp=1 (not configured): model.embed_tokens.weight [128256, 2048]")
    assert "model.layers.{0,1}.mlp.up_proj.weight [8192, 2048]" in cells["model"]
    assert "state_dict keys and shapes" in out

    qwen = _column(listing(250, "--model", "qwen3", "--tp", "2", "--level", "1"), header)
    assert qwen["embedding"] == "of qwen3-8b tp=2: weight [75968, 4096]" and "decoder_layer" not in qwen

    narrow = listing(120)
    (head,) = table_headers(narrow)
    assert header not in head and "candidate contract" in head
    assert f"left out at 120 columns: level, category, baseline module, {header}" in " ".join(narrow.split())


def test_map_shows_real_per_rank_shapes(work):
    out = kb_nano(work, "kernels", "--map", "--model", "llama31", "--tp", "1", "4")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "LlamaForCausalLM" in text and "hidden 4096" in text
    assert "x[N, 28672]" in text  # silu_and_mul input at tp=1: 2 * 14336
    assert "x[N, 7168]" in text  # ... and at tp=4
    assert "query[N, 1024]" in text and "key[N, 256]" in text  # rotary at tp=4: 8 heads, 2 kv heads
    assert "note: --model llama31 selects the configured llama31-8b (key prefix)" in out.stderr


def test_a_model_prefix_says_which_models_it_chose(capsys):
    """`--model qwen` keeps the configured models whose key starts with it, and says so;
    a full key or a vendored Hub id is taken as given, without a note."""
    from workflow_helpers import REPO

    from kb_nano.overrides import select_models

    configured = ["llama31-8b", "qwen3-8b", "llama32-1b"]
    assert select_models(["llama3"], configured, REPO) == ["llama31-8b", "llama32-1b"]
    assert (
        capsys.readouterr().err == "note: --model llama3 selects the configured llama31-8b, llama32-1b (key prefix)\n"
    )
    assert select_models(["qwen3-8b", "meta-llama/Llama-3.1-8B-Instruct"], configured, REPO)[0] == "qwen3-8b"
    assert capsys.readouterr().err == ""
