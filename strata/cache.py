"""strata's on-disk cache: generated fixtures, the Engram token map, compiled kernels — files
that only save time, so a cache that cannot be written costs the saving, never a failure."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$STRATA_CACHE, else $XDG_CACHE_HOME/strata (else ~/.cache/strata)."""
    env = os.environ.get("STRATA_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "strata"


def write_cache_file(path: Path, data: bytes) -> None:
    """Write `path` through a temporary file renamed over it, so a concurrent reader sees all
    of it or none; an OSError (an unwritable or full cache) is swallowed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass
