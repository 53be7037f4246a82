"""Small file helpers shared by the server's state (audit signing keys, key registry, key material)."""

from __future__ import annotations

import os
from pathlib import Path


def write_private(path: Path, data: bytes, *more: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (followed by ``more``: pieces written in turn, never joined
    in memory: a stored key set is hundreds of MB): mode 0600 from creation (never readable by others, even
    briefly), fully written and fsynced before the rename."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        for piece in (data, *more):
            fh.write(piece)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
