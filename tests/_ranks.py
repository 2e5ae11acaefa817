"""Rank processes for the distributed tests, started from a preloaded fork server.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter that imports torch, transformers and
effpass again (~7 CPU-s per rank on this 2-core machine, ~85 CPU-s per suite run over the 2- and 4-rank
spawns). Here the ranks fork from a fork server that imported them once per test process (Python's
``forkserver`` start method: the server is single-threaded (tests/tools/test_rank_harness.py checks it), so
forking it is safe, unlike forking a pytest worker that has run OpenMP). A rank still starts clean: its own
interpreter state, no Dynamo caches, no process group. The caller's environment at the time of the call is applied
in the rank (the fork server's own environment is the one it started with).
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import warnings

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException

#: what every rank imports anyway (the fork server imports it once)
PRELOAD = ["torch", "torch.distributed.fsdp", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "effpass", "effpass.passes"]
_PRELOADED = [False]
#: signals a rank dies of when native code crashes (SIGTERM/SIGKILL are the spawner stopping the others)
_CRASH_SIGNALS = {"SIGABRT", "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE"}


def _entry(rank: int, env: dict, fn, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    faulthandler.enable()   # a crash in native code prints every thread's Python stack to the captured stderr
    import _gc

    _gc.tune()              # as in the test workers (tests/_gc.py)
    fn(rank, *args)


def spawn_ranks(fn, args, world: int, *, crash_retries: int = 0) -> None:
    """``fn(rank, *args)`` on ``world`` ranks; raises (as ``mp.spawn`` does) when a rank fails.

    ``args`` is a tuple, or a function returning one per attempt (a fresh port). ``crash_retries``: how many times
    to start the ranks again after one died of a signal it did not ask for (SIGABRT, SIGSEGV, SIGBUS: a crash in
    native code, which a Python exception never is); each retry warns with the signal, and ``fn`` must resume
    (skip what an earlier attempt finished). A rank that raised or exited with a status is never retried."""
    if not _PRELOADED[0]:
        multiprocessing.set_forkserver_preload(PRELOAD)
        _PRELOADED[0] = True
    for attempt in range(crash_retries + 1):
        try:
            mp.start_processes(_entry, args=(dict(os.environ), fn, *(args() if callable(args) else args)),
                               nprocs=world, join=True, start_method="forkserver")
            return
        except ProcessExitedException as e:
            if attempt == crash_retries or e.signal_name not in _CRASH_SIGNALS:
                raise
            warnings.warn(f"effpass tests: rank {e.error_index} of {fn.__name__} died of {e.signal_name} (a crash in "
                          f"native code; its stack is in the captured stderr); starting the ranks again "
                          f"({attempt + 1} of {crash_retries})", RuntimeWarning, stacklevel=2)
