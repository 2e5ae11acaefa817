"""A fork pool for a replay's independent parts (the depths of an extrapolation): :func:`in_workers` runs jobs
over this process and children forked from it; :func:`plan_workers` says how many processes
(``EFFPASS_PLAN_WORKERS``, read by :func:`effpass.config.plan_workers_setting`)."""
from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["in_workers", "plan_workers"]


def plan_workers() -> int:
    """Processes for a replay's independent parts: ``EFFPASS_PLAN_WORKERS`` if set, else min(2, the cores this
    process may use); 1 where ``os.fork`` is not available (not Linux)."""
    import os

    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return 1
    from effpass.config import plan_workers_setting

    setting = plan_workers_setting()
    if setting is not None:
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except Exception:  # pragma: no cover
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def _picklable(r):
    """``r`` (a result or a list of results) with every element that cannot be pickled, an exception with
    its own constructor, replaced by a RuntimeError that says what it was."""
    import pickle

    if isinstance(r, list):
        return [_picklable(x) for x in r]
    try:
        pickle.loads(pickle.dumps(r))
        return r
    except Exception:
        return RuntimeError(f"{type(r).__name__}: {r}")


#: seconds a forked replay worker may take beyond twice this process's own share before it is given up
CHILD_GRACE_S = 120.0


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything written to pipe ``fd`` until its writer closes it, or None if that has not happened by
    ``deadline`` (``time.monotonic()``)."""
    import os
    import select

    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def in_workers(fn, jobs: list, costs: list, workers: int) -> list:
    """``[fn(j) for j in jobs]``, the jobs spread over ``workers`` processes: this one and ``workers - 1``
    children forked from it (each job's result, or the exception it raised, pickled back). Jobs go to the
    least loaded process by ``costs`` (longest first). A child that dies or sends nothing readable leaves its
    jobs to this process, so the result is the same as run here. Fake-tensor replays only: a child runs no
    kernel and touches nothing the parent keeps."""
    import os
    import pickle

    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        return [fn(j) for j in jobs]
    loads = [0.0] * workers
    mine: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(jobs)), key=lambda i: -costs[i]):
        w = min(range(workers), key=lambda w: loads[w])
        mine[w].append(i)
        loads[w] += costs[i]
    children = []
    for w in range(1, workers):
        r, wfd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: its jobs, pickled to the pipe, then exit without the parent's exit handlers
            code = 0
            try:
                os.close(r)
                res = {}
                for i in mine[w]:
                    try:
                        res[i] = fn(jobs[i])
                    except Exception as e:
                        res[i] = e
                data = pickle.dumps({i: _picklable(v) for i, v in res.items()})
                with os.fdopen(wfd, "wb") as f:
                    f.write(data)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(wfd)
        children.append((pid, r, w))
    out: dict[int, Any] = {}
    t0 = time.monotonic()
    for i in mine[0]:
        out[i] = fn(jobs[i])
    # NOTE(hang): a child forked from a process with other threads (a test runner's, a compile pool's) could
    # block on a lock one of them held at the fork; one that has not answered by the deadline is killed and
    # its jobs are run here, so the result stays the same and the planner never waits forever.
    deadline = time.monotonic() + max(CHILD_GRACE_S, 2.0 * (time.monotonic() - t0))
    for pid, r, w in children:
        data = _read_until(r, deadline)
        if data is None:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            data = b""
        os.close(r)
        os.waitpid(pid, 0)
        try:
            got = pickle.loads(data) if data else {}
        except Exception:
            got = {}
        for i in mine[w]:
            out[i] = got[i] if i in got else fn(jobs[i])
    return [out[i] for i in range(len(jobs))]
