import os
import sys

# Tests live in folders by area (tests/passes/<name>/, tests/core/, ...); the shared helpers (_helpers, _families,
# _vocab_losses, _paths) stay at tests/ and import by name from any depth.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# A stable Inductor cache directory keeps warm compiles warm between test runs (set before torch loads).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "inductor"))

import pytest  # noqa: E402
import torch  # noqa: E402

# NOTE(structured trace): pytest attaches its log capture to every logger that does not propagate, torch's structured
# trace log ("torch.__trace") among them; torch then builds every trace payload of every compile (graph dumps, timed
# events) for that capture, and the planner's replays keep building their graph strings (planning/patches.py): ~13% of
# a compile-heavy file (tests/passes/tile_sequence: 51.6 -> 45.0 s). Propagating, the trace log gets no handler from
# pytest, and torch's own lazy handler removes itself on first use where TORCH_TRACE is unset, as outside pytest.
if not os.environ.get("TORCH_TRACE"):
    from torch._logging._internal import trace_log  # noqa: E402

    trace_log.propagate = True

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)

import _gc  # noqa: E402

_gc.tune()  # fewer, cheaper garbage collections during compiles (tests/_gc.py: -8% CPU on a compile-heavy file)


# The longest tests (multi-process launches, mostly; see a CI run's --durations) start first, so that the two
# workers do not end on one of them while the other idles (xdist hands out work in collection order).
LONG_FIRST = (
    "test_shard_sequence.py::test_shard_sequence_two_ranks_equal_one_process",
    "test_wrap_fsdp.py::test_wrap_fsdp_killed_rank_relaunch_reaches_uninterrupted_weights",
    "test_accelerate_fsdp2.py::",
    "test_backend.py::test_second_process_hits_the_caches_with_identical_results_and_stats",
)


from _sweep import SWEEP_FRACTION, SWEEP_SEED, sample  # noqa: E402  (the sweep sample: tests/_sweep.py)


@pytest.fixture(scope="session")
def fork_server():
    """A process with torch, transformers, TRL and effpass imported that runs each script (a README block, an
    example) in a fresh forked child (tests/_fork_server.py). Its users are marked ``xdist_group("readme")``: one
    worker starts one server for all of them."""
    import _fork_server

    proc = _fork_server.start()
    yield proc
    _fork_server.stop(proc)


def pytest_report_header(config):
    if SWEEP_SEED is None:
        return "effpass sweeps: every case (EFFPASS_TEST_SWEEP=full)"
    return (f"effpass sweeps: the first case and {SWEEP_FRACTION:.0%} of the others, seed {SWEEP_SEED} "
            "(EFFPASS_TEST_SWEEP=full runs every case; tests/conftest.py)")


def _case_id(item) -> str:
    """The item's node id without the "@group" suffix pytest-xdist's loadgroup adds (the sample must not depend
    on whether the run is distributed, nor on the order of the two collection hooks)."""
    n = item.nodeid
    return n[:n.rfind("@")] if n.rfind("@") > n.rfind("]") else n


def _sample_sweeps(config, items):
    groups: dict[tuple, list] = {}
    for item in items:
        if item.get_closest_marker("sweep") is not None and hasattr(item, "callspec"):
            groups.setdefault((item.path, item.originalname), []).append(item)
    dropped = set()
    for cases in groups.values():
        fraction = cases[0].get_closest_marker("sweep").kwargs.get("fraction", SWEEP_FRACTION)
        kept = set(map(id, sample(cases, key=_case_id, fraction=fraction)))
        dropped.update(it for it in cases if id(it) not in kept)
    if dropped:
        config.hook.pytest_deselected(items=[it for it in items if it in dropped])
        items[:] = [it for it in items if it not in dropped]


