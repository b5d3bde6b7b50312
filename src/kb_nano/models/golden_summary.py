"""What ``kb_nano capture-golden`` sets and says: the model keys and config override of one
run (:func:`invocation`), and what it says about the golden files of the models it
captured (:func:`summary_lines`).

A module of its own: :mod:`kb_nano.models.golden` and :mod:`kb_nano.models.golden_inputs`
are inputs of the ``capture_golden`` rule and of the kernel jobs that read golden tensors,
so a change of this wording would otherwise rerun them.
"""

from __future__ import annotations

import json
from pathlib import Path

from kb_nano.errors import KbNanoError
from kb_nano.models.golden import GOLDEN_DIR

SHAPES_SHOWN = 3  # tensors named per file; the rest are counted


def invocation(
    root: Path, base: dict, models: list[str], weights: str | None, num_layers: int | None
) -> tuple[list[str], dict]:
    """The model keys (the run's targets are their ``results/golden/{key}``) and the config
    override (``models``, ``golden``: :func:`kb_nano.workflow.golden_settings`) of one
    ``kb_nano capture-golden`` run of the ``--model`` values ``models`` (configured key
    prefixes, keys, Hub ids or paths: :func:`kb_nano.overrides.select_models`) over the
    effective config ``base``, with ``--weights`` and ``--num-layers``. Raises
    ``KbNanoError`` for ``--weights`` with other than one model, and what selecting or
    resolving a model raises."""
    from kb_nano import workflow as kbw
    from kb_nano.models.configs import resolve
    from kb_nano.overrides import select_models

    models = select_models(models, base["models"], root)
    keys = [resolve(m, root).key for m in models]
    if weights and len(keys) != 1:
        raise KbNanoError(f"--weights: give exactly one --model with it (got {', '.join(keys)})")
    golden = kbw.golden_settings(base, num_layers, (keys[0], weights) if weights else None)
    return keys, {"models": models, "golden": golden}


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
