"""A worker process: runs one side of a measurement (the baseline, or one candidate) for
as many scenarios as the judge sends it.

The judge (:mod:`kb_nano.kernels.judge`) starts one baseline worker and one worker per
candidate file on its device and keeps them between scenarios (imports, CUDA context and
compiled kernels are paid once). It talks to a worker over a socket: the judge's
requests are pickled dicts (a worker trusts its judge); a worker's replies are JSON
(the judge never unpickles what a worker sends). Inputs arrive in slots the judge shares
with this worker alone (:mod:`kb_nano.kernels.shm`); after every call the worker copies
the outputs into the judge's output slots, untimed.

A candidate's worker is sandboxed before it imports the candidate
(:mod:`kb_nano.kernels.sandbox`: no writes outside its scratch and cache directories, no
access to ``results/``, no signals or ptrace to processes outside it), becomes the child
subreaper of everything the candidate starts, and dies with its judge. Every request is
answered with the rules of :mod:`kb_nano.kernels.checks` and :mod:`kb_nano.kernels.guard`
applied to what it ran.
"""

from __future__ import annotations

import collections
import gc

import torch
import torch.multiprocessing  # noqa: F401  (registers the CUDA IPC reductions used by shm)

from kb_nano.candidates import explain
from kb_nano.kernels import checks, heap, timing
from kb_nano.kernels.build import skip_init, unset_storage
from kb_nano.kernels.inputs import randomize_constant_parameters

WAIT_AFTER_RETURN_S = 0.02  # CPU: how long the output-stability and thread checks watch after a call
# outputs held for the aliasing check (per worker); on the CPU the heap is pre-faulted for
# them (kb_nano.kernels.heap), and a ring of buffers longer than 256 MiB is colder than the
# 2-core EPYC's caches anyway, so it gains nothing over fresh outputs
HOLD_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}
RESERVE_CALLS = 1024  # CPU: heap faulted in before a scenario, for this many calls' outputs (up to HOLD_BYTES)


