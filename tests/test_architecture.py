"""The layout's rules, checked on the import graph (ast): the core never imports a pass or a tool, passes
never import each other, and no module of the package takes part in an import circle.

How a pass module is told from a pass's helper module: a *pass module* is a module of ``passes/`` whose
code calls ``register_pass`` (it defines a registered pass); every other module there (``lora.py``,
``fsdp_estimate.py``, ``_quant_formats.py``, ...) is a *helper module*. A pass module never imports another
pass module; a helper module never imports a pass module and belongs to one pass: at most one pass module
reaches it (directly or through other helpers). What two passes share is a contract and lives in the core.

    effpass/ core: backend manager pass_api config scope graph report dump
    effpass/<tool>/: cli, inspect, integrations, planning, testing, verification  -> may import the core
    effpass/__init__.py, effpass/api.py: the public facade          -> may import the core and tools
    passes/ (effpass.passes)                                        -> may import the core and tools
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

import effpass

ROOT = pathlib.Path(effpass.__file__).resolve().parent
PASSES = ROOT.parent / "passes"
FACADE = {"effpass", "effpass.api"}
CORE = {"effpass." + p.stem for p in ROOT.glob("*.py")} - {"effpass.__init__"} - FACADE


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for base, pkg in ((ROOT, "effpass"), (PASSES, "effpass.passes")):
        for f in base.rglob("*.py"):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = f
    return mods


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Every module of the package that ``name`` imports, at any depth of its code."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            while t and t not in known:  # `import effpass.passes.lora` -> the known module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        for dep in _imports(name, path, set(mods)):
            g.add_edge(name, dep)
    return g


def _registers_a_pass(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "register_pass":
                return True
    return False


def _pass_layout(mods: dict[str, pathlib.Path] | None = None):
    """(pass modules, helper modules) of ``passes/``."""
    mods = mods or _modules()
    inside = {m: p for m, p in mods.items() if m.startswith("effpass.passes.")}
    passes = {m for m, p in inside.items() if _registers_a_pass(p)}
    return passes, set(inside) - passes


def pass_layout_violations(g: nx.DiGraph, passes: set[str], helpers: set[str]) -> list[str]:
    out = [f"pass {a} imports pass {b}" for a, b in g.edges if a in passes and b in passes]
    out += [f"helper {a} imports pass {b}" for a, b in g.edges if a in helpers and b in passes]
    helper_graph = g.subgraph(passes | helpers).edge_subgraph(
        [(a, b) for a, b in g.edges if a in passes | helpers and b in helpers]).copy()
    for h in sorted(helpers):
        if h not in helper_graph:
            continue
        owners = sorted(p for p in passes if p in helper_graph and nx.has_path(helper_graph, p, h))
        if len(owners) > 1:
            out.append(f"helper {h} is shared by passes {owners}: put the contract in the core")
    return sorted(out)


#: violations that other helpers' work removes (issue 22.3), each named: the test below fails when one
#: is gone, so the entry is deleted with the fix
KNOWN_PASS_LAYOUT_VIOLATIONS: set[str] = set()  # fuse_cross_entropy's two: fixed (effpass.quantized)


def test_passes_never_import_each_other():
    passes, helpers = _pass_layout()
    assert {"effpass.passes.fuse_attention", "effpass.passes.inject_lora"} <= passes
    assert {"effpass.passes.lora", "effpass.passes._quant_formats"} <= helpers
    bad = set(pass_layout_violations(_graph(), passes, helpers))
    assert not bad - KNOWN_PASS_LAYOUT_VIOLATIONS, f"passes reach into each other: {sorted(bad - KNOWN_PASS_LAYOUT_VIOLATIONS)}"


def test_known_pass_layout_violations_are_still_there():
    """Delete an entry of KNOWN_PASS_LAYOUT_VIOLATIONS when its fix lands (this test says which)."""
    passes, helpers = _pass_layout()
    gone = KNOWN_PASS_LAYOUT_VIOLATIONS - set(pass_layout_violations(_graph(), passes, helpers))
    assert not gone, f"fixed, remove from KNOWN_PASS_LAYOUT_VIOLATIONS: {sorted(gone)}"


def test_pass_layout_detector_can_fail():
    g = nx.DiGraph([("p.a", "p.b"), ("p.c", "p._h"), ("p.a", "p._h"), ("p._k", "p.a")])
    bad = pass_layout_violations(g, {"p.a", "p.b", "p.c"}, {"p._h", "p._k"})
    assert bad == ["helper p._h is shared by passes ['p.a', 'p.c']: put the contract in the core",
                   "helper p._k imports pass p.a", "pass p.a imports pass p.b"]
    # a helper of one pass, reached through another of its helpers, is fine
    g = nx.DiGraph([("p.a", "p._h"), ("p._h", "p._k")])
    assert pass_layout_violations(g, {"p.a"}, {"p._h", "p._k"}) == []


def test_import_graph_sees_the_package():
    g = _graph()
    assert {"effpass", "effpass.backend", "effpass.passes", "effpass.passes.lora", "effpass.cli"} <= set(g)
    assert g.has_edge("effpass.passes.lora", "effpass") or any(
        d.startswith("effpass.") and not d.startswith("effpass.passes") for d in g.successors("effpass.passes.lora"))


def test_core_and_tools_never_import_a_pass():
    g = _graph()
    bad = [(a, b) for a, b in g.edges if not a.startswith("effpass.passes") and b.startswith("effpass.passes")]
    assert not bad, f"the core or a tool imports a pass module: {bad}"


def test_core_never_imports_a_tool():
    g = _graph()
    bad = [(a, b) for a, b in g.edges if a in CORE and b not in CORE and b != "effpass" and not b.startswith("effpass.passes")]
    assert not bad, f"a core module imports a tool above it: {bad}"


def test_no_import_circles():
    g = _graph()
    # The package's __init__ re-exports the core (it imports every core module, and passes import it):
    # circles through it are the ordinary package pattern, not design circles, so leave its edges out.
    g.remove_edges_from([(a, b) for a, b in list(g.edges) if b == "effpass"])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import circles: {cycles}"


def test_a_detector_that_can_fail(tmp_path):
    """The walker resolves relative imports: a planted circle is found."""
    a = tmp_path / "a.py"
    a.write_text("from . import b\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from .a import x\n")
    known = {"pkg.a", "pkg.b"}
    assert _imports("pkg.a", a, known) == {"pkg.b"}
    assert _imports("pkg.b", b, known) == {"pkg.a"}


#: the longest a module of ``passes/`` may be (lines); longer ones are named below with the reason
MODULE_LINES = 500
LONG_MODULES = {
    "step_in_backward.py": "the optimizer hooks, the in-graph step op and its fake kernel (the planner's replay) "
                           "share one per-parameter registry",
}


def test_pass_modules_stay_a_few_hundred_lines():
    """A module of passes/ longer than MODULE_LINES is split by responsibility (kernels, autograd functions,
    matching, rewriting, reporting) or named in LONG_MODULES with the reason; a named one that got short is
    taken off the list."""
    lines = {p.name: len(p.read_text().splitlines()) for p in PASSES.glob("*.py")}
    too_long = sorted(f"{n} ({k} lines)" for n, k in lines.items() if k > MODULE_LINES and n not in LONG_MODULES)
    assert not too_long, f"split these by responsibility or name them in LONG_MODULES: {too_long}"
    short = sorted(n for n in LONG_MODULES if lines.get(n, 0) <= MODULE_LINES)
    assert not short, f"no longer long, remove from LONG_MODULES: {short}"


def test_fixed_sub_patterns_use_torch_pattern_matcher():
    """The attention spine, repeat_kv and the linear/LoRA heads are torch pattern-matcher patterns (issue 22.1):
    their matcher modules build on torch._inductor.pattern_matcher (through effpass.patterns)."""
    from torch._inductor import pattern_matcher as pm

    from effpass.passes import _attention_kv, _attention_match, _fuse_ce_match

    for mod in (_attention_kv, _attention_match, _fuse_ce_match):
        assert _imports(mod.__name__, pathlib.Path(mod.__file__), {"effpass.patterns"}) >= {"effpass.patterns"}
    heads = (*_fuse_ce_match.LORA_HEAD, _fuse_ce_match.LOW_RANK, _fuse_ce_match.PROJECTION, *_attention_match.SPINE,
             *_attention_match.QK_ROOTS)
    assert all(isinstance(p, pm.PatternExpr) for p in heads)
