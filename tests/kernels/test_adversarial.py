"""The adversarial corpus (tests/kernels/adversarial/, see its README): every hack gets its status,
every control passes, in one real Snakemake sweep that also holds a segfaulting, a
hanging and an out-of-memory candidate.

On a GPU host run the whole corpus on CUDA (the CUDA-only hacks included):
``PYTHONPATH=src:tests python tests/kernels/test_adversarial.py --device cuda``.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest
from workflow_helpers import copy_workflow, kb_nano

CORPUS = Path(__file__).resolve().parent / "adversarial"
# Repository candidates run in the same sweep as controls: they must pass (or be skipped
# on a device they do not support) whatever the hacks beside them do.
REPO_CONTROLS = ("rms_norm/torch_fused", "rms_norm/triton_rowwise", "fused_add_rms_norm/fp32_sum")


def corpus() -> dict[str, dict]:
    """``{candidate id: {"EXPECTED": status, "EXPECTED_CUDA": status|None, "EXPECTED_ERROR": str|tuple|None, "EXPECTED_LIKE": id|None,
    "FORGED_SPEEDUP": float|None, "MAY_STARVE": bool, "only": "cuda"|"cpu"|None}}`` read from the corpus files'
    module constants (without importing them); ``only`` is the one device type a file
    declares in ``supported_devices``, where it has one."""
    out = {}
    for path in sorted(CORPUS.glob("*/*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text())
        names = ("EXPECTED", "EXPECTED_CUDA", "EXPECTED_ERROR", "EXPECTED_LIKE", "FORGED_SPEEDUP", "MAY_STARVE")
        consts = {
            t.id: ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name) and t.id in names
        }
        text = path.read_text()
        only = (
            "cuda"
            if 'supported_devices = ("cuda",)' in text
            else "cpu"
            if 'supported_devices = ("cpu",)' in text
            else None
        )
        out[f"{path.parent.name}/{path.stem}"] = {
            "EXPECTED_CUDA": None,
            "EXPECTED_ERROR": None,
            "EXPECTED_LIKE": None,
            "FORGED_SPEEDUP": None,
            "MAY_STARVE": False,
            **consts,
            "only": only,
        }
    return out


def run_corpus(
    work: Path,
    device: str,
    timeout_s: float = 60,
    snakemake_args: tuple[str, ...] = (),
    extra_args: tuple[str, ...] = (),
) -> dict[str, dict]:
    """Copy the corpus into ``work``'s candidates, run one sweep (Llama-3.2-1B, TP 1,
    64 tokens) and return ``{candidate id: row}``. ``snakemake_args`` go to Snakemake
    (after ``--``)."""
    for path in CORPUS.glob("*/*.py"):
        dest = work / "candidates" / path.parent.name / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    ids = [*corpus(), *REPO_CONTROLS]
    args = [
        "kernels",
        "--model",
        "llama32-1b",
        "--tp",
        "1",
        "--num-tokens",
        "64",
        "--target",
        "rms_norm",
        "fused_add_rms_norm",
        "--candidate",
        *ids,
        "--device",
        device,
        "--timeout-s",
        str(timeout_s),
        "--num-warmup",
        "2",
        "--num-runs",
        "20",
        "--output-json",
        "results/adversarial.json",
    ]
    if device == "cpu":
        args += ["--memory-limit-gb", "4"]
    args += list(extra_args)
    if snakemake_args:
        args += ["--", *snakemake_args]
    proc = kb_nano(work, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((work / "results/adversarial.json").read_text())["rows"]
    return {r["candidate"]: r for r in rows}


def _alternatives(expected: str | tuple[str, ...]) -> tuple[str, ...]:
    """``EXPECTED_ERROR`` as a tuple: one substring, or several of which one must appear."""
    return (expected,) if isinstance(expected, str) else tuple(expected)


def mismatches(rows: dict[str, dict], device: str) -> list[str]:
    """Every corpus entry and control whose row is not what it must be on ``device``."""
    bad = []
    for cid, want in corpus().items():
        row = rows.get(cid)
        expected = (want["EXPECTED_CUDA"] or want["EXPECTED"]) if device.startswith("cuda") else want["EXPECTED"]
        status = expected if want["only"] in (None, device) else "skipped"
        if row is not None and row["status"] == "passed" != status and want["MAY_STARVE"]:
            status = "passed"  # a loaded host gave its burners too little CPU to matter: the speedup rule below decides
        if row is None:
            bad.append(f"{cid}: no row")
        elif row["status"] != status:
            bad.append(f"{cid}: {row['status']} ({row['error']}), expected {status}")
        elif (
            status == want["EXPECTED"] == expected
            and want["EXPECTED_ERROR"]
            and not any(e in (row["error"] or "") for e in _alternatives(want["EXPECTED_ERROR"]))
        ):
            bad.append(f"{cid}: error {row['error']!r} lacks {want['EXPECTED_ERROR']!r}")
        elif (
            status == "passed"
            and want["EXPECTED_LIKE"]
            and rows.get(want["EXPECTED_LIKE"], {}).get("speedup") is not None
        ):
            # a cheat that cannot reach the baseline any more gains nothing over the same computation done honestly
            like = rows[want["EXPECTED_LIKE"]]
            if row["speedup_ci_low"] > 1.5 * like["speedup_ci_high"]:
                bad.append(
                    f"{cid}: speedup {row['speedup']:.2f} (95% rerun interval from {row['speedup_ci_low']:.2f}) is unearned: "
                    f"{want['EXPECTED_LIKE']}, the same computation, has {like['speedup']:.2f}"
                )
    forged = {w["FORGED_SPEEDUP"] for w in corpus().values() if w["FORGED_SPEEDUP"]}
    bad += [f"{cid}: a forged row (speedup {r['speedup']})" for cid, r in rows.items() if r.get("speedup") in forged]
    for cid in REPO_CONTROLS:
        row = rows.get(cid)
        if row is None or row["status"] not in ("passed", "skipped"):
            bad.append(f"control {cid}: {row and row['status']} ({row and row['error']})")
    return bad


@pytest.mark.slow
def test_every_hack_is_caught_and_every_control_passes(tmp_path):
    rows = run_corpus(copy_workflow(tmp_path), "cpu")
    assert not mismatches(rows, "cpu"), "\n".join(mismatches(rows, "cpu"))
    # the controls that ran beside the segfault, the hang and the allocation storm are real measurements
    for cid in ("rms_norm/honest_fused", "rms_norm/torch_fused", "fused_add_rms_norm/honest_inplace"):
        assert rows[cid]["status"] == "passed" and rows[cid]["candidate_ms"] > 0 and rows[cid]["speedup_ci_low"] > 0


def test_expected_cuda_applies_on_cuda_only():
    """A file's ``EXPECTED_CUDA`` is its status on CUDA; on a CPU its ``EXPECTED`` stands."""
    want = corpus()["rms_norm/forge_clock"]
    assert want["EXPECTED"] == "unsynced_work" and want["EXPECTED_CUDA"] == "passed"
    row = {"status": "passed", "error": None, "speedup": 1.0}
    assert not [m for m in mismatches({"rms_norm/forge_clock": row}, "cuda") if m.startswith("rms_norm/forge_clock")]
    assert [m for m in mismatches({"rms_norm/forge_clock": row}, "cpu") if m.startswith("rms_norm/forge_clock")]


