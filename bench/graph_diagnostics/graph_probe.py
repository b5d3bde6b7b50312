"""Is the graph gap the worker process or the timer? do_bench_cudagraph run *inside* a kb-nano
candidate worker, next to kb-nano's own graph time of the same computation.

    PYTHONPATH=src:tests python3 bench/graph_diagnostics/graph_probe.py

Per row (graph_ctx.py's rows): the shipped candidate's row gives kb-nano's baseline graph
time (baseline worker). Then a *probe* candidate (a subclass of the baseline, so it
computes exactly the baseline's kernels) is measured: at its first call, in its worker,
it times the baseline's computation on 16 local input sets with ``do_bench_cudagraph``
(rotating, outputs kept, rep=100) and with kb-nano's ``capture_graph`` + ``time_graph``
(K = 16, replays for 8 ms, L2 flushed), and prints both to the job log; its row gives
kb-nano's candidate graph time of the same computation. The same probe function then runs
in this (plain) process.

    PYTHONPATH=src:tests python3 bench/graph_diagnostics/graph_probe.py --judged

instead times, from inside the probe's worker, the CUDA graph that worker captured for the
judge (the same object the judged row replays), a graph the probe captures itself on the
judge's slots, and one on local clones of them, all with kb-nano's ``time_graph``.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "bench")
sys.path.insert(0, "bench/graph_diagnostics")
import fidelity as F
import torch
from graph_ctx import rows

PROBE = '''
import collections, sys
import torch
from kb_nano import operators

_Base = operators.get("{target}").baseline


def probe_times(fwd, args):
    """us per call of the baseline's computation, K = 16: do_bench_cudagraph on local
    random sets, and kb-nano's graph method (replays for 8 ms, L2 flushed) on local random
    sets, on 16 local clones of ``args`` (the judge's values), and on ``args`` themselves
    16 times (the judge's own tensors: CUDA IPC memory in a worker)."""
    import triton.testing
    from kb_nano.kernels import timing

    dev = torch.device("cuda")
    rand = [[torch.randn_like(a) if a.is_floating_point() else a.clone() for a in args] for _ in range(16)]
    clones = [[a.clone() for a in args] for _ in range(16)]
    same = [list(args)] * 16
    i, held = [0], collections.deque(maxlen=16)

    def fn():
        held.append(fwd(*rand[i[0] % 16]))
        i[0] += 1

    def kb(sets, replays=None):
        g, outs = timing.capture_graph(lambda j: fwd(*sets[j]), range(16), dev)
        flush = timing.L2Flush(dev)
        ms = timing.time_graph(g, dev, flush, 1)
        r = replays or max(1, min(200, int(8.0 / max(ms, 1e-6))))
        return sorted(timing.time_graph(g, dev, flush, r) / r / 16 for _ in range(9))[4] * 1e3

    with torch.inference_mode():
        dbcg = float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")) * 1e3
        out = {"dbcg": dbcg, "kb_rand": kb(rand), "kb_clones": kb(clones), "kb_judge_tensors": kb(same)}
        out["kb_rand_1replay"] = kb(rand, 1)
    return {k: round(v, 2) for k, v in out.items()}


class Probe(_Base):
    _done = False

    def forward(self, *args):
        if not Probe._done and not torch.cuda.is_current_stream_capturing():
            Probe._done = True
            print("PROBE", probe_times(super().forward, args), file=sys.stderr, flush=True)
        return super().forward(*args)
'''


# --judged: the probe times the graph the worker captured for the judge (found up the stack) at
# its first eager call after the capture, next to a graph it captures itself on the same
# slots and on local clones of them; all with kb-nano's time_graph.
PROBE_JUDGED = """
import sys
import torch
from kb_nano import operators

_Base = operators.get("{target}").baseline


def _side():
    f = sys._getframe()  # the worker's Side is ``self`` in a caller's frame (gc.freeze hides it from gc)
    while f is not None:
        o = f.f_locals.get("self")
        if type(o).__name__ == "Side" and getattr(o, "graph", None) is not None:
            return o
        f = f.f_back
    return None


def judged_times(fwd):
    from kb_nano.kernels import timing

    side, dev = _side(), torch.device("cuda")
    if side is None:
        return None
    k = len(side.outputs) or len(side.inputs)
    flush = timing.L2Flush(dev)

    def per_call(g, n):
        one = timing.time_graph(g, dev, flush, 1)
        r = max(1, min(200, int(8.0 / max(one, 1e-6))))
        return round(sorted(timing.time_graph(g, dev, flush, r) / r / n for _ in range(9))[4] * 1e3, 2), r

    out = {"k": k, "judged_graph": per_call(side.graph[0], k)}
    g, _ = timing.capture_graph(lambda j: fwd(*side.inputs[j]), range(k), dev)
    out["own_graph_judge_slots"] = per_call(g, k)
    clones = [[a.clone() for a in side.inputs[j]] for j in range(k)]
    g2, _ = timing.capture_graph(lambda j: fwd(*clones[j]), range(k), dev)
    out["own_graph_clones"] = per_call(g2, k)
    g3, _ = timing.capture_graph(side.call, range(k), dev)
    out["own_graph_worker_call"] = per_call(g3, k)
    out["judged_graph_again"] = per_call(side.graph[0], k)
    return out


class Probe(_Base):
    _done = False

    def forward(self, *args):
        if not Probe._done and not torch.cuda.is_current_stream_capturing() and _side() is not None:
            Probe._done = True
            try:
                with torch.inference_mode():
                    said = judged_times(super().forward)
            except Exception as exc:
                said = repr(exc)
            print("PROBE", said, file=sys.stderr, flush=True)
        return super().forward(*args)
"""


def main() -> None:
    from kb_nano.candidates import load_class
    from kb_nano.kernels.measure import measure
    from kb_nano.kernels.pool import Pool

    dev = torch.device("cuda")
    root = Path(tempfile.mkdtemp())
    (root / "results").mkdir()
    cdir = root / "probes"
    cdir.mkdir()
    pool = Pool("cuda", {"OMP_WAIT_POLICY": "PASSIVE"}, root)
    out = []
    try:
        for s, c in rows():
            path = cdir / s["target"] / "probe.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text((PROBE_JUDGED if JUDGED else PROBE).replace("{target}", s["target"]))
            shipped = measure(s, c, F.REPO / "candidates" / f"{c}.py", F.settings(), root, pool, sys.stderr.fileno())
            log = root / f"{s['scenario_id']}.log"
            with open(log, "wb") as f:
                probe = measure(s, f"{s['target']}/probe", path, F.settings(), root, pool, f.fileno())
            said = [ln for ln in log.read_text().splitlines() if ln.startswith("PROBE")]
            if JUDGED:
                out.append(f"{s['scenario_id']} | {shipped.get('baseline_graph_ms', 0) * 1e3:.2f} | {said[:1]}")
                print(out[-1], flush=True)
                continue
            cls = load_class(path, s["target"])
            mod = F.modules(s, c, dev)["baseline"]
            inner = cls(**s["init_args"]).to(device=dev, dtype=next(mod.parameters(), torch.zeros(1)).dtype)
            inner.load_state_dict(mod.state_dict())
            args = F.input_sets(s, dev, 1)[0]
            plain = sys.modules[cls.__module__].probe_times(super(cls, inner).forward, args)
            out.append(
                f"{s['scenario_id']} | {shipped.get('baseline_graph_ms', 0) * 1e3:.2f} (K {shipped.get('graph_calls')})"
                f" | {probe['status']}: {(probe.get('candidate_graph_ms') or 0) * 1e3:.2f}"
                f" | {said[0][6:] if said else 'no probe line'} | {plain}"
            )
            print(out[-1], flush=True)
    finally:
        pool.close()
    print(
        "\nrow | kb-nano baseline graph us (K) | probe row: status, candidate graph us | in the probe's worker | plain"
    )
    print("\n".join(out))


JUDGED = "--judged" in sys.argv

if __name__ == "__main__":
    main()
