"""The rows of the fidelity bench (bench/fidelity.py) and how the workers build them: the
scenarios and shipped candidates, a kernel job's settings, the modules with the workers'
parameters, input sets, the judge's slot count. Shared by bench/fidelity.py,
bench/fidelity_ncu.py and bench/graph_diagnostics/."""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def rows_of(a) -> list[tuple[dict, str]]:
    """(scenario, candidate id) pairs of the run."""
    from kb_nano.kernels.manifest import generate

    manifest = generate([a.model], [1], a.num_tokens, "auto", REPO, context_lens=a.context_lens)
    out = []
    for s in manifest["scenarios"]:
        if not s.get("applicable", True) or s["target"] not in a.targets:
            continue
        if s.get("context_len") and s["num_tokens"] > a.max_decode_tokens:
            continue
        if s["target"] == "attention" and not s.get("context_len") and s["num_tokens"] > a.max_prefill_tokens:
            continue
        for f in sorted((REPO / "candidates" / s["target"]).glob("*.py")):
            out.append((s, f"{s['target']}/{f.stem}"))
    return out


def settings() -> dict:
    """A kernel job's settings on CUDA at the config schema's defaults
    (:func:`kb_nano.workflow.settings`, workflow/schemas/config.schema.yaml)."""
    from kb_nano.config import defaults
    from kb_nano.workflow import settings as job_settings

    # num_threads and golden as the kernel_bench rule adds them (threads: 1, no golden file)
    return {**job_settings(REPO, {**defaults(REPO), "device": "cuda"}), "num_threads": 1, "golden": None}


def modules(scenario: dict, candidate: str, device: torch.device) -> dict:
    """The baseline and the candidate module of a row, the same parameters, as the workers
    build them."""
    from kb_nano import operators
    from kb_nano.candidates import load_class
    from kb_nano.kernels.inputs import randomize_constant_parameters
    from kb_nano.operators.base import DTYPES

    op = operators.get(scenario["target"])
    dtype = DTYPES[scenario["dtype"]]
    torch.manual_seed(0)
    base = op.baseline(**scenario["init_args"])
    randomize_constant_parameters(base, 0)
    base = base.to(device=device, dtype=dtype).eval()
    cls = load_class(REPO / "candidates" / f"{candidate}.py", scenario["target"])
    cand = cls(**scenario["init_args"]).to(device=device, dtype=dtype)
    cand.load_state_dict(base.state_dict())
    return {"baseline": base, "candidate": cand.eval()}


def input_sets(scenario: dict, device: torch.device, k: int) -> list[list]:
    from kb_nano.kernels.inputs import generator, make_inputs

    gen = generator(device, 0)
    return [make_inputs(scenario, gen, str(device), None, REPO, draw=i)[0] for i in range(k)]


def slots(scenario: dict, eager_ms: float, device: torch.device) -> int:
    """How many input slots the judge gives this scenario (:func:`kb_nano.kernels.blocks.batch_calls`)."""
    from kb_nano.kernels.blocks import batch_calls
    from kb_nano.operators.base import spec_bytes

    return batch_calls(eager_ms, 3 * sum(spec_bytes(s) for s in scenario["inputs"]), device, 100)
