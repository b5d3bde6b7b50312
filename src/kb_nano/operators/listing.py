"""The operator registry as ``kb_nano kernels --list`` shows it: per operator its level,
category, baseline module, the candidate contract (the baseline's constructor and forward
signatures, :func:`kb_nano.operators.base.contract`), where it sits in a model, and the
baseline's ``state_dict`` keys with their per-rank shapes for one concrete model, built on
the meta device (no memory, no weights drawn). And as ``kernels --map`` shows it: per
configured model, the operators it uses with their per-rank input shapes at each TP
(:func:`map_tables`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table

from kb_nano import operators
from kb_nano.console import Column, fit_table
from kb_nano.errors import KbNanoError
from kb_nano.operators.base import NotApplicable, Operator, contract

# ``drop``: left out first on a narrow terminal (kb_nano.console.fit_table)
LIST_COLUMNS = (
    Column("target"),
    Column("level", drop=2),
    Column("category", drop=2),
    Column("baseline module", wrap=True, min_width=12, drop=3),
    Column("candidate contract: constructor, forward", wrap=True, min_width=30, max_width=72),
    Column("used in", wrap=True, min_width=16, max_width=40, drop=1),
    Column("baseline state_dict: keys, per-rank shapes", wrap=True, min_width=24, max_width=64, drop=4),
)


def state_dict_shapes(op: Operator, init_args: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The ``(key, shape)`` pairs of the state_dict of ``op``'s baseline built with
    ``init_args`` (one TP rank's module, :attr:`Operator.init_args`) on the meta device:
    no memory is allocated and no initial value drawn, so even a 128256 x 4096 embedding
    takes microseconds. Keys in the baseline's order; ``[]`` for a baseline without
    parameters or persistent buffers. Raises what the baseline's constructor raises."""
    with torch.device("meta"):
        module = op.baseline(**init_args)
    return [(key, tuple(t.shape)) for key, t in module.state_dict().items()]


def _indices(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}..{values[-1]}}}"
    return "{" + ",".join(map(str, values)) + "}"


def state_dict_lines(shapes: list[tuple[str, tuple[int, ...]]]) -> list[str]:
    """One ``key [d0, d1, ...]`` line per state_dict entry of ``shapes`` (from
    :func:`state_dict_shapes`), except that keys differing only in their integer path
    segments (layer or expert indices) with the same shape share one line when they cover
    every combination of those indices: ``model.layers.{0,1}.mlp.up_proj.weight [14336,
    4096]`` (``{0..31}`` for a run of more than two). ``["(none)"]`` when empty."""
    if not shapes:
        return ["(none)"]
    groups: dict[tuple[str, tuple[int, ...]], list[tuple[int, ...]]] = {}
    for key, shape in shapes:
        parts = key.split(".")
        pattern = ".".join("{}" if p.isdigit() else p for p in parts)
        groups.setdefault((pattern, shape), []).append(tuple(int(p) for p in parts if p.isdigit()))
    lines = []
    for (pattern, shape), found in groups.items():
        axes = [sorted({f[i] for f in found}) for i in range(len(found[0]))]
        # keys are unique, so as many index tuples as combinations means every combination
        if math.prod(len(a) for a in axes) == len(found):
            keys = [pattern.format(*(_indices(a) for a in axes))]
        else:
            keys = [pattern.format(*f) for f in found]
        lines += [f"{k} [{', '.join(map(str, shape))}]" for k in keys]
    return lines


