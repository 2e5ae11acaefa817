"""effpass.graph_figures: the per-graph figures the dump and the HTML report show first, read from tensor
metadata with nothing run. Numerical oracles: the matmul FLOPs of the lowered forward and backward equal torch's
FlopCounterMode on the eager step; the liveness peak of planted graphs equals the hand count. Structural: the
saved-for-backward bytes equal checkpoint_activations' own measurement of the same backward graph."""
from __future__ import annotations

import json

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

import effpass
from effpass.graph_figures import graph_figures
from effpass.testing import model_case

N = 1024  # fp32 elements: 4 KiB per value


def _figures(fn) -> dict:
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(N))
    return graph_figures(gm)


def test_peak_is_the_most_intermediate_bytes_alive_at_once():
    # a, b alive together while b is computed; a freed after its last use: peak 2 values
    chain = _figures(lambda x: ((x + 1) * 2) * 3)
    assert chain["peak_bytes"] == 2 * 4 * N and chain["input_bytes"] == 4 * N
    # a kept until the end: a, b, t alive at once, then a, t, out: peak 3 values
    kept = _figures(lambda x: (lambda a: ((a * 2) * 3) + a)(x + 1))
    assert kept["peak_bytes"] == 3 * 4 * N
    # views share their base's storage: no bytes of their own
    views = _figures(lambda x: (x + 1).view(32, 32).t().reshape(-1) * 2)
    assert views["peak_bytes"] == 2 * 4 * N
    assert chain["flops"] == 3 * N and chain["matmul_flops"] == 0 and chain["kernels"] == 3


def test_matmul_flops_equal_flop_counter_mode_and_saved_bytes_equal_checkpointings_measure(tmp_path):
    case = model_case("llama", train=True)
    ref = model_case("llama", train=True)
    with FlopCounterMode(display=False) as counter:
        ref.loss(ref.model(**ref.inputs)).backward()
    m = effpass.compile(case.model, passes=["checkpoint_activations"], lowering="eager", dump_dir=str(tmp_path))
    case.loss(m(**case.inputs)).backward()
    figs = json.loads((tmp_path / "graph_000" / "index.json").read_text())["figures"]
    fw, bw = figs["forward"], figs["backward"]
    # the "ops" policy recomputes no matmul: the lowered graphs hold exactly the eager step's matmuls
    assert fw["matmul_flops"] + bw["matmul_flops"] == counter.get_total_flops() > 0
    assert fw["flops"] > fw["matmul_flops"] and bw["flops"] > bw["matmul_flops"]
    measured = effpass.report(m).stats("checkpoint_activations")["saved_bytes_measured"]
    assert bw["saved_bytes"] == measured > 0 and "saved_bytes" not in fw
    assert fw["peak_bytes"] > 0 and bw["peak_bytes"] > 0 and fw["est_ms"]["h100"] > 0


def test_symbolic_sizes_get_a_reason_not_figures():
    """A graph with symbolic sizes gets a reason, not figures: reading them would add guards to the compile."""
    gm = make_fx(lambda t: (t * 2).sum(0), tracing_mode="symbolic")(torch.randn(8, 4))
    assert graph_figures(gm) == {"skipped": "symbolic sizes: figures are read from graphs with fixed sizes only"}
    assert "skipped" not in _figures(lambda x: x * 2)
