"""The device a measurement runs on, and the row fields known before it runs
(see :mod:`kb_nano.kernels.schema`)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import torch

import kb_nano
from kb_nano.kernels.compare import tolerance
from kb_nano.kernels.schema import scenario_fields
from kb_nano.provenance import git_sha, package_version


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when available else ``cpu``; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    """GPU name from CUDA, or the CPU model name from ``/proc/cpuinfo``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def row_fields(
    scenario: dict, candidate_id: str, candidate_path: Path, settings: dict, root: Path, device: torch.device, seed: int
) -> dict:
    """The row fields known before measuring (see :mod:`kb_nano.kernels.schema`)."""
    from kb_nano.candidates import file_sha256

    atol, rtol = tolerance(scenario, settings)
    return {
        **scenario_fields(scenario),
        "input_source": "golden" if settings.get("golden") else "random",
        "seed": seed,
        "candidate": candidate_id,
        "candidate_sha256": file_sha256(candidate_path),
        "atol": atol,
        "rtol": rtol,
        "num_warmup": int(settings["num_warmup"]),
        "num_runs": int(settings["num_runs"]),
        "num_trials": max(2, int(settings.get("num_trials") or 3)),
        "num_threads": int(settings["num_threads"]),
        "float32_matmul_precision": str(settings.get("float32_matmul_precision") or "highest"),
        "device": device.type,
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "triton_version": package_version("triton"),
        "kb_nano_version": kb_nano.__version__,
        "git_sha": git_sha(root),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