class ModelExamples:
    """The (model, TP) pairs a state_dict's shapes are taken from, in order: every model
    of ``specs`` (the configured ones, as ``kernels --map`` takes them) at each of ``tps``,
    then the other models of the registry (``config/models/models.yaml``) at ``tps`` and
    TP 1, for an operator no configured model uses. Each model's facts
    (:func:`kb_nano.models.configs.model_facts` with its config.json fields) are loaded on
    first use. Raises ``KbNanoError`` for a spec that names no model or a TP below 1."""

    def __init__(self, root: Path, specs: list[str], tps: list[int]) -> None:
        from kb_nano.models.configs import load_index, resolve

        self.root = Path(root)
        self.configured = [resolve(spec, self.root) for spec in specs]
        keys = {ref.key for ref in self.configured}
        self.other_keys = [key for key in load_index(self.root) if key not in keys]  # resolved when reached
        bad = [tp for tp in tps if not isinstance(tp, int) or tp < 1]
        if bad:
            raise KbNanoError(
                f"tp {bad[0]!r}: a tensor-parallel degree is a positive integer (--tp or the config's tp)"
            )
        self.tps = list(tps)
        self._facts: dict[str, dict] = {}

    def facts(self, ref) -> dict:
        """The kb-nano facts of model ``ref`` with its config.json fields (``hf_config``)
        and what its own modules compute (``hidden_norm``, ``attention_layers``, as the
        manifest reads them: :func:`kb_nano.models.module_tree.read`)."""
        from kb_nano.models import module_tree
        from kb_nano.models.configs import config_fields, load_config, model_facts

        if ref.key not in self._facts:
            fields = config_fields(ref, self.root)
            self._facts[ref.key] = {
                **model_facts(load_config(ref, self.root), ref),
                "hf_config": fields,
                **module_tree.read(fields),
            }
        return self._facts[ref.key]

    def pairs(self) -> Iterator[tuple[object, int, bool]]:
        """``(model ref, tp, configured)`` in the order above."""
        for ref in self.configured:
            for tp in self.tps:
                yield ref, tp, True
        from kb_nano.models.configs import resolve

        for key in self.other_keys:
            ref = resolve(key, self.root)
            for tp in dict.fromkeys([*self.tps, 1]):
                yield ref, tp, False

    def first(self, op: Operator) -> tuple[str, int, bool, dict] | None:
        """``(model key, tp, configured, init args)`` of the first pair, and of its first
        layer kind (``op.layer_kinds``: gpt-oss's attention with sinks), ``op`` applies to
        (its ``applies_to`` and ``init_args`` rules, as ``kernels --map`` asks them);
        None when it applies to none."""
        for ref, tp, configured in self.pairs():
            for _, overrides in op.layer_kinds(self.facts(ref)):
                facts = {**self.facts(ref), **overrides}
                if not op.applies_to(facts):
                    continue
                try:
                    return ref.key, tp, configured, op.init_args(facts, tp)
                except NotApplicable:
                    continue
        return None


def state_dict_text(op: Operator, examples: ModelExamples) -> str:
    """The state_dict cell of ``op``: ``(none)`` for a baseline without parameters, else
    the model and TP the shapes are from (``of llama31-8b tp=1:``; ``(not configured)``
    when only a registry model outside the configured ones uses ``op``) and one line per
    key (:func:`state_dict_lines`); ``(no model of the registry applies)`` when none does."""
    found = examples.first(op)
    if found is None:
        return "(no model of the registry applies)"
    key, tp, configured, init_args = found
    lines = state_dict_lines(state_dict_shapes(op, init_args))
    if lines == ["(none)"]:
        return "(none)"
    head = f"of {key} tp={tp}" + ("" if configured else " (not configured)") + ":"
    return "\n".join([head, *lines])


def operator_table(
    examples: ModelExamples, level: int | None = None, width: int | None = None, title: str = "kb-nano operators"
) -> tuple[Table, int]:
    """The ``kernels --list`` table of every operator (only those of ``level`` when given)
    fitted to ``width`` terminal columns (:func:`kb_nano.console.fit_table`; the
    state_dict column is left out first, then the baseline module, then level and
    category, then where it is used; target and contract always stay), and the number of
    operators in it. State_dict shapes from :meth:`ModelExamples.first` of each."""
    from kb_nano.models.configs import config_imports_only

    cells = []
    with config_imports_only():  # transformers reads configs and builds on the meta device only
        for name in operators.names():
            op = operators.get(name)
            if level and op.level != level:
                continue
            init, forward = contract(op.baseline)
            cells.append(
                [
                    name,
                    f"L{op.level}",
                    op.category,
                    op.baseline.__module__,
                    escape("\n".join(filter(None, (init, forward, op.contract_note)))),
                    escape(op.used_in),
                    escape(state_dict_text(op, examples)),
                ]
            )
    return fit_table(list(LIST_COLUMNS), cells, width, title), len(cells)


def list_lines(count: int, level: int | None) -> str:
    """The line under ``kernels --list``'s table: the candidate contract when the table has
    ``count`` operators, else the levels that have any (``level`` filtered them all out)."""
    if count:
        return (
            "a candidate (candidates/<target>/<name>.py) is one nn.Module taking the constructor's arguments and "
            "forward's inputs above, with the baseline's state_dict keys and shapes (docs/kernels.md#candidates)"
        )
    present = ", ".join(sorted({f"L{e.level}" for e in operators.CATALOG.values()}))
    return f"no operators at level {level} yet (levels present: {present})"


