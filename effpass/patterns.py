"""Building blocks for matching torch-IR graphs with torch's pattern matcher (core; used by the passes' matchers).

Passes write their fixed sub-patterns with ``torch._inductor.pattern_matcher`` (``CallFunction``, ``CallMethod``,
``KeywordArg``...) and match them at an anchor node with :func:`first_match`. What that library cannot say, and
torch-IR graphs need, is here:

* :class:`OneOf`: alternatives (``F.linear(x, w)`` or ``F.linear(x, w, b)``), the first that matches wins;
* :class:`Calls`: ``min..max`` calls in a row of any of some methods or functions, each on the previous one's
  result as its first argument and with any further arguments (``.to(dtype)``, ``.float()``, ``.type_as(y)``,
  ``F.dropout(x, p, training)``: a ``CallMethod`` pattern fixes the argument count, these ops do not);
* :func:`linear`: ``F.linear`` with or without a bias.

Matches keep torch's conventions: ``Match.kwargs`` holds what ``KeywordArg`` captured, ``Match.nodes`` the matched
nodes, inner ones first. Patterns here never check users unless asked (``single_user``): the caller's extra
check decides what other readers of a matched node mean.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._inductor import pattern_matcher as pm

from .graph import is_fn, is_method

__all__ = ["OneOf", "Calls", "linear", "first_match", "LINEAR_FNS"]

#: ``F.linear`` as Dynamo records it
LINEAR_FNS = (torch._C._nn.linear, F.linear)


class OneOf(pm.PatternExpr):
    """The first of ``alternatives`` that matches the node (a failed alternative's partial captures are undone)."""

    def __init__(self, *alternatives: pm.PatternExpr):
        super().__init__()
        self.alternatives = alternatives

    def _match(self, node: Any, ctx: pm.MatchContext) -> pm.MatchResult:
        prior = dict(ctx.pattern_to_node)
        m: pm.MatchResult = pm.FailedMatch("no alternative matched {}", node)
        for p in self.alternatives:
            try:
                m = ctx.match(p, node)
            except AssertionError:  # torch's argument normalisation of a call_method node
                m = pm.FailedMatch("arguments not normalisable {}", node)
            if pm.is_match(m):
                return m
            ctx.pattern_to_node = dict(prior)
        return m

    def pattern_eq(self, other: Any) -> bool:
        return super().pattern_eq(other) and len(self.alternatives) == len(other.alternatives) and all(
            a.pattern_eq(b) for a, b in zip(self.alternatives, other.alternatives))


class Calls(pm.PatternExpr):
    """``min_len..max_len`` calls in a row of ``methods`` / ``fns`` with any argument list, each applied (first
    argument) to the previous one, the innermost to what ``inner`` matches. Greedy: it takes as many calls as
    there are (up to ``max_len``), then matches ``inner``. ``single_user``: every call has one user. ``name``: the
    match's ``kwargs[name]`` is the tuple of calls, outermost first."""

    def __init__(self, inner: pm.PatternExpr, *, methods: Iterable[str] = (), fns: Iterable[Any] = (),
                 min_len: int = 0, max_len: int | None = None, single_user: bool = False, name: str | None = None):
        super().__init__()
        self.inner, self.methods, self.fns = inner, frozenset(methods), frozenset(fns)
        self.min_len, self.max_len, self.single_user = min_len, max_len, single_user
        self.name = name

    def _is_call(self, n: Any) -> bool:
        return (is_method(n, self.methods) or is_fn(n, self.fns)) and bool(n.args) and isinstance(n.args[0], fx.Node)

    def _match(self, node: Any, ctx: pm.MatchContext) -> pm.MatchResult:
        calls = []
        while self._is_call(node) and (self.max_len is None or len(calls) < self.max_len):
            if self.single_user and len(node.users) != 1:
                return pm.FailedMatch("multiple users: {}", node)
            calls.append(node)
            node = node.args[0]
        if len(calls) < self.min_len:
            return pm.FailedMatch("fewer than {} calls before {}", self.min_len, node)
        child = ctx.match(self.inner, node)
        if not pm.is_match(child):
            return child
        m = pm.Match(ctx, self, kwargs={self.name: tuple(calls)} if self.name else None)
        m.extend(child)
        m.nodes.extend(reversed(calls))
        return m

    def pattern_eq(self, other: Any) -> bool:
        return (super().pattern_eq(other) and self.inner.pattern_eq(other.inner) and self.methods == other.methods
                and self.fns == other.fns and (self.min_len, self.max_len, self.single_user)
                == (other.min_len, other.max_len, other.single_user))


def linear(x: Any, weight: Any) -> OneOf:
    """``F.linear(x, weight)`` or ``F.linear(x, weight, bias)`` (any users; the bias, positional or keyword, is
    the caller's to read from the node)."""
    return OneOf(pm.CallFunction(list(LINEAR_FNS), x, weight, _users=pm.MULTIPLE),
                 pm.CallFunction(list(LINEAR_FNS), x, weight, pm.Ignored(), _users=pm.MULTIPLE))


def first_match(patterns: Iterable[pm.PatternExpr], node: Any) -> pm.Match | None:
    """The match of the first of ``patterns`` that matches at ``node`` (the patterns' root), or None."""
    if not isinstance(node, fx.Node):
        return None
    for p in patterns:
        try:
            m = p.match(node)
        except AssertionError:  # torch's argument normalisation of a call_method node
            continue
        if pm.is_match(m):
            return m
    return None
