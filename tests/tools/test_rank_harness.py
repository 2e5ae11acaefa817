"""The distributed tests' rank harness (tests/_ranks.py): a single-threaded fork server, and a rank that dies of a
crash in native code started again once, loudly, while a rank that fails on purpose never is."""
import os

import pytest
from torch.multiprocessing.spawn import ProcessExitedException

from _ranks import spawn_ranks


def _rank(rank: int, out: str, fail: str) -> None:
    """Rank 0 fails on its first attempt (``abort``: SIGABRT as a native crash does; ``exit``: status 3); every
    rank records its attempt and how many threads its parent, the fork server, has."""
    attempts = len([f for f in os.listdir(out) if f.startswith(f"attempt{rank}.")])
    with open(os.path.join(out, f"attempt{rank}.{attempts}"), "w") as f:
        f.write(str(len(os.listdir(f"/proc/{os.getppid()}/task"))))
    if rank == 0 and attempts == 0:
        if fail == "abort":
            os.abort()
        os._exit(3)


@pytest.mark.xdist_group("wrap_fsdp_2ranks")   # the worker whose fork server the 2-rank tests started
def test_a_native_crash_is_retried_once_with_a_warning_and_a_failing_rank_never(tmp_path):
    crash, exit_ = tmp_path / "abort", tmp_path / "exit"
    crash.mkdir(), exit_.mkdir()
    with pytest.warns(RuntimeWarning, match=r"rank 0 of _rank died of SIGABRT .* starting the ranks again \(1 of 1\)"):
        spawn_ranks(_rank, (str(crash), "abort"), 2, crash_retries=1)
    assert (crash / "attempt0.1").exists()                      # rank 0 ran again and this time finished
    threads = {p.read_text() for p in crash.iterdir()}
    assert threads == {"1"}, f"the fork server has {threads} threads, not one"

    with pytest.raises(ProcessExitedException, match="exit code 3|exited with exit code 3"):
        spawn_ranks(_rank, (str(exit_), "exit"), 2, crash_retries=1)
    assert not (exit_ / "attempt0.1").exists()                  # a deliberate exit is not a crash: no second start
