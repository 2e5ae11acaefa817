"""The sample the suite runs of each sweep (tests/conftest.py) and of the few fixtures that sweep inside one test
(the GPU proof kit's dry-run sections).

Sweeps: a test marked ``sweep`` checks one promise on many inputs of the same kind (model families, the same
check per model or per option). By default (CI, ``bash scripts/dev.sh test``) each sweep runs a sample of its
cases: its first case always (the anchor) and a third of the others (rounded: a 2-case sweep runs its first),
chosen by a hash of the case's id with the commit (``git rev-parse HEAD``): a rerun of one commit runs the same
cases, successive commits cover the rest. ``EFFPASS_TEST_SWEEP=full`` runs every case; ``EFFPASS_TEST_SWEEP=<text>``
samples with that seed instead. A case whose first parameter is in ``FULL_ONLY`` (a model that costs more than the
rest of the sample together, with the reason) is never drawn: only the full run has it.
"""
from __future__ import annotations

import hashlib
import os
import subprocess

SWEEP_FRACTION = 1 / 3

#: cases (by their first parameter) that the sample never draws, only ``EFFPASS_TEST_SWEEP=full`` runs, with why:
#: one such case costs more than a whole sample of the others (measured in fresh-clone runs: any case over 30 CPU-s)
_DELTA_RULE = ("its chunked delta rule (linear attention) is a Python loop of 63 rows per layer that Dynamo unrolls "
               "(~98k graph nodes): {} CPU-s measured for one case on 2 cores, where a family case costs 1-20")
FULL_ONLY = {
    "kimi_linear": _DELTA_RULE.format("~75"),
    "bailing_hybrid": _DELTA_RULE.format("~73"),
    "qwen4_exp": _DELTA_RULE.format("~34"),
    "qwen4_exp_text": _DELTA_RULE.format("~27-40"),
}


def _sweep_seed() -> str | None:
    choice = os.environ.get("EFFPASS_TEST_SWEEP", "").strip()
    if choice.lower() in ("full", "all", "0"):
        return None
    if choice:
        return choice
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        return head.stdout.strip()[:12] or "no-commit"
    except (OSError, subprocess.SubprocessError):
        return "no-git"


#: None: every case runs
SWEEP_SEED = _sweep_seed()


def sample(cases: list, key=str, fraction: float = SWEEP_FRACTION) -> list:
    """The cases of one sweep that run: the first, and ``fraction`` of the others (a third unless the sweep's
    marker says otherwise: ``@pytest.mark.sweep(fraction=0.05)``) chosen by ``key(case)`` hashed with the seed
    (all of them when ``EFFPASS_TEST_SWEEP=full``; ``FULL_ONLY`` cases only then); in their original order."""
    if SWEEP_SEED is None or len(cases) <= 1:
        return list(cases)
    drawable = [c for c in cases[1:] if not _full_only(key(c))]
    rest = sorted(drawable, key=lambda c: hashlib.sha256(f"{SWEEP_SEED}:{key(c)}".encode()).hexdigest())
    keep = {id(c) for c in rest[:round(len(rest) * fraction)]}
    return [cases[0]] + [c for c in cases[1:] if id(c) in keep]


def _full_only(case_key: str) -> bool:
    """Whether the case's first parameter (``test[<first>-...]`` or ``test[<first>]``) is in ``FULL_ONLY``."""
    params = case_key[case_key.find("[") + 1:].rstrip("]") if "[" in case_key else ""
    return params.split("-")[0] in FULL_ONLY