def test_corpus_covers_every_anti_cheat_status():
    from kb_nano.kernels.schema import STATUSES

    expected = {c["EXPECTED"] for c in corpus().values()}
    anti_cheat = set(STATUSES[STATUSES.index("tampered") :])
    assert anti_cheat <= expected, anti_cheat - expected
    assert {"incorrect", "crashed", "timeout", "runtime_error", "passed"} <= expected


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--no-mlflow", action="store_true", help="stop after merge_kernels (no MLflow run)")
    parser.add_argument(
        "--gpu-pool",
        type=int,
        help="GPUs to use (1: every job on one device, one after another, "
        "so jobs after an illegal address or an out-of-memory candidate reuse its GPU)",
    )
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = run_corpus(
            copy_workflow(Path(tmp)),
            a.device,
            a.timeout_s,
            ("--until", "merge_kernels") if a.no_mlflow else (),
            ("--gpu-pool", str(a.gpu_pool)) if a.gpu_pool else (),
        )
    if a.json:
        Path(a.json).write_text(json.dumps(got, indent=1, default=str))
    for cid, r in sorted(got.items()):
        want = corpus().get(cid, {}).get("EXPECTED", "passed/skipped (control)")
        print(f"{cid:45s} {r['status']:15s} expected {want:15s} {(r['error'] or '')[:110]}")
    bad = mismatches(got, a.device)
    print("\n".join(bad) or f"all {len(got)} rows as expected on {a.device}")
    sys.exit(1 if bad else 0)
