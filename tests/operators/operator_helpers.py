"""Helpers of the operator baseline tests (test_l1_baselines, test_rotary, test_operator_rules,
test_l1_new_operators, test_attention, test_mlp_moe): seeded random tensors, the per-rank
shapes an operator's rules give, and the configured models."""

from __future__ import annotations

import torch

from kb_nano import operators

# the models of config/models/models.yaml that the applies_to checks go over
MODELS = (
    "llama31-8b",
    "llama32-1b",
    "qwen25-7b",
    "qwen3-8b",
    "mistral-7b-v03",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "gemma2-2b",
)


def gen(seed: int = 0) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, std=1.0):
    """Seeded normal values of ``shape`` times ``std``, drawn in float32 and cast to ``dtype``."""
    return (torch.randn(shape, generator=gen(seed), dtype=torch.float32) * std).to(dtype)


def shapes(name, facts, tp, n=4, **extra):
    """The init args of operator ``name`` at ``tp`` and its inputs' shapes by name, for ``n``
    tokens in bfloat16."""
    op = operators.get(name)
    args = op.init_args(facts, tp)
    return args, {s["name"]: s["shape"] for s in op.inputs(args, facts, tp, n, "bfloat16", **extra)}


def measure_moe_candidate(scenario: dict, candidate: str, edits: list[tuple[str, str]] | None, tmp_path) -> dict:
    """One CPU measurement (``measure_once``) of the shipped ``fused_moe/sorted_experts``,
    or, with ``edits`` (``(old, new)`` source replacements, each asserted present), of a
    broken copy of it written under ``tmp_path`` as ``candidate``; returns the row."""
    from workflow_helpers import REPO

    path = REPO / "candidates/fused_moe/sorted_experts.py"
    if edits:
        text = path.read_text()
        for old, new in edits:
            assert old in text
            text = text.replace(old, new)
        path = tmp_path / f"{candidate}.py"
        path.write_text(text)
    return measure_cpu(scenario, f"fused_moe/{candidate}", path, timeout_s=300)


def measure_cpu(scenario: dict, candidate_id: str, path, timeout_s: float = 120) -> dict:
    """One short CPU measurement (``measure_once``: operator tolerances, 1 warm-up, 3 runs,
    one thread) of the candidate file ``path`` as ``candidate_id``; returns the row."""
    from workflow_helpers import REPO

    from kb_nano.kernels.measure import measure_once

    settings = {"device": "cpu", "atol": None, "rtol": None, "num_warmup": 1, "num_runs": 3, "num_threads": 1}
    return measure_once(scenario, candidate_id, path, {**settings, "timeout_s": timeout_s}, REPO)
