"""Scoping: one language for every pass.

* ``targets`` / ``exclude``: module-name globs (``fnmatch`` syntax: ``*``, ``?``, ``[0-5]``) matched
  against the fully qualified name of the module a node came from, e.g. ``"model.layers.1[0-5].*"``.
  A node matches a glob when the glob matches its module or any enclosing module, so ``"model.layers.3"``
  covers everything inside layer 3.
* ``effpass.skip(*names)`` / ``effpass.only(*names)`` on a module class or instance: nodes from that
  module (and its children) are left alone by the named passes (skip), or only the named passes act on
  them (only). With no names, ``skip`` skips every pass.
"""
from __future__ import annotations

import difflib
import fnmatch
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from .graph import module_path_of_node, module_stack_of_node, normalize_module_path  # noqa: F401

__all__ = ["skip", "only", "Scope", "module_path_of_node", "normalize_module_path", "TargetMatchError",
           "check_patterns", "warn_nothing_to_act_on", "graph_module_paths", "glob_match", "glob_match_within",
           "enclosing_paths"]

_SKIP_ATTR = "__effpass_skip__"
_ONLY_ATTR = "__effpass_only__"
ALL = "*"

# Instances decorated with skip/only: looked up by identity when the graph only names the class.
_INSTANCE_RULES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, frozenset[str]]]" = weakref.WeakKeyDictionary()


# (pass, targets, exclude) already checked against a model's module names
_CHECKED_ROOTS: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()


class TargetMatchError(ValueError):
    """A ``targets`` or ``exclude`` glob matched no module."""


def glob_match(name: str, globs: str | Iterable[str]) -> bool:
    """Whether the whole of ``name`` matches one of ``globs`` (``fnmatch`` syntax, case-sensitive: ``*``, ``?``,
    ``[0-5]``; ``*`` also matches dots). The one place a pass matches a name against globs."""
    if isinstance(globs, str):
        globs = (globs,)
    return any(fnmatch.fnmatchcase(name, g) for g in globs)


def glob_match_within(path: str, globs: str | Iterable[str]) -> bool:
    """Whether ``path`` or a module enclosing it (a dotted prefix, :func:`enclosing_paths`) matches one of
    ``globs``: the ``targets``/``exclude`` rule, so ``"model.layers.3"`` covers everything inside layer 3."""
    if isinstance(globs, str):
        globs = (globs,)
    globs = tuple(globs)
    return any(glob_match(p, globs) for p in enclosing_paths(path))


def enclosing_paths(path: str) -> list[str]:
    """``path`` and the paths of the modules enclosing it, outermost first: ``"a.b.c"`` -> ``["a", "a.b",
    "a.b.c"]`` (``""`` -> ``[""]``)."""
    if not path:
        return [""]
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _glob_matches(glob: str, names: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(p, glob) for n in names for p in enclosing_paths(n) if p)


def _sample(glob: str, names: Sequence[str], k: int = 8) -> str:
    """Up to ``k`` names: the ones closest to ``glob`` first, then the first ones."""
    plain = glob.replace("*", "").replace("?", "")
    leaves = {}
    for n in names:
        leaves.setdefault(n.rsplit(".", 1)[-1], n)
    close = difflib.get_close_matches(plain, list(names), n=3, cutoff=0.5)
    close += [leaves[c] for c in difflib.get_close_matches(plain.strip("."), list(leaves), n=3, cutoff=0.5)]
    picked = list(dict.fromkeys([*close, *names]))[:k]
    more = " ..." if len(names) > k else ""
    return ", ".join(repr(n) for n in picked) + more


def check_patterns(pass_name: str, targets: Sequence[str], exclude: Sequence[str], names: Sequence[str], *,
                   what: str = "module", candidates: Sequence[str] | None = None, error: bool = True,
                   where: str = "") -> list[str]:
    """Check that every ``targets`` and ``exclude`` glob matches at least one name.

    ``names`` are the module names that exist; ``targets`` globs must match one of ``candidates`` (the
    modules the pass could act on, default ``names``) or a module enclosing one. A glob that matches
    nothing raises :class:`TargetMatchError` naming it and some names that exist (``error=False``:
    a ``UserWarning`` instead, for callers that see only part of the model, such as one graph of
    several). Returns the unmatched globs. Every pass calls this, directly or through
    :meth:`Scope.select_modules` / :meth:`Scope.check_graph`.
    """
    names = [n for n in names if n]
    pool = [n for n in (candidates if candidates is not None else names) if n]
    unmatched = []
    for kind, globs, against in (("targets", targets, pool), ("exclude", exclude, names)):
        for glob in globs:
            if _glob_matches(glob, against):
                continue
            unmatched.append(glob)
            shown = against or names
            msg = (f"{pass_name}: {kind} pattern {glob!r} matches no {what}{where}; {what} names here include: "
                   f"{_sample(glob, shown) if shown else '(none)'}")
            if error:
                raise TargetMatchError(msg)
            warnings.warn(f"effpass: {msg}", UserWarning, stacklevel=3)
    return unmatched


