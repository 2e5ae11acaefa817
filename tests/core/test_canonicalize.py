"""effpass.canonicalize: one spelling per op before the torch-IR passes match; in-place forms made out of
place only where no alias can see the difference. Oracles: the ops of the graph after (structural) and
the graph's outputs against eager (numerical, exact)."""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from effpass.canonicalize import canonicalize
from effpass.graph import op_histogram


def _dynamo_graph(fn, *inputs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    assert len(graphs) == 1
    gm, args = graphs[0]
    gm.run = lambda: gm(*args)[0]  # the graph's inputs in its own order (Dynamo may reorder them)
    return gm


def _attention_spellings(q, k, v, m):
    s1 = q @ k.transpose(-1, -2)                       # operator.matmul, method transpose
    s2 = q.matmul(k.transpose(-2, -1))                 # method matmul
    s3 = torch.matmul(q, torch.transpose(k, -1, -2))   # already canonical
    s = s1 / 2.0 + s2.div(2.0) + torch.true_divide(s3, 2.0)
    s = s.masked_fill(m, -1e9) * 0.5
    p = F.softmax(s, dim=-1) + s.softmax(-1) + torch.special.softmax(s, -1)
    return p @ v


def test_one_spelling_per_op_and_the_same_values():
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    m = torch.rand(5, 5) > 0.7
    gm = _dynamo_graph(_attention_spellings, q, k, v, m)
    before = op_histogram(gm.graph)
    assert before.get("F.softmax") and before.get(".softmax") and before.get("operator.matmul", 0) + before.get(
        "_operator.matmul", 0) + sum(v for k_, v in before.items() if k_.endswith("matmul") and "torch" not in k_)
    stats = canonicalize(gm)
    after = op_histogram(gm.graph)
    assert after == {"torch.add": 4, "torch.div": 3, "torch.masked_fill": 1, "torch.matmul": 4, "torch.mul": 1,
                     "torch.softmax": 3, "torch.transpose": 3}, after
    assert stats["methods"] > 0 and stats["functions"] > 0 and stats["operators"] > 0
    assert len(gm.graph.nodes) == sum(1 for _ in gm.graph.nodes)  # nodes rewritten in place
    torch.testing.assert_close(gm.run(), _attention_spellings(q, k, v, m), rtol=0, atol=0)


def _inplace_safe(x, w):
    s = x @ w
    s /= 4.0                       # operator.itruediv on a fresh tensor: safe
    s.masked_fill_(s > 1.0, -1.0)  # method in place, later readers read the original node: safe
    return s.softmax(-1)


def _inplace_aliased(x, w):
    s = x @ w
    t = s.view(-1)                 # an alias made before the mutation: it must see the update
    s.mul_(3.0)
    return s + t.view(s.shape)


def test_inplace_made_out_of_place_where_safe():
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    gm = _dynamo_graph(_inplace_safe, x, w)
    stats = canonicalize(gm)
    assert stats["inplace"] == 2 and stats["inplace_kept"] == 0
    names = op_histogram(gm.graph)
    assert not any(n.endswith("_") or "itruediv" in n for n in names), names
    torch.testing.assert_close(gm.run(), _inplace_safe(x, w), rtol=0, atol=0)


def test_inplace_kept_where_an_alias_sees_it():
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    gm = _dynamo_graph(_inplace_aliased, x, w)
    stats = canonicalize(gm)
    assert stats["inplace"] == 0 and stats["inplace_kept"] == 1
    assert any(n.op == "call_method" and n.target == "mul_" for n in gm.graph.nodes)
    torch.testing.assert_close(gm.run(), _inplace_aliased(x, w), rtol=0, atol=0)


def test_python_operators_on_sizes_stay():
    def f(x):
        return x.reshape(x.shape[0] + 1 - 1, -1) * 2

    x = torch.randn(3, 4)
    torch._dynamo.reset()
    gm = _dynamo_graph(f, x)
    canonicalize(gm)
    assert not any(n.target is torch.add for n in gm.graph.nodes if n.op == "call_function") or all(
        isinstance(n.args[0], torch.fx.Node) for n in gm.graph.nodes if n.target is torch.add)
    assert any(n.target is torch.mul for n in gm.graph.nodes) and not any(n.target is operator.mul for n in gm.graph.nodes)