class Side:
    """The state of one worker: its module for the current scenario, the judge's slots,
    and the outputs it holds for the aliasing check."""

    def __init__(self, spec: dict) -> None:
        from kb_nano import operators

        self.role = spec["role"]
        self.device = torch.device(spec["device"])
        self.op = None
        self.operators = operators
        self.cls = None
        self.module = None
        self.guard = None
        self.inputs: list[list[torch.Tensor]] = []
        self.outputs: list[list[torch.Tensor]] = []
        self.held: collections.deque = collections.deque()
        self.held_bytes = 0
        self.flush = None  # CUDA: the L2 flush (timing.L2Flush)
        self.kernel_timer = None  # CUDA: the CUPTI kernel timer (cupti.KernelTimer)
        self.graph = None
        self.mismatch = None
        self.pending = None
        self.batch_outs: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        self.scenario_inputs: list[dict] = []

    # ------------------------------------------------------------------ scenario
    def supports(self, semantics: str = "") -> dict:
        """A candidate's ``supported_devices`` against this worker's device and its
        ``supported_semantics`` against the scenario's ``semantics`` (``""``: the standard
        form, which every candidate supports; several joined by ``+``, each of which it
        must list; see ``Operator.semantics``): the ``skipped``
        / ``import_error`` violation, or nothing."""
        from kb_nano.candidates import DEFAULT_DEVICES
        from kb_nano.operators.base import SEMANTICS

        supported = getattr(self.cls, "supported_devices", DEFAULT_DEVICES)
        if not isinstance(supported, (tuple, list)) or not all(isinstance(d, str) for d in supported):
            return {
                "violation": [
                    "import_error",
                    f"{self.cls.__name__}.supported_devices must be a tuple of "
                    f"device types like ('cuda',), got {supported!r}",
                ]
            }
        if self.device.type not in tuple(supported):
            return {
                "violation": [
                    "skipped",
                    f"{self.cls.__name__} supports {', '.join(supported)}; this run is on {self.device.type}",
                ]
            }
        declared = getattr(self.cls, "supported_semantics", ())
        if not isinstance(declared, (tuple, list)) or not all(isinstance(d, str) for d in declared):
            return {
                "violation": [
                    "import_error",
                    f"{self.cls.__name__}.supported_semantics must be a tuple of names like ('gemma',), got {declared!r}",
                ]
            }
        missing = [name for name in semantics.split("+") if name and name not in tuple(declared)]
        if missing:
            return {
                "violation": [
                    "skipped",
                    f"{self.cls.__name__} does not list {' and '.join(map(repr, missing))} in supported_semantics; "
                    f"this model's {'; '.join(SEMANTICS.get(name, name) for name in missing)}",
                ]
            }
        return {}

    def setup(self, msg: dict) -> dict:
        """Build this side's module for ``msg["scenario"]``. The baseline: from the
        parameter seed, constant parameters randomized; the reply lists its state_dict
        (``params``: name, shape, dtype), which the judge then has it export into shared
        tensors. A candidate: from its class, built with ``torch.nn.init``'s functions
        deferred (:func:`skip_init`: only the calls on tensors outside its state_dict run),
        loading the state_dict the judge copied from the baseline's export into the tensors
        it shared with this worker alone."""
        from kb_nano.operators.base import DTYPES

        scenario = msg["scenario"]
        self.teardown()
        self.scenario_inputs = scenario["inputs"]
        self.op = self.operators.get(scenario["target"])
        init_args = dict(scenario["init_args"])
        dtype = DTYPES[scenario["dtype"]]
        if self.role == "baseline":
            torch.manual_seed(msg["param_seed"])
            baseline = self.op.baseline(**init_args)
            randomize_constant_parameters(baseline, msg["param_seed"])
            self.module = baseline.to(device=self.device, dtype=dtype).eval()
            params = [
                [k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in self.module.state_dict().items()
            ]
            return {"ok": True, "params": params}
        try:
            # its parameters are the baseline's (loaded next): torch.nn.init's functions are
            # skipped while it is built, as transformers' from_pretrained builds a model
            with skip_init() as deferred:
                module = self.cls(**init_args)
            deferred.replay(module)
        except Exception as exc:
            return {
                "violation": [
                    "import_error",
                    f"constructor {self.cls.__name__}({', '.join(f'{k}=...' for k in sorted(init_args))}): {explain(exc)}",
                ]
            }
        try:
            # moved and cast first: its (unset) parameters take the loaded values in place,
            # device to device (the same values as loading first, the cast being exact);
            # what the state_dict loads gets fresh storage instead of a cast of its unset
            # values (a 128256 x 4096 fp32 embedding: 3-4 s of page faults on the CPU)
            unset_storage(module, self.device, dtype)
            module = module.to(device=self.device, dtype=dtype)
            module.load_state_dict(dict(zip(msg["names"], self.params)), strict=True)
        except Exception as exc:
            return {
                "violation": [
                    "import_error",
                    f"{self.cls.__name__} moved to the device and dtype, then loading the baseline's state_dict: "
                    f"{explain(exc)} (its state_dict keys and shapes must be the baseline's: kb_nano kernels --list)",
                ]
            }
        finally:
            self.params = []
        self.module = module.eval()
        return {"ok": True, "violation": self.check_guard("while building the module")}

    def export(self, tensors: list[torch.Tensor]) -> None:
        """Baseline: copy its state_dict (in ``params`` order) into the judge's tensors
        (which it does not keep: the judge gives them to the candidate next)."""
        for t, v in zip(tensors, self.module.state_dict().values()):
            t.copy_(v)
        if self.device.type == "cuda":
            timing._synchronize(self.device)

    def teardown(self) -> None:
        """Forget the scenario (module, slots, held outputs, graph)."""
        self.module = self.graph = self.mismatch = self.pending = None
        self.inputs, self.outputs = [], []
        self.held.clear()
        self.held_bytes = 0
        if self.device.type == "cpu":
            heap.release()
        if self.role == "candidate":
            gc.collect()  # a candidate's reference cycles (what the worker imported is frozen: gc.freeze)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # an idle worker keeps its context, not the scenario's memory

    def check_guard(self, when: str):
        return self.guard.check(when) if self.guard is not None else None

    def set_outputs(self, slots: list[list[torch.Tensor]]) -> None:
        """The judge's output slots (``[call][output]``); on the CPU, fault in the heap the
        held outputs will take (:func:`kb_nano.kernels.heap.reserve`)."""
        self.outputs = slots
        if self.device.type == "cpu" and slots:
            per_call = sum(t.numel() * t.element_size() for t in slots[0] if t is not None)
            heap.reserve(min(HOLD_BYTES["cpu"], per_call * RESERVE_CALLS))

    # ------------------------------------------------------------------ calls
    def call(self, k: int):
        return checks.dense_outputs(self.module(*self.inputs[k]))

    def _slot_outputs(self, k: int, out) -> tuple[list, list | None, tuple | None]:
        """Call ``k``'s flattened outputs, the judge's output slot ``k`` (None before the
        slots exist) and the violation when an output is invalid or does not fit it."""
        outs = checks.flatten_outputs(out)
        bad = checks.invalid_outputs(out, self.device)
        dest = self.outputs[k] if self.outputs else None
        if bad is None and dest is not None and not _matches(outs, dest):
            bad = ("incorrect_shape", f"a timed call returned {spec_of(out)}")
        return outs, dest, bad

    def keep(self, k: int, out) -> None:
        """Untimed, after call ``k``: copy its outputs into the judge's output slot ``k``
        and hold the output objects; an invalid output or one the slot does not fit is
        remembered in ``mismatch`` (reported at the end of the batch)."""
        outs, dest, bad = self._slot_outputs(k, out)
        if bad is not None:
            self.mismatch = self.mismatch or bad
            return
        if dest is not None:
            for o, d in zip(outs, dest):
                if d is not None:
                    d.copy_(o)
        mutable = [t for name, t in zip(self._names(), self.inputs[k]) if name in self.op.mutable_inputs]
        for o in outs:
            if isinstance(o, torch.Tensor) and not any(checks._overlap(o, m) for m in mutable):
                self.batch_outs.append(o)
                self.held.append(o)
                self.held_bytes += o.numel() * o.element_size()
        budget = HOLD_BYTES.get(self.device.type, 1 << 30)
        while self.held_bytes > budget and len(self.held) > 1:
            old = self.held.popleft()
            self.held_bytes -= old.numel() * old.element_size()

    def _names(self) -> list[str]:
        return [s["name"] for s in self.scenario_inputs]

    def checked_call(self, k: int, when: str, watch: bool = True) -> dict:
        """One correctness trial on slot ``k`` with every rule (``watch``: also watch the
        outputs for :data:`WAIT_AFTER_RETURN_S` after the return); returns the reply."""

        names = self._names()
        before = {n: b.clone() for n, b in zip(names, self.inputs[k])}
        threads = checks.thread_idents()
        try:
            out = self.call(k)
        except Exception as exc:
            return {"violation": ["runtime_error", f"{when}: {explain(exc)}"]}
        threads_left = checks.ThreadWatch(threads)
        invalid = checks.invalid_outputs(out, self.device)
        snap = None if invalid else checks.snapshot(out)
        held = list(self.held)
        inputs = dict(zip(names, self.inputs[k]))
        allowed = tuple(self.op.mutable_inputs)
        wait_s = WAIT_AFTER_RETURN_S if watch else 0.0
        for rule in (
            lambda: invalid,
            lambda: self.check_guard(f"{when}, during the call"),
            lambda: checks.changed_after_return(out, snap, self.device, wait_s),
            threads_left.check,
            lambda: checks.aliased_outputs(out, inputs, allowed, held),
            lambda: checks.mutated_inputs(before, inputs, allowed),
        ):
            found = rule()
            if found:
                return {"violation": [found[0], f"{when}: {found[1]}"], "spec": spec_of(out)}
        self.keep(k, out)
        return {"spec": spec_of(out)}

    def batch(self, msg: dict) -> dict:
        """Calls, one per slot in ``msg["start"]:msg["stop"]``; ``mode``: ``warmup``
        (untimed, outputs not kept), ``time`` (the eager timer), ``kernel`` (CUDA: the CUPTI
        kernel timer), ``capture`` (CUDA: the slots' calls captured in one CUDA graph, not
        timed) or ``graph`` (that graph replayed ``msg["replays"]`` times back to back; each
        call's time is their time divided by replays x calls)."""

        slots = range(msg["start"], msg["stop"])
        mode = msg["mode"]
        threads = checks.thread_idents()
        older = list(self.held)
        self.mismatch = None
        self.batch_outs = []
        reply: dict = {}
        try:
            with torch.inference_mode():
                if mode == "warmup":
                    reply["times_ms"] = timing.time_calls(self.call, slots, self.device, self.flush, _drop)
                elif mode == "time":
                    reply["times_ms"] = timing.time_calls(self.call, slots, self.device, self.flush, self.keep)
                elif mode == "kernel":
                    reply = self.kernel_timer.time_calls(self.call, slots, self.keep)
                elif mode == "capture":
                    self.graph = None
                    self.graph = self.capture(slots)
                    return {"ok": True}
                elif mode == "graph":
                    replays = max(1, int(msg.get("replays", 1)))
                    graph, copies, self.mismatch = self.graph
                    ms = timing.time_graph(graph, self.device, self.flush, replays)
                    reply["times_ms"] = [ms / replays / len(slots)] * len(slots)
                    if copies is not None:
                        copies.replay()  # the static outputs into the judge's slots: one launch, whatever K
                    timing._synchronize(self.device)
        except Exception as exc:
            if mode == "capture":
                return {"graph_error": explain(exc)}
            return {"violation": ["runtime_error", f"during the timed calls ({mode}): {explain(exc)}"]}
        if mode != "warmup":
            # the rules run in a separate request (check_batch), outside the judge's clock
            self.pending = (checks.ThreadWatch(threads), older)
        return reply

    def capture(self, slots: range) -> tuple:
        """The slots' calls in one CUDA graph, and a second graph that copies its static
        outputs (the same tensors every replay) into the judge's output slots: after a
        timed replay the copies cost one host launch, not one per output (a per-output
        ``copy_`` costs more for an output that is a view of an input, and the judge's
        clock around the batch would take the difference for hidden work). The outputs'
        kinds and shapes are checked here, once. Returns ``(graph, copies, violation)``."""
        graph, outs = timing.capture_graph(self.call, slots, self.device)
        pairs, bad = [], None
        for k, out in zip(slots, outs):
            flat, dest, bad = self._slot_outputs(k, out)
            if bad is not None:
                break
            if dest is not None:
                pairs += [(d, o) for o, d in zip(flat, dest) if d is not None]
        return graph, timing.capture_copies(pairs, self.device), bad

    def check_batch(self) -> dict:
        """The rules over the last batch (threads it left running, its outputs, the guard)."""
        if self.pending is None:
            return {}
        watch, older = self.pending
        self.pending = None
        found = self._batch_outputs(older) or watch.check() or self.check_guard("during the timed calls")
        return {"violation": list(found)} if found else {}

    def _batch_outputs(self, older: list):
        """Rules over a batch's outputs at its end: plain tensors of the shapes the judge's
        slots have, and no two outputs (this batch's, or an earlier one's still held)
        sharing memory."""
        if self.mismatch is not None:
            return self.mismatch
        if checks.first_overlap(self.batch_outs, older) is not None:
            return "output_aliased", (
                "an output of a timed call shares memory with the output of an earlier call: "
                "a reused buffer is overwritten by the next call"
            )
        return None


def _drop(k: int, out) -> None:
    """Warm-up calls keep nothing."""


def _matches(outs: list, dest: list) -> bool:
    """Whether a call's outputs have the shapes and dtypes of the judge's output slot."""
    return len(outs) == len(dest) and all(
        (o is None and d is None)
        or (isinstance(o, torch.Tensor) and d is not None and tuple(o.shape) == tuple(d.shape) and o.dtype == d.dtype)
        for o, d in zip(outs, dest)
    )


def spec_of(out) -> dict:
    """JSON description of a call's outputs: ``{"kind", "outputs": [[shape, dtype] | type name]}``."""
    kind = "Tensor" if isinstance(out, torch.Tensor) else type(out).__name__
    items = []
    for o in checks.flatten_outputs(out):
        if isinstance(o, torch.Tensor):
            items.append([list(o.shape), str(o.dtype).removeprefix("torch.")])
        else:
            items.append(type(o).__name__)
    return {"kind": kind, "outputs": items}
