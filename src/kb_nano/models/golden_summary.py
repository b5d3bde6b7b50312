"""What ``kb_nano capture-golden`` says about the golden files of the models it captured.

A module of its own: :mod:`kb_nano.models.golden` and :mod:`kb_nano.models.golden_inputs`
are inputs of the ``capture_golden`` rule and of the kernel jobs that read golden tensors,
so a change of this wording would otherwise rerun them.
"""

from __future__ import annotations

import json
from pathlib import Path

from kb_nano.models.golden import GOLDEN_DIR

SHAPES_SHOWN = 3  # tensors named per file; the rest are counted


def summary_lines(root: Path, keys: list[str]) -> list[str]:
    """One line per golden file of each model key in ``keys`` (its sidecar
    ``results/golden/{key}/{operator}.json`` under ``root``, in name order): the
    safetensors path, the operator, the layers captured of the model's, where the weights
    came from, the prompts (count x tokens), the dtype and the first tensors' shapes;
    then one line naming the operators whose scenarios of those models now read them
    (``input_source = golden``). A model without files gives no line of its own. Raises
    ``OSError``/``ValueError`` for a sidecar that cannot be read or is not JSON, and
    ``KeyError`` for one without the fields :func:`kb_nano.models.golden.capture` writes."""
    lines = []
    for key in keys:
        for sidecar in sorted((root / GOLDEN_DIR / key).glob("*.json")):
            meta = json.loads(sidecar.read_text())
            layers = meta["num_hidden_layers"]
            tensors = list(meta["tensors"].items())
            shapes = ", ".join(f"{name} {t['shape']}" for name, t in tensors[:SHAPES_SHOWN])
            more = len(tensors) - SHAPES_SHOWN
            lines.append(
                f"{sidecar.with_suffix('.safetensors')}: {meta['operator']} of {key} "
                f"({layers['captured']} of {layers['model']} layers, {meta['weights'].split(':')[0]} weights, "
                f"{meta['prompts']['count']} prompts x {meta['prompts']['seq_len']} tokens, {meta['dtype']}): "
                f"{shapes}{f' (+{more} more)' if more > 0 else ''}"
            )
    written = sorted({p.stem for k in keys for p in (root / GOLDEN_DIR / k).glob("*.json")})
    lines.append(f"{', '.join(written)} scenarios of {', '.join(keys)} now use them (input_source = golden)")
    return lines
