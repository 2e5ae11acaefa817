"""Passes used by the core tests, registered under a fixture so the registry is restored afterwards."""
import dataclasses

import torch

import effpass
from effpass.graph import op_name
from effpass.pass_api import _REGISTRY

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountLinears(effpass.Pass):
    """Counts torch-IR linears in scope and the module paths they came from (changes nothing)."""

    def transform_torch_ir(self, gm, ctx):
        from effpass.scope import module_path_of_node

        paths = [module_path_of_node(n) for n in gm.graph.nodes
                 if n.op == "call_function" and n.target in LINEAR_TARGETS and ctx.allows(n)]
        return effpass.PassResult(False, {"linears": len(paths), "paths": paths})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleLinearsByOne(effpass.Pass):
    """Multiplies each in-scope linear's output by 1.0 (changes the graph, not the function)."""

    def transform_torch_ir(self, gm, ctx):
        n = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in LINEAR_TARGETS and ctx.allows(node):
                with gm.graph.inserting_after(node):
                    new = gm.graph.call_function(torch.mul, (node, 1.0))
                node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
                n += 1
        return effpass.PassResult(n > 0, {"wrapped": n})


@dataclasses.dataclass(frozen=True, kw_only=True)
class BreakGraph(effpass.Pass):
    """Half-edits the joint graph, then raises (to test rollback)."""

    def transform_joint(self, gm, ctx):
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and op_name(node) == "aten.mm":
                with gm.graph.inserting_after(node):
                    bad = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 0.0))
                node.replace_all_uses_with(bad, delete_user_cb=lambda u: u is not bad)
                break
        raise RuntimeError("deliberate failure after a half edit")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountJointMatmuls(effpass.Pass):
    def transform_joint(self, gm, ctx):
        return effpass.PassResult(False, {"mm": sum(1 for n in gm.graph.nodes if op_name(n) in ("aten.mm", "aten.bmm"))})

    def transform_post_grad(self, gm, ctx):
        return effpass.PassResult(False, {f"{ctx.graph_kind}_nodes": len(gm.graph.nodes)})


def register_test_passes():
    effpass.registered_passes()
    saved = dict(_REGISTRY)
    effpass.register_pass("count_linears")(CountLinears)
    effpass.register_pass("scale_linears_by_one")(ScaleLinearsByOne)
    effpass.register_pass("break_graph")(BreakGraph)
    effpass.register_pass("count_joint_matmuls")(CountJointMatmuls)

    def restore():
        _REGISTRY.clear()
        _REGISTRY.update(saved)

    return restore


class TanhStack(torch.nn.Module):
    """A self-written model whose parameters dominate its activations: a stack of square linears with tanh, the
    loss the mean square of the output (step_in_backward's and the host optimizer's tests)."""

    def __init__(self, dim=256, depth=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x.square().mean()

