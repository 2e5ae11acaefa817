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