def warn_nothing_to_act_on(pass_name: str, reason: str) -> None:
    """The one warning for a configuration that leaves a pass nothing to act on (names the pass)."""
    warnings.warn(f"effpass: pass {pass_name!r} has nothing to act on: {reason}", UserWarning, stacklevel=3)


def graph_module_paths(graph) -> list[str]:
    """The module paths (each with its enclosing modules) that nodes of an FX graph came from."""
    out: dict[str, None] = {}
    for n in graph.nodes:
        for path, _ in module_stack_of_node(n):
            if path:
                out.setdefault(path, None)
    return list(out)


def _decorate(attr: str, names: tuple[str, ...]):
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"effpass.skip/only take pass names (str), got {n!r}")

    def apply(obj):
        if isinstance(obj, type):
            if not issubclass(obj, torch.nn.Module):
                raise TypeError(f"effpass.skip/only decorate nn.Module classes or instances, got {obj!r}")
            prior = frozenset(obj.__dict__.get(attr, frozenset()))
            setattr(obj, attr, prior | frozenset(names or (ALL,)))
        elif isinstance(obj, torch.nn.Module):
            rules = _INSTANCE_RULES.setdefault(obj, {})
            rules[attr] = rules.get(attr, frozenset()) | frozenset(names or (ALL,))
        else:
            raise TypeError(f"effpass.skip/only decorate nn.Module classes or instances, got {type(obj).__name__}")
        return obj

    return apply


def skip(*names: str):
    """Leave nodes from the decorated module class or instance alone in the named passes (all if none).

    >>> @effpass.skip("apply_autocast")
    ... class Router(torch.nn.Module): ...
    >>> effpass.skip("fuse_attention")(model.layers[0].self_attn)   # one instance
    """
    if len(names) == 1 and not isinstance(names[0], str):  # used bare: @effpass.skip
        return _decorate(_SKIP_ATTR, ())(names[0])
    return _decorate(_SKIP_ATTR, names)


def only(*names: str):
    """Only the named passes act on nodes from the decorated module class or instance."""
    if not names:
        raise ValueError("effpass.only needs at least one pass name")
    return _decorate(_ONLY_ATTR, names)


def rules_of(obj) -> tuple[frozenset[str], frozenset[str] | None]:
    """(skip names, only names or None) of a module instance or class."""
    skip_names: frozenset[str] = frozenset()
    only_names: frozenset[str] | None = None
    klass = obj if isinstance(obj, type) else type(obj)
    for k in klass.__mro__:
        skip_names |= k.__dict__.get(_SKIP_ATTR, frozenset())
        if _ONLY_ATTR in k.__dict__:
            only_names = (only_names or frozenset()) | k.__dict__[_ONLY_ATTR]
    if not isinstance(obj, type):
        inst = _INSTANCE_RULES.get(obj, {})
        skip_names |= inst.get(_SKIP_ATTR, frozenset())
        if _ONLY_ATTR in inst:
            only_names = (only_names or frozenset()) | inst[_ONLY_ATTR]
    return skip_names, only_names


