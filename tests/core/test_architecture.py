"""The layout's rules, checked on the import graph (ast): the core never imports a pass or a tool, passes
never import each other, and no module of the package takes part in an import circle.

How a pass module is told from a pass's helper module: a *pass module* is a module of ``passes/`` whose
code calls ``register_pass`` (it defines a registered pass); every other module there (``lora.py``,
``fsdp_estimate.py``, ``formats.py``, ...) is a *helper module*. A pass module never imports another
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


def _registered_keys(path: pathlib.Path) -> list[str]:
    """The registry keys a module registers (``@effpass.register_pass("name", ...)``)."""
    keys = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name == "register_pass" and node.args and isinstance(node.args[0], ast.Constant):
                keys.append(node.args[0].value)
    return keys


def pass_packages() -> list[str]:
    """The folders of passes/ (one per built-in pass)."""
    return sorted(d.name for d in PASSES.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))


def owner(module: str) -> str | None:
    """The pass package a module of effpass.passes belongs to (``effpass.passes.<name>[.sub]`` -> name)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["effpass", "passes"] else None


def pass_layout_violations(g: nx.DiGraph) -> list[str]:
    """Edges from one pass's package into another's (or into the passes/ root, which imports every pass)."""
    out = []
    for a, b in g.edges:
        oa, ob = owner(a), owner(b)
        if oa is None:
            continue
        if b == "effpass.passes":
            out.append(f"{a} imports effpass.passes (the root imports every pass): import from the core")
        elif ob is not None and ob != oa:
            out.append(f"{a} (pass {oa}) imports {b} (pass {ob}): put the contract in the core")
    return sorted(out)


