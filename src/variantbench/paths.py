"""Where variantbench keeps what it builds once and reuses (converted models, downloads)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$VARIANTBENCH_CACHE``, else ``$XDG_CACHE_HOME/variantbench``, else ``~/.cache/variantbench``."""
    explicit = os.environ.get("VARIANTBENCH_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "variantbench"


def bytes_under(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (0 when missing)."""
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
