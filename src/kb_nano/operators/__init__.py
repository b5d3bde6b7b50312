"""Operator registry (torch-free to import; operator modules load on first use).

Names follow vLLM's op names. ``CATALOG`` maps each target to its level, category and
the module that defines its baseline ``nn.Module`` and shape rules; ``get`` imports
that module and returns the :class:`kb_nano.operators.base.Operator`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from kb_nano.errors import KbNanoError, did_you_mean


@dataclass(frozen=True)
class CatalogEntry:
    """Static facts about one operator: ``level`` (1 = single op ... 4 = whole model),
    ``category`` (norm, activation, positional, embedding, ...) and the module holding it."""

    level: int
    category: str
    module: str


CATALOG: dict[str, CatalogEntry] = {
    "rms_norm": CatalogEntry(1, "norm", "kb_nano.operators.norms"),
    "fused_add_rms_norm": CatalogEntry(1, "norm", "kb_nano.operators.norms"),
    "qk_norm": CatalogEntry(1, "norm", "kb_nano.operators.norms"),
    "layer_norm": CatalogEntry(1, "norm", "kb_nano.operators.norms"),
    "silu_and_mul": CatalogEntry(1, "activation", "kb_nano.operators.activations"),
    "gelu_and_mul": CatalogEntry(1, "activation", "kb_nano.operators.activations"),
    "swigluoai_and_mul": CatalogEntry(1, "activation", "kb_nano.operators.activations"),
    "rotary_embedding": CatalogEntry(1, "positional", "kb_nano.operators.rotary"),
    "embedding": CatalogEntry(1, "embedding", "kb_nano.operators.embedding"),
    "lm_head": CatalogEntry(1, "embedding", "kb_nano.operators.lm_head"),
    "sampler": CatalogEntry(1, "sampler", "kb_nano.operators.sampler"),
    "attention": CatalogEntry(2, "attention", "kb_nano.operators.attention"),
    "mlp": CatalogEntry(2, "mlp", "kb_nano.operators.mlp"),
    "fused_moe": CatalogEntry(2, "moe", "kb_nano.operators.moe"),
    "decoder_layer": CatalogEntry(3, "layer", "kb_nano.operators.layers"),
    "model": CatalogEntry(4, "model", "kb_nano.operators.layers"),
}


def names() -> list[str]:
    """All operator (target) names, in catalog order."""
    return list(CATALOG)


def check_target(name: str, where: str = "target") -> CatalogEntry:
    """Return the catalog entry of ``name``; raise ``KbNanoError`` for an unknown target."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KbNanoError(
            f"{where}: unknown target {name!r}{did_you_mean(name, CATALOG)}; known: {', '.join(CATALOG)}"
        ) from None


def get(name: str):
    """Import and return the :class:`~kb_nano.operators.base.Operator` named ``name``.

    Raises ``KbNanoError`` for an unknown name.
    """
    entry = check_target(name)
    module = importlib.import_module(entry.module)
    return module.OPERATORS[name]