def test_one_package_per_pass():
    """passes/<name>/ for every built-in pass: the folder's __init__ registers the pass <name>; no module sits
    loose in passes/ beside __init__.py; folder name = registry key = docs page = test folder."""
    root = ROOT.parent
    loose = sorted(p.name for p in PASSES.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules loose in passes/ (move them into their pass's package or out of passes/): {loose}"
    names = pass_packages()
    assert len(names) >= 14, names
    import effpass.passes  # noqa: F401
    from effpass.pass_api import _REGISTRY

    for name in names:
        pkg = PASSES / name
        assert (pkg / "__init__.py").exists(), name
        assert _registered_keys(pkg / "__init__.py") == [name], f"passes/{name}/__init__.py must register {name!r}"
        for sub in pkg.rglob("*.py"):
            if sub.name != "__init__.py":
                assert not _registered_keys(sub), f"{sub}: only the package's __init__ registers its pass"
        assert (root / "docs" / "passes" / f"{name}.md").exists(), f"docs/passes/{name}.md missing"
        assert (root / "tests" / "passes" / name).is_dir(), f"tests/passes/{name}/ missing"
        assert name in _REGISTRY, name
    builtin = {k for k, v in _REGISTRY.items() if getattr(v, "__module__", "").startswith("effpass.passes.")}
    assert builtin == set(names), f"registered built-ins without a package, or packages without a pass: {builtin ^ set(names)}"


def test_passes_never_import_each_other():
    bad = pass_layout_violations(_graph())
    assert not bad, f"passes reach into each other: {bad}"


def test_pass_layout_detector_can_fail():
    g = nx.DiGraph([("effpass.passes.a", "effpass.passes.b.match"), ("effpass.passes.a.kv", "effpass.passes.a"),
                    ("effpass.passes.c.x", "effpass.passes"), ("effpass.passes", "effpass.passes.a"),
                    ("effpass.backend", "effpass.graph")])
    assert pass_layout_violations(g) == [
        "effpass.passes.a (pass a) imports effpass.passes.b.match (pass b): put the contract in the core",
        "effpass.passes.c.x imports effpass.passes (the root imports every pass): import from the core"]


def test_import_graph_sees_the_package():
    g = _graph()
    assert {"effpass", "effpass.backend", "effpass.passes", "effpass.passes.inject_lora.lora", "effpass.cli"} <= set(g)
    assert g.has_edge("effpass.passes.inject_lora", "effpass.passes.inject_lora.lora")
    assert any(d.startswith("effpass.") and not d.startswith("effpass.passes")
               for d in g.successors("effpass.passes.inject_lora"))


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


#: the longest a module of ``passes/`` or ``effpass/`` may be (lines); longer ones are named below with the reason
MODULE_LINES = 500
LONG_MODULES: dict[str, str] = {}


def test_modules_stay_a_few_hundred_lines():
    """A module of passes/ or effpass/ longer than MODULE_LINES is split by responsibility (kernels, autograd
    functions, matching, rewriting, reporting; capture, search, CLI) or named in LONG_MODULES with the reason;
    a named one that got short is taken off the list."""
    repo = ROOT.parent
    lines = {str(p.relative_to(repo)): len(p.read_text().splitlines())
             for base in (PASSES, ROOT) for p in base.rglob("*.py")}
    too_long = sorted(f"{n} ({k} lines)" for n, k in lines.items() if k > MODULE_LINES and n not in LONG_MODULES)
    assert not too_long, f"split these by responsibility or name them in LONG_MODULES: {too_long}"
    short = sorted(n for n in LONG_MODULES if lines.get(n, 0) <= MODULE_LINES)
    assert not short, f"no longer long (or gone), remove from LONG_MODULES: {short}"


def test_fixed_sub_patterns_use_torch_pattern_matcher():
    """The attention spine, repeat_kv and the linear/LoRA heads are torch pattern-matcher patterns (issue 22.1):
    their matcher modules build on torch._inductor.pattern_matcher (through effpass.patterns)."""
    from torch._inductor import pattern_matcher as pm

    from effpass.passes.fuse_attention import kv as _attention_kv, matching as _attention_match
    from effpass.passes.fuse_cross_entropy import matching as _fuse_ce_match

    for mod in (_attention_kv, _attention_match, _fuse_ce_match):
        assert _imports(mod.__name__, pathlib.Path(mod.__file__), {"effpass.patterns"}) >= {"effpass.patterns"}
    heads = (*_fuse_ce_match.LORA_HEAD, _fuse_ce_match.LOW_RANK, _fuse_ce_match.PROJECTION, *_attention_match.SPINE,
             *_attention_match.QK_ROOTS)
    assert all(isinstance(p, pm.PatternExpr) for p in heads)


# ------------------------------------------------------------------------------------------------------
# configuration is data, read in one place (issue 35.4)
# ------------------------------------------------------------------------------------------------------
#: what touches the process environment: ``os.<name>`` or ``from os import <name>``
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
#: modules of effpass/ or passes/ besides effpass/config.py that may touch ``os.environ``, with the reason
ENV_ALLOWED = {
    "effpass/cli/demo.py": "builds each arm's child-process environment ({**os.environ, ...}); reads no setting",
}


def environ_uses(path: pathlib.Path) -> list[str]:
    """Where a module touches the process environment (``os.environ``, ``os.getenv``, ... through any alias of
    ``os``, or a name imported from ``os``), as ``"line: code"`` in line order."""
    src = path.read_text()
    tree = ast.parse(src)
    os_names = {"os"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                         for a in n.names if a.name == "os" and a.asname}
    hits = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ENV_NAMES and isinstance(node.value, ast.Name)
                and node.value.id in os_names) or (
                isinstance(node, ast.ImportFrom) and node.module == "os" and {a.name for a in node.names} & ENV_NAMES):
            hits.append((node.lineno, f"{node.lineno}: {ast.get_source_segment(src, node)}"))
    return [h for _, h in sorted(hits)]


def test_environment_is_read_in_config_only():
    """Every environment variable is read in effpass/config.py (``ENV_VARS`` lists it, a function there reads it);
    no other module of effpass/ or passes/ touches os.environ unless named in ENV_ALLOWED with the reason."""
    repo = ROOT.parent
    found = {}
    for base in (ROOT, PASSES):
        for p in sorted(base.rglob("*.py")):
            rel = p.relative_to(repo).as_posix()
            if rel != "effpass/config.py" and environ_uses(p):
                found[rel] = environ_uses(p)
    bad = {k: v for k, v in found.items() if k not in ENV_ALLOWED}
    assert not bad, f"read environment variables in effpass/config.py (ENV_VARS and a function there), not in: {bad}"
    stale = sorted(set(ENV_ALLOWED) - set(found))
    assert not stale, f"no longer touch os.environ (or gone), remove from ENV_ALLOWED: {stale}"
    assert environ_uses(ROOT / "config.py"), "config.py reads the environment: the walker must see it"


def test_every_environment_variable_is_listed():
    """Each EFFPASS_* name the code of effpass/ or passes/ spells (a whole string constant) is in ENV_VARS with
    what it does."""
    import re

    from effpass.config import ENV_VARS

    named = set()
    for base in (ROOT, PASSES):
        for p in base.rglob("*.py"):
            named |= {n.value for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant)
                      and isinstance(n.value, str) and re.fullmatch(r"EFFPASS_[A-Z0-9_]+", n.value)}
    assert {"EFFPASS_BISECT", "EFFPASS_PROGRESS", "EFFPASS_ROWWISE_COMPILE"} <= named
    missing = sorted(named - set(ENV_VARS))
    assert not missing, f"environment variables read but not in effpass.config.ENV_VARS: {missing}"
    assert all(doc.strip() for doc in ENV_VARS.values()), ENV_VARS