def shape_text(spec: dict) -> str:
    """One input of an operator's scenario as ``kernels --map`` shows it: its name and
    shape with the token dimension (the first) as ``N``, e.g. ``x[N, 28672]``. ``spec``:
    an input spec of :meth:`kb_nano.operators.base.Operator.inputs` (``name``, ``shape``)."""
    dims = ["N" if i == 0 else str(d) for i, d in enumerate(spec["shape"])]
    return f"{spec['name']}[{', '.join(dims)}]"


def map_tables(examples: ModelExamples) -> Iterator[Table]:
    """The ``kernels --map`` tables, one per configured model of ``examples`` (in order,
    each built when reached): the title gives the model's key, Hub id (or config file),
    architecture and kernel-relevant sizes; one row per operator that applies to the model
    (target, level, where it is used) with one column per TP of ``examples`` holding the
    per-rank input shapes of one scenario (:func:`shape_text`; ``n/a: <reason>`` where the
    operator's rules rule that TP out, ``n/a: not covered: ...`` where the model's module
    computes a form kb-nano does not measure); one row per layer kind of the operator
    (``attention (sliding4096, sliding_window)``, ``attention (full)``, each with how many
    of the model's layers are of that kind in "used in"), and non-standard
    semantics named (``rms_norm (gemma)``); an operator's ``map_variants`` labelled
    (``prefill: ...; decode ctx256: ...`` for multi-head latent attention). Raises what loading a model's config raises
    (``KbNanoError`` for a missing or unreadable config)."""
    for ref in examples.configured:
        facts = examples.facts(ref)
        table = Table(
            title=f"{ref.key} ({ref.hub_id or ref.config_path}) — {facts['architecture']}: hidden {facts['hidden_size']}, "
            f"heads {facts['num_attention_heads']}/{facts['num_key_value_heads']} kv, head_dim {facts['head_dim']}, "
            f"intermediate {facts['intermediate_size']}, vocab {facts['vocab_size']}, rope {facts['rope']['rope_type']}"
        )
        for col in ("target", "level", "used in", *(f"tp={tp} per-rank inputs" for tp in examples.tps)):
            table.add_column(col, overflow="fold")
        for name in operators.names():
            op = operators.get(name)
            for kind, overrides in op.layer_kinds(facts):
                kind_facts = {**facts, **overrides}
                if not op.applies_to(kind_facts):
                    continue
                cells = []
                shown = op.map_variants(kind_facts)
                for tp in examples.tps:
                    try:
                        init = op.init_args(kind_facts, tp)
                        texts = [
                            (f"{label}: " if len(shown) > 1 else "")
                            + ", ".join(
                                shape_text(s) for s in op.inputs(init, kind_facts, tp, 1, facts["dtype"], **extra)
                            )
                            for label, extra in shown
                        ]
                        cells.append("; ".join(texts))
                    except NotApplicable as exc:
                        cells.append(f"n/a: {exc}")
                label = ", ".join(filter(None, (kind, op.semantics(kind_facts))))
                layers = (overrides.get("attention_kind") or {}).get("layers")
                where = op.used_in + (f" ({layers} of {facts['num_hidden_layers']} layers)" if layers else "")
                table.add_row(f"{name} ({label})" if label else name, f"L{op.level}", where, *cells)
        yield table


def print_listing(root: Path, specs: list[str], tps: list[int], level: int | None = None, map_: bool = False) -> int:
    """``kernels --list [--level N]``: the operator registry with each candidate contract
    and the baseline's state_dict shapes (:func:`operator_table`); with ``map_``
    (``kernels --map``): each model's operators with their per-rank input shapes at each
    TP (:func:`map_tables`). For the models ``specs`` and the TPs ``tps`` of the workflow
    at ``root``; fitted to the console's width. Returns 0."""
    from kb_nano.console import make_console

    examples = ModelExamples(root, specs, tps)
    console = make_console()
    if map_:
        for table in map_tables(examples):
            console.print(table)
        return 0
    title = "kb-nano operators" + (f" (level {level})" if level else "")
    table, count = operator_table(examples, level, console.width, title)
    console.print(table)
    console.print(list_lines(count, level))
    return 0
