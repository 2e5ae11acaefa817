"""pytest plugin: record pass statistics and loss/grad numerics per test into $EFFPASS_REC (JSON).

A behaviour check (not a timing): run the same tests on the tree before and after a change, then compare the two
recordings with ``bench/behaviour_compare.py``. From a checkout's root:

    EFFPASS_REC=/tmp/before.json PYTHONPATH=bench python -m pytest -q -p behaviour_record tests/models/test_families.py
    # ... the same on the other tree into /tmp/after.json, then
    python bench/behaviour_compare.py /tmp/before.json /tmp/after.json

Records, per test: every pass record's statistics and skip reasons, every ``effpass.testing.loss_of`` value and
every ``grads_of`` result (sum and abs-sum per parameter, float64).
"""
import importlib
import json
import os

import pytest

T = importlib.import_module("effpass.testing")
R = importlib.import_module("effpass.report")

_cur = {"id": None}
_data = {}

def _bucket():
    return _data.setdefault(_cur["id"] or "?", {"stats": [], "loss": [], "grads": []})

_orig_add = R.GraphReport.add
def add(self, record):
    _bucket()["stats"].append([record.name, record.phase, record.graph, {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)) for k, v in dict(record.stats).items()}, [str(s) for s in record.skipped], record.fell_back if hasattr(record, "fell_back") else None])
    return _orig_add(self, record)
R.GraphReport.add = add

_orig_loss, _orig_grads = T.loss_of, T.grads_of
def loss_of(out):
    l = _orig_loss(out)
    _bucket()["loss"].append(float(l.detach().float()))
    return l
def grads_of(m):
    g = _orig_grads(m)
    _bucket()["grads"].append({k: [float(v.double().sum()), float(v.double().abs().sum())] for k, v in sorted(g.items())})
    return g
T.loss_of, T.grads_of = loss_of, grads_of

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _cur["id"] = item.nodeid
    yield
    _cur["id"] = None
    with open(os.environ["EFFPASS_REC"], "w") as f:
        json.dump(_data, f, indent=0, sort_keys=True)

def pytest_sessionfinish(session):
    with open(os.environ["EFFPASS_REC"], "w") as f:
        json.dump(_data, f, indent=0, sort_keys=True)