def test_environ_detector_can_fail(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os as o\nfrom os import getenv\nx = o.environ.get('A')\nimport os\n"
                 "y = {**os.environ}\nz = os.path.join('a')\nenviron = {}\n")
    assert [h.split(":")[0] for h in environ_uses(f)] == ["2", "3", "5"]


def undocumented_fields(cls) -> list[str]:
    """The fields of a dataclass of options without a doc (``field(metadata={"doc": ...})``)."""
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if not str(f.metadata.get("doc", "")).strip()]


def test_every_option_is_documented_on_its_field():
    """effpass's options and every registered pass's options carry their doc on the field; the tables that list
    options (OPTION_DOCS, the keys parse_options accepts) are read from the fields."""
    import dataclasses

    from effpass.config import OPTION_DOCS, Options, option_docs
    from effpass.pass_api import registered_passes

    assert not undocumented_fields(Options), f"effpass.config.Options fields without a doc: {undocumented_fields(Options)}"
    # the built-in passes and installed plugins; passes that other tests in this worker register are theirs to
    # document (the registry is per process, so which of them are present depends on test order under xdist)
    import sys

    from _paths import ROOT

    def in_tests(k):
        f = getattr(sys.modules.get(k.__module__), "__file__", None) or ""
        return str(f).startswith(str(pathlib.Path(ROOT) / "tests"))

    shipped = {n: k for n, k in registered_passes().items() if not in_tests(k)}
    assert {"fuse_attention", "inject_lora", "checkpoint_activations"} <= set(shipped)
    bad = {n: undocumented_fields(k) for n, k in shipped.items() if undocumented_fields(k)}
    assert not bad, f"pass options without a doc (field(metadata={{'doc': ...}})): {bad}"
    assert dict(OPTION_DOCS) == option_docs()
    assert set(option_docs(keys_only=False)) == {f.name for f in dataclasses.fields(Options)}
    assert {"passes", "lowering", "memory_budget"} <= set(OPTION_DOCS) and "default_pipeline" not in OPTION_DOCS


def test_option_doc_detector_can_fail():
    import dataclasses

    @dataclasses.dataclass
    class Planted:
        documented: int = dataclasses.field(default=0, metadata={"doc": "a number"})
        bare: int = 0
        blank: str = dataclasses.field(default="", metadata={"doc": " "})

    assert undocumented_fields(Planted) == ["bare", "blank"]


# ------------------------------------------------------------------------------------------------------
# passes talk through declared contracts only (issue 35.2): facts, effpass.scope's globs, public methods
# ------------------------------------------------------------------------------------------------------
def by_name_lookups(source: str, pass_names: set[str]) -> list[str]:
    """Places where code looks up another pass by its name: ``find_pass("x")`` with a string literal, or a
    comparison of some ``.name`` with a registered pass name (``p.name == "fuse_cross_entropy"``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            args = [*node.args, *(k.value for k in node.keywords)]
            if name == "find_pass" and any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in args):
                out.append((node.lineno, f"line {node.lineno}: find_pass({ast.unparse(args[0])})"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
            consts = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            consts += [e.value for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                       for e in s.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if named and set(consts) & pass_names:
                out.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(out)]


def test_passes_read_each_other_through_facts_only():
    """A pass reads another pass's choice (the autocast dtype, whether the loss is scaled) through a fact
    (``ctx.fact(MixedPrecision)``, :mod:`effpass.facts`), never by the other pass's name: no ``find_pass`` with
    a literal and no comparison with a pass's name anywhere under passes/ (the core may use ``find_pass``)."""
    names = set(pass_packages())
    bad = [f"{p.relative_to(ROOT.parent)} {hit}" for p in sorted(PASSES.rglob("*.py"))
           for hit in by_name_lookups(p.read_text(), names)]
    assert not bad, f"passes look each other up by name (declare and read an effpass.facts.Fact instead): {bad}"


