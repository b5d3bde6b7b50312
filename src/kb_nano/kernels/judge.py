"""The judge: one Tier-1 measurement, a candidate against the baseline on one scenario,
with the candidate and the baseline each in a worker process of their own.

The judge owns everything that decides the row. It draws the seed from the OS, makes
every input value, shares them with each worker separately, collects the outputs into its
own memory and compares every one of them with the baseline's, checks the candidate's
input slots, times each batch of calls with its own clock, watches the candidate's CPU
use while the baseline runs, and alone writes the (signed) shard. Steps:

1. The candidate's worker (sandboxed, candidate imported once per file) and the baseline
   worker build their modules from the same parameter seed.
2. Correctness trials: ``num_trials`` on fresh random values (trial ``t`` reuses the slot
   of trial ``t - 2`` with new values) plus the operator's edge cases
   (:data:`kb_nano.kernels.inputs.EDGE_CASES`), every rule applied by the worker, every
   output compared by the judge.
3. Warm-up, then blocks until the interval is narrow enough (:mod:`kb_nano.kernels.blocks`):
   per block an ABAB pair of batches per timer (eager; on CUDA also the CUPTI kernel
   timer and a CUDA-graph replay), each batch one call per slot on new values; every
   output compared (as the batch left it, before the worker's rules run); the candidate's
   slots compared with the judge's copy.
4. The judge's clock around each batch against the times the worker reported
   (:func:`kb_nano.kernels.blocks.hidden_ms`; CPU: the eager batches, CUDA: the graph replays, whose batches are
   all device time), and the timers against each other (:mod:`kb_nano.kernels.measure`).
5. One more checked call on new values, then the statistics, the interval over blocks
   and the roofline review.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kb_nano import operators
from kb_nano.kernels import blocks, timing
from kb_nano.kernels.checks import freeze, same_bits
from kb_nano.kernels.compare import compare, spec_mismatch, tolerance
from kb_nano.kernels.inputs import Refresher, apply_edge_case, generator, make_inputs, param_seed
from kb_nano.kernels.pool import Pool, WorkerHandle
from kb_nano.kernels.procs import LIVE_WORKERS, WORKERS_LOCK, kill_tree, process_tampering, strays, wait_idle
from kb_nano.kernels.shm import SharedTensors
from kb_nano.kernels.verdict import Verdict, ask, reported_times
from kb_nano.operators.base import DTYPES

IDLE_CPU_S = 0.005  # CPU a candidate's process may use while the baseline is timed (+10% of that batch)
SETTLE_S = 10.0  # before timing, wait this long at most for the candidate's processes to go idle
SETTLE_WINDOW_S = 0.03  # ... idle: less than 5% of a CPU in a window this long
GRAPH_BATCH_MS = 8.0  # device time of a graph batch: the judge's clock around it resolves a 10% forgery
MAX_REPLAYS = 200  # graph replays per batch at most
HIDDEN_FRACTION = 0.1  # a candidate's batch may exceed its reported call times + the baseline's overhead by 10%
HIDDEN_FLOOR_MS = {"cpu": 0.5, "cuda": 0.1}  # ... plus this jitter allowance per batch
ERROR_FIELDS = ("max_abs_err", "max_rel_err", "tolerance_used")  # the row's columns of compare's errors


class Measurement:
    """The judge's state during one scenario (see the module docstring)."""

    def __init__(
        self,
        scenario: dict,
        settings: dict,
        root: Path,
        pool: Pool,
        base: WorkerHandle,
        cand: WorkerHandle,
        device: torch.device,
        seed: int,
        deadline: float,
    ) -> None:
        self.scenario, self.settings, self.root, self.pool = scenario, settings, Path(root), pool
        self.base, self.cand, self.device, self.seed, self.deadline = base, cand, device, seed, deadline
        self.op = operators.get(scenario["target"])
        self.specs = scenario["inputs"]
        self.atol, self.rtol = tolerance(scenario, settings)
        self.golden = settings.get("golden")
        self.source = "random"
        self.worst = [0.0, 0.0, 0.0]  # max_abs_err, max_rel_err, tolerance_used
        self.compared = False  # whether any output was compared (rows of earlier failures carry no error)
        self.frozen: dict | None = None  # the candidate's slots as its last batch left them (freeze)
        self.shared: list[SharedTensors] = []
        self.phases: dict[str, float] = {}  # seconds per step (prepare, measure._run), for the job log
        self.clock = blocks.SmClock(device)

    def close(self) -> None:
        for s in self.shared:
            s.close()
        self.shared = []

    def prepare(self) -> None:
        """Build both modules and learn the output spec from the baseline (two slots)."""
        ask(self.cand, {"cmd": "supports", "semantics": self.scenario.get("semantics", "")}, self.deadline)
        t = time.perf_counter()
        reply = ask(
            self.base, {"cmd": "setup", "scenario": self.scenario, "param_seed": param_seed(self.seed)}, self.deadline
        )
        self.phases["baseline build"] = -t + (t := time.perf_counter())
        specs = [(shape, getattr(torch, dtype)) for _, shape, dtype in reply["params"]]
        # The baseline writes its parameters into tensors shared with it, drops them, and
        # the same tensors go to the candidate (no memory stays shared between the two).
        params = SharedTensors(specs, self.device)
        try:
            ask(self.base, {"tag": "params", "pattern": [True] * len(specs)}, self.deadline, params)
            ask(self.cand, {"tag": "params", "pattern": [True] * len(specs)}, self.deadline, params)
            self.phases["parameter copy"] = -t + (t := time.perf_counter())
            ask(
                self.cand,
                {"cmd": "setup", "scenario": self.scenario, "names": [n for n, _, _ in reply["params"]]},
                self.deadline,
            )
            self.phases["candidate build"] = time.perf_counter() - t
        finally:
            params.close()
        gen = generator(self.device, self.seed)
        self.first, self.source = make_inputs(self.scenario, gen, str(self.device), self.golden, self.root, draw=0)
        self.out_spec = None
        self.make_slots(2)
        self._fill(0, self.first)
        self.out_spec = ask(self.base, {"cmd": "probe"}, self.deadline)["spec"]
        self.share_outputs()

    def per_slot_bytes(self) -> int:
        from kb_nano.operators.base import spec_bytes

        outs = [o for o in (self.out_spec or {"outputs": []})["outputs"] if isinstance(o, list)]
        out_bytes = sum(
            torch.Size(s).numel() * torch.empty((), dtype=getattr(torch, d)).element_size() for s, d in outs
        )
        return 3 * sum(spec_bytes(s) for s in self.specs) + 2 * out_bytes

    def make_slots(self, k: int) -> None:
        """``k`` slots for each side: one shared ``[k, *shape]`` tensor per input (and,
        once the output spec is known, per tensor output), plus the judge's own copy
        of the inputs (``src``)."""
        self.close()
        self.k = k
        in_specs = [([k, *s["shape"]], DTYPES[s["dtype"]]) for s in self.specs]
        self.src = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in in_specs]
        self.ins, self.outs = {}, {}
        for side, worker in (("base", self.base), ("cand", self.cand)):
            self.ins[side] = self._share(in_specs, [True] * len(in_specs), worker, "inputs")
        if self.out_spec is not None:
            self.share_outputs()

    def share_outputs(self) -> None:
        """One shared ``[k, *shape]`` tensor per tensor output of the baseline's spec, for
        each side."""
        outputs = self.out_spec["outputs"]
        pattern = [isinstance(o, list) for o in outputs]
        specs = [([self.k, *o[0]], getattr(torch, o[1])) for o in outputs if isinstance(o, list)]
        for side, worker in (("base", self.base), ("cand", self.cand)):
            self.outs[side] = self._share(specs, pattern, worker, "outputs")

    def _share(self, specs, pattern, worker, tag) -> list:
        shared = SharedTensors(specs, self.device)
        self.shared.append(shared)
        ask(worker, {"tag": tag, "pattern": pattern}, self.deadline, shared)
        it = iter(shared.tensors)
        return [next(it) if present else None for present in pattern]

    def _fill(self, k: int, values=None) -> None:
        """Slot ``k`` of both sides := ``values`` (or the judge's source slot ``k``);
        on CUDA synchronized before any worker reads it (another process: no stream
        order between the judge's copies and the worker's kernels)."""
        for i, src in enumerate(self.src):
            if values is not None:
                src[k].copy_(values[i])
            for side in ("base", "cand"):
                self.ins[side][i][k].copy_(src[k])
        self._sync()

    def _fill_all(self, n: int) -> None:
        for side in ("base", "cand"):
            self._fill_side(side, n, sync=False)
        self._sync()

    def _fill_side(self, side: str, n: int, sync: bool = True) -> None:
        for i, src in enumerate(self.src):
            self.ins[side][i][:n].copy_(src[:n])
        if sync:
            self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_slots(self, sl: slice, when: str) -> None:
        """Every candidate output of the slots ``sl`` against the baseline's; the
        candidate's read-only inputs against the judge's copy."""
        self._sync()
        allowed = self.op.mutable_inputs
        frozen, self.frozen = self.frozen, None
        if frozen is not None and frozen["sl"] == (sl.start, sl.stop):  # what the batch left (batch)
            ins, outs = frozen["ins"], frozen["outs"]
        else:
            ins, outs = [t[sl] for t in self.ins["cand"]], [None if o is None else o[sl] for o in self.outs["cand"]]
        for spec, t, s in zip(self.specs, ins, self.src):
            if spec["name"] not in allowed and not same_bits(t, s[sl]):
                raise Verdict(
                    "input_mutated",
                    f"{when}: the call changed input {spec['name']!r}; "
                    f"this operator may write {', '.join(allowed) or 'no input'}",
                )
        refs = [None if o is None else o[sl] for o in self.outs["base"]]
        status, error, *errs = compare(refs, outs, self.atol, self.rtol)
        if status != "passed":
            raise Verdict(status, f"{when}: {error}", **dict(zip(ERROR_FIELDS, errs)))
        self.worst = [max(w, e or 0.0) for w, e in zip(self.worst, errs)]
        self.compared = True

    def trial(self, k: int, values, when: str, watch: bool = True) -> None:
        """One checked call of each side on ``values`` in slot ``k`` (``watch``: the
        worker also watches the outputs for a while after the return)."""
        self._fill(k, values)
        ask(self.base, {"cmd": "trial", "slot": k, "when": when, "watch": False}, self.deadline)
        reply = ask(self.cand, {"cmd": "trial", "slot": k, "when": when, "watch": watch}, self.deadline)
        found = spec_mismatch(self.out_spec, reply.get("spec") or {})
        if found:
            raise Verdict(found[0], f"{when}: {found[1]}")
        self._check_slots(slice(k, k + 1), when)

    def trials(self) -> int:
        """The correctness trials; returns how many ran."""
        num = max(2, int(self.settings.get("num_trials") or 3))
        gen = generator(self.device, self.seed)
        cases = list(self.op.edge_cases)
        total = num + len(cases)
        for t in range(total):
            if t == 0:
                values = self.first
                make_inputs(self.scenario, gen, str(self.device), self.golden, self.root, draw=0)  # keep gen in step
            else:
                values, _ = make_inputs(
                    self.scenario, gen, str(self.device), self.golden if t < num else None, self.root, draw=t
                )
            if t >= num:
                apply_edge_case(values, self.specs, cases[t - num])
                when = f"edge-case trial {cases[t - num]!r}"
            else:
                when = f"correctness trial {t + 1} of {num}"
            self.trial(t % 2, values, when, watch=t < 2)
        return num

    def batch(self, worker: WorkerHandle, start: int, stop: int, mode: str, replays: int = 1) -> tuple[dict, float]:
        """One batch of ``worker``; returns its reply and the judge's clock around it (ms)."""
        t0 = timing.now_ns()
        msg = {"cmd": "batch", "start": start, "stop": stop, "mode": mode, "replays": replays}
        reply = ask(worker, msg, self.deadline)
        elapsed = (timing.now_ns() - t0) / 1e6
        if worker is self.cand and mode != "warmup" and "graph_error" not in reply:
            # checked as the batch left them: work in the rules (a replaced check) writes nothing read
            self._sync()
            self.frozen = freeze(self.specs, self.ins["cand"], self.outs.get("cand", []), self.op, start, stop)
            ask(worker, {"cmd": "check"}, self.deadline)  # the worker's rules, outside the clock
        return reply, elapsed

    def refresher(self, first_draw: int) -> Refresher:
        """Fresh values for the current slots (see :class:`kb_nano.kernels.inputs.Refresher`)."""
        golden = self.golden if self.source == "golden" else None
        return Refresher(self.scenario, self.src, self.seed, golden, self.root, first_draw)

    def timed(self, first_draw: int) -> dict:
        """Warm-up (two slots), then the batch size from the baseline's warm-up times
        (:func:`batch_calls`), the CUDA graphs captured, then blocks until
        :func:`kb_nano.kernels.blocks.stop_reason` says so. Returns the samples
        (:func:`kb_nano.kernels.blocks.new_samples`). Raises :class:`Verdict`."""
        num_runs, num_warmup = int(self.settings["num_runs"]), int(self.settings["num_warmup"])
        self.check_scheduling()
        wait_idle(self.cand.cpu_s, SETTLE_S, SETTLE_WINDOW_S)
        refresh = self.refresher(first_draw)
        warm = []
        for done in range(0, max(num_warmup, 2), self.k):
            n = min(self.k, max(num_warmup, 2) - done)
            self._refill(refresh, n)
            warm += reported_times(self.batch(self.base, 0, n, "warmup")[0], "times_ms", n, "base")
            self.batch(self.cand, 0, n, "warmup")
        k = blocks.batch_calls(float(timing.summarize(warm)[0]), self.per_slot_bytes(), self.device, num_runs)
        if k != self.k:
            self.make_slots(k)
            refresh = self.refresher(first_draw + 8)
        self.refresh = refresh
        cuda = self.device.type == "cuda"
        # CUDA: the eager and kernel batches need only num_runs calls over the blocks; the slots
        # (all replayed by the graph) make a batch long enough for the judge's clock
        self.n = min(self.k, max(2, -(-num_runs // blocks.MIN_BLOCKS["cuda"]))) if cuda else self.k
        s = blocks.new_samples()
        if not cuda:
            s["errors"].update(kernel="CPU", graph="CPU")
        elif not self.settings.get("cuda_graph", True):
            s["errors"]["graph"] = "cuda_graph: false"
        else:
            self._refill(self.refresh, self.k)
            for side, worker in (("baseline", self.base), ("candidate", self.cand)):
                reply = self.batch(worker, 0, self.k, "capture")[0]
                if "graph_error" in reply:
                    s["errors"]["graph"] = f"{side}: {reply['graph_error']}"
                    break
        s["started"] = time.monotonic()
        least = blocks.least_blocks(self.device, self.settings)
        while s["stop"] is None:
            which = blocks.basis(self.settings.get("speedup_basis"), self.device, s["errors"])
            # past the least blocks, only the basis timer narrows the interval the stop waits for
            self.block(s, only=which if cuda and s["blocks"] >= least else None)
            s["stop"] = blocks.stop_reason(s, which, self.device, self.settings)
        s["basis"] = which
        return s

    def block(self, s: dict, only: str | None = None) -> None:
        """One block: an ABAB pair of batches per timer that has samples (eager; on CUDA
        also the kernel timer and a graph replay), or of timer ``only``; then the SM clock."""
        for timer, n in (("eager", self.n), ("kernel", self.n), ("graph", self.k)):
            if timer not in s["errors"] and only in (None, timer):
                t = time.perf_counter()
                self.pair(s, timer, n)
                self.phases[f"{timer} pairs"] = self.phases.get(f"{timer} pairs", 0.0) + time.perf_counter() - t
        self.clock.sample()
        s["blocks"] += 1

    def pair(self, s: dict, timer: str, n: int) -> None:
        """One ABAB pair of ``timer``'s batches of ``n`` calls on new values, every output
        checked, appended to ``s[timer]``; the candidate's CPU use is watched while the
        baseline's batch is timed."""
        mode = {"eager": "time", "kernel": "kernel", "graph": "graph"}[timer]
        p = s[timer]
        self.check_scheduling()
        self.refresh(n)
        replays = 1
        # replays for GRAPH_BATCH_MS of device time; one if the op writes its inputs (no reference for a 2nd)
        if timer == "graph" and p["block_base"] and not self.op.mutable_inputs:
            replays = int(min(MAX_REPLAYS, max(1, GRAPH_BATCH_MS / max(p["block_base"][-1] * n, 1e-6))))
        # ABBA: the side that goes first alternates pair by pair, so what the order itself
        # costs (caches the judge's writes left warm, the other side's tail) falls on both
        replies = {}
        for side in ("base", "cand") if len(p["block_base"]) % 2 == 0 else ("cand", "base"):
            self._fill_side(side, n)  # each side's copy right before its batch: nothing to work on before
            if side == "cand":
                replies[side] = self.batch(self.cand, 0, n, mode, replays)
                continue
            cpu0 = self.cand.cpu_s()
            replies[side] = self.batch(self.base, 0, n, mode, replays)
            idle, tb = self.cand.cpu_s() - cpu0, replies[side][1]
            if idle > IDLE_CPU_S + 0.1 * tb / 1e3:
                raise Verdict(
                    "unsynced_work",
                    f"the candidate's processes used {idle * 1e3:.1f} ms of CPU while the "
                    f"baseline's {tb:.1f} ms batch was timed: work left running outside its own calls",
                )
        (rb, tb), (rc, tc) = replies["base"], replies["cand"]
        for side, reply in (("base", rb), ("cand", rc)):
            if "kernel_error" in reply:  # no outputs kept, no times: the kernel timer is off for this row
                if side == "cand" and reply.get("foreign_work"):
                    raise Verdict("tampered", f"kernel timer: {reply['kernel_error']}")
                s["errors"]["kernel"] = f"{'baseline' if side == 'base' else 'candidate'}: {reply['kernel_error']}"
                return
        self._check_slots(slice(0, n), f"in the timed calls ({timer} timer)")
        for side, reply, judge_ms in (("base", rb, tb), ("cand", rc, tc)):
            times = reported_times(reply, "times_ms", n, side, positive=timer != "kernel")
            p[side] += times
            p[f"judge_{side}"].append(judge_ms)
            p[f"rep_{side}"].append(sum(times) * replays)  # all the device time the batch reported
            p[f"block_{side}"].append(sum(times) / n)  # the batch total per call: what the judge's clock vouches for
            if timer == "kernel":
                p[f"span_{side}"] += reported_times(reply, "span_ms", n, side, positive=False)
                p[f"kernels_{side}"] += [int(t) for t in reply["kernels"]][:n]
        if timer == "kernel":
            p["hidden"] += reported_times({"hidden_ms": [rc.get("hidden_ms") or 0.0]}, "hidden_ms", 1, "cand", False)

    def check_scheduling(self) -> None:
        """``tampered`` when :func:`kb_nano.kernels.procs.process_tampering` finds the
        baseline worker's scheduling or limits changed, or the candidate's priority raised,
        or a process runs beside the workers (:func:`kb_nano.kernels.procs.strays`)."""
        found = process_tampering(self.base.pid, self.cand.pid)
        if found:
            raise Verdict("tampered", found)
        with WORKERS_LOCK:  # no worker of this process is being started or reaped meanwhile
            others = strays(self.cand.pid, LIVE_WORKERS)
            for pid in others:  # no worker's: nothing else ends them
                kill_tree(pid)
        if others:
            raise Verdict(
                "tampered",
                f"process(es) {', '.join(map(str, others[:3]))} run beside the workers, outside any worker's "
                "process tree (clone with CLONE_PARENT): their CPU use would escape the judge's accounting",
            )

    def more(self, s: dict, count: int) -> None:
        """``count`` more blocks (after a failed clock cross-check: jitter passes with more
        samples, hidden work stays)."""
        for _ in range(count):
            self.block(s)

    def _refill(self, refresh: Refresher, n: int) -> None:
        refresh(n)
        self._fill_all(n)


KEEP_WORKER = {"passed", "skipped", "incorrect", "incorrect_shape", "incorrect_dtype", "nonfinite"}