def _group_module_fixture_users(items) -> None:
    """Tests that use a module-scoped fixture of their own module share one worker (``xdist_group`` named after
    the module), so that the fixture (a compile, a replay table, a dump) is built once, not once per worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None or not hasattr(item, "_fixtureinfo"):
            continue
        here = item.nodeid.split("::")[0]
        if any(d.scope == "module" and str(d.baseid).split("::")[0] == here
               for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(f"module:{here}"))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    _group_module_fixture_users(items)

    def rank(item):
        return next((i for i, key in enumerate(LONG_FIRST) if key in item.nodeid), len(LONG_FIRST))

    if SWEEP_SEED is not None and not config.getoption("keyword") and not any(
            "::" in a for a in config.args):  # a test named on the command line (-k, a node id) always runs
        _sample_sweeps(config, items)
    items.sort(key=rank)  # stable: the rest keeps its order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Tests that lower with Inductor pay seconds of C++ compiles per graph (cold, as in CI): each must carry the
# `inductor` mark, so that the cost is visible and `-m "not inductor"` is a quick loop. Calls of Inductor's
# compile_fx made in this process are counted (cache hits included; the subprocesses a test starts are not
# seen); unmarked tests are listed at the end of the run.
_INDUCTOR_GRAPHS = [0]
_UNMARKED_INDUCTOR: list[str] = []


def _count_inductor_graphs() -> None:
    import torch._inductor.compile_fx as cfx  # ~0.1 CPU-s once effpass.passes is loaded (it loads most of Inductor)

    if getattr(cfx.compile_fx, "_counted", False):
        return
    inner, depth = cfx.compile_fx, [0]

    def counted(*args, **kwargs):  # compile_fx calls itself (config patches): count the outermost call
        _INDUCTOR_GRAPHS[0] += depth[0] == 0
        depth[0] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] -= 1

    counted._counted = True
    cfx.compile_fx = counted


def _xdist_can_group() -> bool:
    """Whether pytest reads the node id pytest-xdist's loadgroup writes (``item._nodeid``; pytest 9.2 does not)."""
    from _pytest.nodes import Node

    probe = object.__new__(Node)
    probe._nodeid = "t@g"
    try:
        return Node.nodeid.fget(probe) == "t@g"
    except AttributeError:
        return False


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("dist", None) == "loadgroup" \
            and not _xdist_can_group():
        raise pytest.UsageError(
            f"effpass tests: --dist loadgroup cannot group tests with pytest {pytest.__version__} (it ignores the "
            "node ids pytest-xdist writes): shared fixtures would run once per worker. Install the pytest the dev "
            "extra pins (pyproject.toml: pytest<9.2), or run without -n.")


def pytest_collection_finish(session):
    """``--dist loadgroup`` sends the tests of one ``xdist_group`` to one worker, so that a module fixture (a spawn
    of ranks, a fork server, a dry run) runs once. pytest-xdist marks them by appending "@group" to the node id;
    pytest 9.2 ignores that (its node ids are no longer the attribute xdist writes), and the groups were split
    silently: the 2-rank spawn of tests/passes/wrap_fsdp ran three times per CI run. Fail instead of splitting."""
    config = session.config
    if not (os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup")):
        return
    lost = [it.nodeid for it in session.items if it.get_closest_marker("xdist_group") is not None
            and it.nodeid.rfind("@") <= it.nodeid.rfind("]")]
    if lost:
        import xdist

        raise pytest.UsageError(
            f"effpass tests: pytest {pytest.__version__} with pytest-xdist {xdist.__version__} does not group "
            f"xdist_group tests under --dist loadgroup (e.g. {lost[0]}): their shared fixtures would run once per "
            "worker and module switch. Install the pytest the dev extra pins (pyproject.toml: pytest<9.2).")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _count_inductor_graphs()
    before = _INDUCTOR_GRAPHS[0]
    yield
    if _INDUCTOR_GRAPHS[0] > before and "inductor" not in item.keywords:
        item.user_properties.append(("unmarked_inductor_graphs", _INDUCTOR_GRAPHS[0] - before))


def pytest_runtest_logreport(report):  # in the xdist controller too: user_properties travel with the report
    for key, value in report.user_properties:
        if key == "unmarked_inductor_graphs" and report.when == "call":
            _UNMARKED_INDUCTOR.append(f"{report.nodeid} ({value} graphs)")


def pytest_terminal_summary(terminalreporter):
    if _UNMARKED_INDUCTOR:
        terminalreporter.section("lowered with Inductor without the inductor mark (tests/conftest.py)")
        for line in _UNMARKED_INDUCTOR:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# A skip is a failed promise unless it needs hardware that is absent or an explicitly optional extra:
# any other skip fails the run (CI prints every skip reason with -rs).
ALLOWED_SKIP_REASONS = ("needs a CUDA GPU", "needs a GPU", "optional extra:")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not any(reason.startswith(ok) for ok in ALLOWED_SKIP_REASONS):
        report.outcome = "failed"
        report.longrepr = (f"skipped for a reason that is not allowed ({reason!r}); allowed: "
                           f"{list(ALLOWED_SKIP_REASONS)} (tests/conftest.py)")
