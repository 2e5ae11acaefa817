"""effpass.patterns (pattern-matcher building blocks) and the heads fuse_cross_entropy matches with them: a plain
projection and a LoRA head (``passes/fuse_cross_entropy/matching.py``), each as torch pattern-matcher patterns with the module
contract as the extra check."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import pattern_matcher as pm

from effpass.graph import Skip
from effpass.patterns import Calls, OneOf, first_match, linear


def _graph(f, *args):
    gms = []
    torch._dynamo.reset()
    torch.compile(f, backend=lambda gm, ex: gms.append(gm) or gm.forward, fullgraph=True)(*args)
    return gms[0]


def _output(gm):
    return next(n for n in gm.graph.nodes if n.op == "output").args[0][0]


def test_one_of_calls_and_linear_match_the_spellings():
    w, b = torch.randn(3, 4), torch.randn(3)
    gm = _graph(lambda x: F.linear(x, w).float().to(torch.float32), torch.randn(2, 4))
    m = first_match([Calls(linear(pm.KeywordArg("h"), pm.KeywordArg("w")), methods={"float", "to"}, name="casts")],
                    _output(gm))
    assert m is not None and m.kwargs["h"].op == "placeholder" and [n.target for n in m.kwargs["casts"]] == ["to", "float"]
    # with a bias (three arguments); min_len: at least one cast
    gm = _graph(lambda x: F.linear(x, w, b), torch.randn(2, 4))
    assert first_match([linear(pm.Arg(), pm.Arg())], _output(gm)) is not None
    assert first_match([Calls(linear(pm.Arg(), pm.Arg()), methods={"float"}, min_len=1)], _output(gm)) is None
    # OneOf undoes a failed alternative's captures: the second alternative may bind the same KeywordArg
    x = pm.KeywordArg("x")
    alt = OneOf(pm.CallFunction(torch.relu, pm.CallFunction(torch.neg, x)), pm.CallFunction(torch.relu, x))
    gm = _graph(lambda t: torch.relu(torch.exp(t)), torch.randn(2))
    m = first_match([alt], _output(gm))
    assert m is not None and m.kwargs["x"].target is torch.exp


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(8, 16, bias=False)

    def forward(self, h, labels):
        logits = self.lm_head(h)
        return F.cross_entropy(logits.float().view(-1, 16), labels.view(-1))


@pytest.mark.parametrize("case", ["lora", "plain", "scale_mismatch"])
def test_lora_head_is_a_pattern_with_the_module_contract_as_extra_check(case):
    """fuse_cross_entropy's head: ``linear(h, W) + (linear(linear(x, A), B) * s).type_as(...)`` is matched by
    LORA_HEAD and LOW_RANK (torch pattern-matcher patterns) on the LoRA module's own tensors; an adapter whose
    graph scale differs from its module's is left alone with the reason."""
    import operator

    from effpass.passes import lora
    from effpass.passes.fuse_cross_entropy.matching import LORA_HEAD, LOW_RANK, PROJECTION, match

    assert all(isinstance(p, pm.PatternExpr) for p in (*LORA_HEAD, LOW_RANK, PROJECTION))
    torch.manual_seed(0)
    model = _Head()
    if case != "plain":
        lora.inject(model, ["lm_head"], rank=2, alpha=4)  # scaling 2.0
    gm = _graph(model, torch.randn(2, 3, 8), torch.randint(0, 16, (2, 3)))
    ce = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.cross_entropy)
    if case == "scale_mismatch":
        model.lm_head.scaling = 3.0  # the module now says 3.0; the traced graph multiplies by 2.0
        with pytest.raises(Skip, match=r"adapter is scaled by 2.0 in the graph, 3.0 by its module"):
            match(ce, model)
        return
    site = match(ce, model)
    if case == "plain":
        assert site.lora is None and first_match([PROJECTION], site.proj) is not None
        return
    u0, b, scale = site.lora
    assert site.proj.target in (torch.add, operator.add) and scale == 2.0
    assert first_match(LORA_HEAD, site.proj) is not None and first_match([LOW_RANK], site.lora_nodes[-2]) is not None
    assert u0.args[1].op == "placeholder" and b.op == "placeholder" and site.weight is not b