def test_by_name_detector_can_fail():
    src = ("def f(ctx, mgr):\n"
           "    a = ctx.find_pass('apply_autocast')\n"
           "    b = find_pass(name='scale_loss')\n"
           "    c = any(p.name == 'fuse_cross_entropy' for p in mgr.active)\n"
           "    d = [p for p in mgr.active if p.name in ('wrap_fsdp',)]\n"
           "    e = ctx.find_pass(other)\n"
           "    return n.name == 'ge'\n")
    hits = by_name_lookups(src, {"apply_autocast", "scale_loss", "fuse_cross_entropy", "wrap_fsdp"})
    assert [h.split(":")[0] for h in hits] == ["line 2", "line 3", "line 4", "line 5"], hits


def fnmatch_imports(source: str) -> list[int]:
    """Lines importing ``fnmatch`` (``import fnmatch``, ``from fnmatch import ...``) at any depth."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "fnmatch" for a in node.names):
            out.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fnmatch" and not node.level:
            out.append(node.lineno)
    return sorted(out)


def test_glob_matching_only_through_effpass_scope():
    """One glob language for every pass: ``effpass.scope`` (``glob_match``, ``glob_match_within``, ``Scope``)
    is the only module of effpass/ or passes/ that imports fnmatch."""
    allowed = {ROOT / "scope.py"}
    bad = [f"{p.relative_to(ROOT.parent)}:{line}" for base in (ROOT, PASSES) for p in sorted(base.rglob("*.py"))
           if p not in allowed for line in fnmatch_imports(p.read_text())]
    assert not bad, f"fnmatch imported outside effpass/scope.py (use effpass.scope.glob_match/glob_match_within): {bad}"


def test_fnmatch_detector_can_fail():
    assert fnmatch_imports("import fnmatch\ndef f():\n    from fnmatch import fnmatchcase\nimport os\n") == [1, 3]
    assert fnmatch_imports("from .fnmatch import x\nimport os.path\n") == []


def pass_classes(init_source: str) -> dict[str, set[str]]:
    """The classes a pass package's ``__init__`` registers (decorated with ``register_pass``), each with the
    names of its private methods and attributes (one leading underscore)."""
    out = {}
    for node in ast.walk(ast.parse(init_source)):
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(isinstance(d, ast.Call) and (getattr(d.func, "attr", None) or getattr(d.func, "id", None))
                   == "register_pass" for d in node.decorator_list):
            continue
        private = set()
        for item in node.body:
            targets = [item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else [
                t.id for t in getattr(item, "targets", [getattr(item, "target", None)]) if isinstance(t, ast.Name)]
            private |= {n for n in targets if n.startswith("_") and not n.startswith("__")}
        out[node.name] = private
    return out


def private_uses(source: str, classes: dict[str, set[str]]) -> list[str]:
    """Uses, in a helper module, of a pass class's private members: ``Pass._x`` on the class's name, or
    ``obj._m`` where ``_m`` is a private member of the pass class and ``obj`` is not ``self``/``cls`` (a pass
    instance handed to the helper, ``fce._check_head(site)``)."""
    private = set().union(*classes.values()) if classes else set()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        recv = node.value
        on_class = isinstance(recv, ast.Name) and recv.id in classes
        on_instance = node.attr in private and not (isinstance(recv, ast.Name) and recv.id in ("self", "cls"))
        if on_class or on_instance:
            out.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(out)]


def test_helpers_never_use_a_pass_class_private_members():
    """A pass package's private modules call the pass through public methods (or the pass calls them with
    what they need): no ``fce._check_head(...)`` on a pass handed to a helper, no ``Pass._x`` on the class."""
    bad = []
    for name in pass_packages():
        pkg = PASSES / name
        classes = pass_classes((pkg / "__init__.py").read_text())
        assert classes, f"passes/{name}/__init__.py: no registered pass class found"
        for sub in sorted(pkg.rglob("*.py")):
            if sub.name != "__init__.py":
                bad += [f"{sub.relative_to(ROOT.parent)} {hit}" for hit in private_uses(sub.read_text(), classes)]
    assert not bad, f"helpers use a pass class's private members (make them public or plain functions): {bad}"


def test_private_use_detector_can_fail():
    init = ("@effpass.register_pass('fuse_x')\n@dataclass\nclass FuseX(effpass.Pass):\n"
            "    _cache = {}\n    def _check(self): ...\n    def run(self): ...\n    def __repr__(self): ...\n")
    classes = pass_classes(init)
    assert classes == {"FuseX": {"_cache", "_check"}}
    helper = ("def rewrite(fce, site):\n"
              "    fce._check(site)\n"
              "    FuseX._other(site)\n"
              "    x = fce._cache\n"
              "    fce.run(); self._check(); site._check_other(); FuseX.__name__\n")
    assert [h.split(":")[0] for h in private_uses(helper, classes)] == ["line 2", "line 3", "line 4"]
