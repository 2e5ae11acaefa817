import os

# A stable Inductor cache directory keeps warm compiles warm between test runs (set before torch loads).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "inductor"))

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
