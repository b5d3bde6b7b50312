"""Rows no candidate can forge: every kernel shard carries an HMAC-SHA256 of its rows.

Two mechanisms, on purpose:

- Prevention: a candidate's worker runs under Landlock (:mod:`kb_nano.kernels.sandbox`)
  with ``results/`` neither writable nor readable, so it cannot write a shard, touch
  another candidate's, or read the key below. The row's ``sandbox`` column says whether
  the kernel enforced it (``none: ...`` on a kernel without Landlock).
- Detection: the judge signs each shard it writes with a key that lives in
  ``results/.kb_nano/shard.key`` (mode 0600, made on first use, never in an
  environment variable, which other processes of the user can read); the merge
  recomputes the signature and marks the rows of a shard that changed after the judge
  wrote it, or that the judge never signed, ``tampered``. This also catches a shard
  edited by hand or by any other program.

The signature is stored in the Parquet file's key-value metadata (``kb_nano.hmac``), over
the rows' canonical JSON (sorted keys), so it survives a rewrite only if the rows did.
Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

KEY_FILE = Path("results/.kb_nano/shard.key")
METADATA_KEY = b"kb_nano.hmac"


def key(root: Path) -> bytes:
    """The HMAC key of the results under ``root`` (created, 32 random bytes, mode 0600,
    when missing). Raises ``OSError`` when it can be neither read nor created."""
    path = Path(root) / KEY_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    # written whole to a private file, then linked into place: whoever links first wins,
    # and nobody ever reads a half-written key
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes()


def signature(rows: list[dict], secret: bytes) -> str:
    """Hex HMAC-SHA256 of ``rows`` (canonical JSON: sorted keys, ``str`` for other types)."""
    payload = json.dumps(rows, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def verify(rows: list[dict], found: str | None, secret: bytes) -> bool:
    """Whether ``found`` (the shard's stored signature) matches ``rows``."""
    return found is not None and hmac.compare_digest(found, signature(rows, secret))
