"""effpass.graph: the helpers every pass shares (one copy each)."""
import operator

import torch
import torch.fx as fx

from effpass.graph import (copy_provenance, has_tangents, infer_fake_values, is_primal, is_tangent,
                           module_path_of_node, normalize_module_path, source_path, transformer_blocks)
from effpass.testing import model_case


def test_normalize_module_path_reads_dynamo_sources():
    assert normalize_module_path("L['self']._modules['model']._modules['layers']['3']") == "model.layers.3"
    assert normalize_module_path("L['self'].model.layers.0.self_attn") == "model.layers.0.self_attn"


def test_transformer_blocks_one_per_layer_and_one_layer_models():
    for layers in (1, 3):
        case = model_case("llama", layers=layers)
        assert [n for n, _ in transformer_blocks(case.model)] == [f"model.layers.{i}" for i in range(layers)]
    mixed = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()])
    assert transformer_blocks(torch.nn.Sequential(mixed)) == []


def _captured(model, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=backend)(*args)
    return graphs[0]


def test_source_path_names_parameters_and_infer_fake_values_fills_new_nodes():
    torch._dynamo.reset()
    lin = torch.nn.Sequential(torch.nn.Linear(4, 3))
    gm, _ = _captured(lin, torch.randn(2, 4))
    paths = {source_path(n) for n in gm.graph.find_nodes(op="placeholder")}
    assert {"0.weight", "0.bias"} <= paths and "" in paths   # the user input has no module source
    linear = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert module_path_of_node(linear) == "0"
    with gm.graph.inserting_after(linear):
        relu = gm.graph.call_function(torch.relu, (linear,))
        twice = gm.graph.call_function(operator.mul, (relu, 2))
    copy_provenance(relu, linear)
    assert relu.meta["nn_module_stack"] == linear.meta["nn_module_stack"] and "example_value" not in relu.meta
    assert infer_fake_values([relu, twice])
    assert twice.meta["example_value"].shape == (2, 3)
    torch._dynamo.reset()


def test_primals_and_tangents_of_a_joint_graph():
    g = fx.Graph()
    p, t = g.placeholder("primals_1"), g.placeholder("tangents_1")
    g.output((p, t))
    assert is_primal(p) and not is_tangent(p) and is_tangent(t) and has_tangents(g)
    g2 = fx.Graph()
    g2.output(g2.placeholder("arg0_1"))
    assert not has_tangents(g2)


def _structure(g: fx.Graph):
    """Each node's op, target and arguments (nodes by position): equal for equal graphs, names aside."""
    pos = {n: i for i, n in enumerate(g.nodes)}
    return [(n.op, n.target if n.op != "placeholder" else None,
             fx.map_arg(n.args, lambda a: pos[a]), fx.map_arg(n.kwargs, lambda a: pos[a])) for n in g.nodes]


def test_graph_checkpoint_restores_every_kind_of_edit():
    from effpass.graph import GraphCheckpoint, lazy_graph_module, snapshot_graph

    class M(torch.nn.Module):
        def forward(self, x, y):
            a = torch.relu(x) + y
            return torch.cat([a, x * 2], dim=0).sum(0)

    gm = fx.symbolic_trace(M())
    before = _structure(gm.graph)
    ph = list(gm.graph.find_nodes(op="placeholder"))
    cp = GraphCheckpoint(gm.graph)
    g = gm.graph
    relu = next(n for n in g.nodes if n.target is torch.relu)
    relu.meta["mark"] = 1
    with g.inserting_after(relu):  # a new node, a rewired user, an erased node and a new input
        neg = g.call_function(torch.neg, (relu,))
    relu.replace_all_uses_with(neg, delete_user_cb=lambda u: u is not neg)
    cat = next(n for n in g.nodes if n.target is torch.cat)
    cat.args = ([neg, neg],) + cat.args[1:]
    mul = next(n for n in g.nodes if n.target is operator.mul)
    g.erase_node(mul)
    with g.inserting_before(relu):
        g.placeholder("extra")
    assert _structure(g) != before
    cp.restore()
    assert _structure(g) == before                      # structural oracle
    assert list(g.find_nodes(op="placeholder")) == ph   # the graph's own inputs, by identity
    assert "mark" not in next(n for n in g.nodes if n.target is torch.relu).meta
    g.lint()
    gm.recompile()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(gm(x, y), M()(x, y), rtol=0, atol=0)   # numerical oracle
    # a pass that removed an input cannot be rolled back: refused before anything changes
    cp2 = GraphCheckpoint(g)
    y_node = ph[1]
    y_node.replace_all_uses_with(ph[0])
    g.erase_node(y_node)
    edited = _structure(g)
    try:
        cp2.restore()
        raise AssertionError("restore of a removed input did not raise")
    except RuntimeError as e:
        assert "removed graph inputs ['y']" in str(e)
    assert _structure(g) == edited
    # a pass that failed leaving a node used before its definition (out of topological order): rolled back too
    cp3 = GraphCheckpoint(g)
    before3 = _structure(g)
    relu = next(n for n in g.nodes if n.target is torch.relu)
    with g.inserting_before(g.output_node()):
        late = g.call_function(torch.neg, (ph[0],))
    relu.args = (late,)  # relu now reads a node defined after it
    cp3.restore()
    assert _structure(g) == before3
    g.lint()
    # a lazy copy generates its code when first read or called, and runs as the original
    lazy = lazy_graph_module(gm, snapshot_graph(fx.symbolic_trace(M()).graph))
    torch.testing.assert_close(lazy(x, y), M()(x, y), rtol=0, atol=0)
    assert "relu" in lazy.code
