"""Whether vLLM is installed, checked by ``kb_nano e2e`` and ``kb_nano eval`` before their
run (:func:`require_vllm`). Not a job's module (:data:`kb_nano.e2e.tier_jobs.HARNESS_MODULES`):
editing it reruns no job."""

from __future__ import annotations

from kb_nano.errors import KbNanoError

NO_VLLM = (
    "vLLM is not installed; on a CPU: pip install -e '.[e2e]' and then "
    "pip uninstall -y torchvision torchaudio torchcodec (see docs/e2e.md)"
)


def require_vllm() -> None:
    """Raise ``KbNanoError`` (:data:`NO_VLLM`: how to install it) when no vLLM distribution
    is installed (:func:`kb_nano.e2e.vllm_cli.vllm_version`)."""
    from kb_nano.e2e.vllm_cli import vllm_version

    if vllm_version() is None:
        raise KbNanoError(NO_VLLM)