@dataclass
class Scope:
    """Decides whether a pass may act on a module path / node. Built once per pass per graph."""

    pass_name: str
    targets: Sequence[str] = ()
    exclude: Sequence[str] = ()
    root: torch.nn.Module | None = None  # the eager model when known (exact instance lookups)

    def __post_init__(self):
        self._cache: dict[tuple, bool] = {}
        self._modules = dict(self.root.named_modules()) if self.root is not None else {}
        # NOTE(experts): globs may name MoE expert tensors (3-D parameters, ``*.experts.gate_up_proj``), which
        # inject_lora and quantize_linear act on; they count as names for the unmatched-glob check.
        self._tensor_names = [n for n, p in self.root.named_parameters() if p.dim() == 3] \
            if self.root is not None else []
        self._checked = False
        if self.root is not None and (self.targets or self.exclude) and self.pass_name:
            # NOTE(one place): with the eager model known (effpass.compile / prepare), every pass's globs
            # are checked against its module names whenever the manager scopes a hook, whatever the pass.
            key = (self.pass_name, tuple(self.targets), tuple(self.exclude))
            done = _CHECKED_ROOTS.setdefault(self.root, set())
            if key not in done:
                check_patterns(self.pass_name, self.targets, self.exclude,
                               [n for n in self._modules if n] + self._tensor_names)
                done.add(key)
            self._checked = True

    # -- globs -------------------------------------------------------------------------------------
    def matches_globs(self, path: str) -> bool:
        prefixes = enclosing_paths(path)
        if self.targets and not any(fnmatch.fnmatchcase(p, g) for g in self.targets for p in prefixes if p):
            return False
        if self.exclude and any(fnmatch.fnmatchcase(p, g) for g in self.exclude for p in prefixes if p):
            return False
        return True

    # -- decorators --------------------------------------------------------------------------------
    def _allowed_by(self, obj) -> bool:
        skip_names, only_names = rules_of(obj)
        if self.pass_name in skip_names or ALL in skip_names:
            return False
        if only_names is not None and self.pass_name not in only_names:
            return False
        return True

    def allows_module(self, path: str, module: torch.nn.Module | None = None,
                      stack: Iterable[tuple[str, type | None]] = ()) -> bool:
        """Whether the pass may act on code from the module at ``path`` (glob rules and decorators)."""
        if not self.matches_globs(path):
            return False
        seen = False
        for p, klass in stack:
            mod = self._modules.get(p)
            if mod is not None:
                seen = seen or mod is module
                if not self._allowed_by(mod):
                    return False
            elif klass is not None and not self._allowed_by(klass):
                return False
        if module is not None and not seen and not self._allowed_by(module):
            return False
        if self._modules and not stack:
            for p in enclosing_paths(path):
                mod = self._modules.get(p)
                if mod is not None and not self._allowed_by(mod):
                    return False
        return True

    def allows(self, node: torch.fx.Node) -> bool:
        """Whether the pass may act on this node."""
        stack = tuple(module_stack_of_node(node))
        if stack in self._cache:
            return self._cache[stack]
        path = stack[-1][0] if stack else ""
        ok = self.allows_module(path, stack=stack)
        self._cache[stack] = ok
        return ok

    # -- module phase ------------------------------------------------------------------------------
    def select_modules(self, model: torch.nn.Module, predicate=None, *, what: str = "module") -> list[tuple[str, torch.nn.Module]]:
        """(name, module) pairs in scope and satisfying ``predicate``; raises if a target matched nothing.

        ``targets`` globs are matched against the names of the candidate modules themselves (those that
        satisfy ``predicate``) and their enclosing modules.
        """
        candidates = [(n, m) for n, m in model.named_modules() if n and (predicate is None or predicate(n, m))]
        self.check_targets([n for n, _ in model.named_modules() if n], candidates=[n for n, _ in candidates], what=what)
        self._checked = True
        out = []
        modules = dict(model.named_modules())
        for name, mod in candidates:
            chain = [modules[p] for p in enclosing_paths(name) if p in modules]
            if self.matches_globs(name) and all(self._allowed_by(m) for m in [model, *chain]):
                out.append((name, mod))
        return out

    def check_targets(self, names: Sequence[str], candidates: Sequence[str] | None = None, what: str = "module") -> None:
        """Raise :class:`TargetMatchError` when a ``targets`` glob matches none of ``candidates`` or an
        ``exclude`` glob matches none of ``names`` (see :func:`check_patterns`)."""
        check_patterns(self.pass_name, self.targets, self.exclude, names, candidates=candidates, what=what)

    def allows_root(self, model: torch.nn.Module) -> bool:
        """Whether the decorators allow the pass on the root module itself (globs never name the root)."""
        return self._allowed_by(model)

    def check_graph(self, gm: torch.fx.GraphModule | None = None, *, what: str = "module") -> None:
        """For graph-phase passes: check ``targets``/``exclude`` once per scope.

        With the eager model known (``effpass.compile``/``prepare``) a glob that matches none of its
        modules is an error; without it (the string backend) the names come from this graph only,
        which may be one of several (graph breaks), so an unmatched glob is a warning.
        """
        if getattr(self, "_checked", False) or not (self.targets or self.exclude):
            return
        self._checked = True
        if self.root is not None:
            check_patterns(self.pass_name, self.targets, self.exclude,
                           [n for n in self._modules if n] + self._tensor_names, what=what)
        elif gm is not None:
            check_patterns(self.pass_name, self.targets, self.exclude, graph_module_paths(gm.graph), what=what,
                           error=False, where=" in this graph")

    def select_nodes(self, gm: torch.fx.GraphModule, candidates: Iterable[torch.fx.Node], *,
                     what: str = "site") -> list[torch.fx.Node]:
        """For graph-phase passes: check the globs (:meth:`check_graph`), keep the candidate nodes in
        scope, and warn (naming the pass) when there were candidates but the scope leaves none."""
        self.check_graph(gm)
        candidates = list(candidates)
        kept = [n for n in candidates if self.allows(n)]
        # root-level code (no module) is never excluded by a glob: exclude=["*"] leaves only that
        if any(module_path_of_node(n) for n in candidates) and not any(module_path_of_node(n) for n in kept):
            self.warn_nothing_to_act_on(f"its targets/exclude/skip rules leave none of the {len(candidates)} "
                                        f"{what}(s) in this graph")
        return kept

    def warn_nothing_to_act_on(self, reason: str) -> None:
        warn_nothing_to_act_on(self.pass_name, reason)
