"""Progress bars for long work (planning, verification, replays): tqdm on a terminal, silent elsewhere.

    bar = progress(len(candidates), "effpass plan")
    for c in candidates:
        bar.set_postfix_str(c.name); ...; bar.update()
    bar.close()

``EFFPASS_PROGRESS=0`` silences it, ``=1`` forces it (e.g. under a pager; read by
:func:`effpass.config.progress_from_env`); by default it shows only when standard error is a terminal, so logs, CI
and notebooks' captured output stay clean.
"""
from __future__ import annotations

import sys

__all__ = ["progress"]


class _Quiet:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...
    def close(self) -> None: ...
    def __enter__(self): return self
    def __exit__(self, *exc): self.close()


def progress(total: int, desc: str, enabled: bool | None = None):
    """A progress bar of ``total`` steps (``update()`` each), or a silent stand-in."""
    if enabled is None:
        from .config import progress_from_env

        enabled = progress_from_env()
        if enabled is None:
            enabled = sys.stderr.isatty()
    if not enabled:
        return _Quiet()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return _Quiet()
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True)
