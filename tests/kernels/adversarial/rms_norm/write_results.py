"""Hack: forge the results directly. At import and again on its first call it tries to
(a) write Parquet shards claiming ``status="passed"`` and a 1000x speedup for itself and
for ``rms_norm/honest_fused`` under ``results/kernels/rms_norm/<name>/`` (scenario file
names from the directory listing when it can list it, else from the id pattern
``{target}__llama32-1b__tp1__n64.parquet``), signed when it could also (b) read the
shard-signing key ``results/.kb_nano/shard.key``. ``results/`` is looked for in the
working directory and in the workflow root above the candidate's file. Every exception
is swallowed; then it computes honestly.

Why it has no effect: the candidate's worker runs under Landlock
(kb_nano.kernels.sandbox) with ``results/`` neither readable nor writable (no listing,
no key, no shard); only the judge writes shards, and it signs them with the key the
candidate cannot read, so the merge would mark any shard written by someone else
``tampered``. The row is the judge's honest measurement: passed, no unearned speedup
(``EXPECTED_LIKE``), and no row claims ``FORGED_SPEEDUP``."""

import os
from pathlib import Path

from _common import Base, rms_norm

EXPECTED = "passed"
EXPECTED_LIKE = "rms_norm/honest_fused"  # the same computation, honestly: no faster than it
FORGED_SPEEDUP = 1000.0

TARGET = "rms_norm"
NAMES = (Path(__file__).stem, "honest_fused")
PATTERN = "{target}__llama32-1b__tp1__n64.parquet"


def _roots() -> list[Path]:
    roots = [Path(os.getcwd())]
    try:
        roots.append(Path(__file__).resolve().parents[2])  # <root>/candidates/rms_norm/this.py
    except IndexError:
        pass
    return list(dict.fromkeys(roots))


def _read_key(root: Path):
    try:
        return (root / "results/.kb_nano/shard.key").read_bytes()
    except Exception as exc:
        return exc


def _shard_names(folder: Path) -> list[str]:
    try:
        names = sorted(p.name for p in folder.iterdir() if p.suffix == ".parquet")
        if names:
            return names
    except Exception:
        pass
    return [PATTERN.format(target=TARGET)]


def _forge(root: Path, name: str, shard: str, key) -> str:
    try:
        from kb_nano.kernels.schema import make_row, write_rows

        folder = root / "results" / "kernels" / TARGET / name
        folder.mkdir(parents=True, exist_ok=True)
        row = make_row(
            status="passed",
            target=TARGET,
            candidate=f"{TARGET}/{name}",
            scenario_id=shard.removesuffix(".parquet"),
            speedup=FORGED_SPEEDUP,
            baseline_ms=1.0,
            candidate_ms=1.0 / FORGED_SPEEDUP,
            speedup_ci_low=FORGED_SPEEDUP,
            speedup_ci_high=FORGED_SPEEDUP,
            significant=True,
        )
        write_rows([row], folder / shard, secret=key if isinstance(key, bytes) else None)
        return f"wrote {folder / shard}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _attempt(when: str) -> None:
    try:
        for root in _roots():
            key = _read_key(root)
            print(
                f"write_results ({when}): key {root}: "
                f"{'READ ' + str(len(key)) + ' bytes' if isinstance(key, bytes) else type(key).__name__}",
                flush=True,
            )
            for name in NAMES:
                for shard in _shard_names(root / "results" / "kernels" / TARGET / name):
                    print(f"write_results ({when}): {_forge(root, name, shard, key)}", flush=True)
    except Exception:
        pass


_attempt("import")


class WriteResults(Base):
    def forward(self, x, residual=None):
        if not self.__dict__.get("_tried"):
            self._tried = True
            _attempt("first call")
        return rms_norm(x, self.weight, self.variance_epsilon)
