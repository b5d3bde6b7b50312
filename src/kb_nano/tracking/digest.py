"""What keys a run: the digest of its merged rows, manifest and candidate sources."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path


def canonical_rows(rows: list[dict]) -> list[dict]:
    """Rows with NaN/inf floats as None, sorted by their canonical JSON (order-free)."""
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    return sorted(clean, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def result_digest(tier: str, rows: list[dict], manifest_sha256: str | None, candidate_hashes: dict[str, str]) -> str:
    """SHA-256 (hex) keying one run: tier + every field of every merged row (including
    ``created_at``/``wall_s``, which stay fixed unless a shard is re-measured) + the
    manifest's SHA-256 + ``{candidate id: source SHA-256}``. Row order does not matter."""
    payload = {
        "tier": tier,
        "rows": canonical_rows(rows),
        "manifest_sha256": manifest_sha256,
        "candidates": dict(sorted(candidate_hashes.items())),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 hex of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def candidate_hashes(rows: list[dict], root: Path) -> dict[str, str]:
    """``{candidate id: SHA-256 of candidates/{id}.py}`` for every candidate in ``rows``;
    falls back to the rows' ``candidate_sha256`` when the file is gone (None if neither)."""
    out: dict[str, str] = {}
    for cid in sorted({r["candidate"] for r in rows if r.get("candidate")}):
        path = Path(root) / "candidates" / f"{cid}.py"
        if path.is_file():
            out[cid] = file_sha256(path)
        else:
            shas = sorted({r["candidate_sha256"] for r in rows if r["candidate"] == cid and r.get("candidate_sha256")})
            out[cid] = ",".join(shas) or None
    return out


def e2e_candidate_hashes(rows: list[dict]) -> dict[str, str]:
    """``{candidate id: SHA-256}`` from the rows' ``candidate_sha256`` JSON (the hash the
    job measured)."""
    out: dict[str, str] = {}
    for r in rows:
        out.update(json.loads(r.get("candidate_sha256") or "{}"))
    return dict(sorted(out.items()))
