"""The docs hold together: every relative link in README.md, docs/*.md and docs/passes/*.md points at a file
(and a heading, for ``#anchor`` links into Markdown) that exists; every pass package under ``passes/`` has its
page ``docs/passes/<name>.md``; each page's "At a glance" block states the pass's ``run_after`` and
``conflicts_with`` exactly as ``register_pass`` declares them and names the phases its hooks act in, and its
options tables name every option field.

Reads files only (no torch, no effpass import: the pass sources are parsed with ``ast``), so it runs in well
under a second. ``python tests/tools/test_docs_links.py`` prints every problem without pytest.
"""
from __future__ import annotations

import ast
import glob
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _paths import ROOT  # noqa: E402  (the repository's root)

#: inline links and images: [text](target) / ![alt](target), target up to the first space or ")"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML = re.compile(r"""<(?:img|a)\s[^>]*?(?:src|href)=["']([^"']+)["']""", re.I)
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def doc_files() -> list[str]:
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "passes", "*.md")))
    return files


def _prose_lines(text: str):
    """(line number, line with code spans blanked) outside fenced code blocks."""
    fence = None
    for i, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            yield i, _CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)


def links(path: str) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for i, line in _prose_lines(text):
        out += [(i, m.group(1)) for m in _LINK.finditer(line)]
        out += [(i, m.group(1)) for m in _HTML.finditer(line)]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"<[^>]+>", "", heading.strip()).lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(text.replace("`", "")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    out |= set(re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", text))
    return out


def broken_links() -> list[str]:
    problems = []
    for path in doc_files():
        rel = os.path.relpath(path, ROOT)
        for line, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else os.path.normpath(os.path.join(os.path.dirname(path), file_part))
            if not os.path.exists(dest):
                problems.append(f"{rel}:{line}: link to {target!r}: {os.path.relpath(dest, ROOT)} does not exist")
            elif anchor and dest.endswith(".md") and anchor.lower() not in anchors(dest):
                problems.append(f"{rel}:{line}: link to {target!r}: no heading with anchor #{anchor} in "
                                f"{os.path.relpath(dest, ROOT)}")
    return problems


_TEST_REF = re.compile(r"(?<![\w/.-])(tests/[\w/]+\.py)(?:::(\w+))?")


def stale_test_references() -> list[str]:
    """``tests/<path>.py`` and ``tests/<path>.py::test_name`` named in the docs (links or not) that do not exist
    (tests moved into folders by area: a reference to the old place is stale)."""
    problems = []
    for path in doc_files():
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines, 1):
            for m in _TEST_REF.finditer(line):
                file, fn = m.groups()
                src = os.path.join(ROOT, file)
                if not os.path.exists(src):
                    problems.append(f"{os.path.relpath(path, ROOT)}:{i}: {file} does not exist")
                elif fn and not re.search(rf"^\s*def {fn}\b", open(src, encoding="utf-8").read(), re.M):
                    problems.append(f"{os.path.relpath(path, ROOT)}:{i}: {file} defines no {fn}")
    return problems


# ------------------------------------------------------------------------------------------------------
# pass pages
# ------------------------------------------------------------------------------------------------------
def pass_packages() -> list[str]:
    return sorted(d for d in os.listdir(os.path.join(ROOT, "passes"))
                  if os.path.isfile(os.path.join(ROOT, "passes", d, "__init__.py")))


def _literal_names(node) -> tuple[str, ...]:
    return tuple(ast.literal_eval(node)) if node is not None else ()


#: effpass.pass_api.PHASE_HOOKS, restated (this test imports neither torch nor effpass)
_PHASE_HOOKS = {"prepare_module": "module", "transform_torch_ir": "torch_ir", "transform_joint": "joint",
                "transform_post_grad": "post_grad"}


def declared(name: str) -> dict:
    """What ``passes/<name>/__init__.py`` declares for the pass registered as ``name``: run_after,
    conflicts_with (from the ``register_pass`` call) and the option fields (annotated class attributes)."""
    src = os.path.join(ROOT, "passes", name, "__init__.py")
    with open(src, encoding="utf-8") as f:
        tree = ast.parse(f.read(), src)
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for dec in cls.decorator_list:
            if (isinstance(dec, ast.Call) and getattr(dec.func, "attr", getattr(dec.func, "id", "")) == "register_pass"
                    and dec.args and isinstance(dec.args[0], ast.Constant) and dec.args[0].value == name):
                kw = {k.arg: k.value for k in dec.keywords}
                fields = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)
                          and isinstance(s.target, ast.Name) and not s.target.id.startswith("_")
                          and "ClassVar" not in ast.unparse(s.annotation)]
                hooks = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
                return {"phases": tuple(ph for hook, ph in _PHASE_HOOKS.items() if hook in hooks),
                        "run_after": _literal_names(kw.get("run_after")),
                        "conflicts_with": _literal_names(kw.get("conflicts_with")),
                        "options": fields + ["targets", "exclude"]}
    raise AssertionError(f"{os.path.relpath(src, ROOT)}: no class registered with register_pass({name!r})")


def _glance_row(text: str, label: str) -> str | None:
    m = re.search(rf"^\|\s*{re.escape(label)}\s*\|(.*)\|\s*$", text, re.M | re.I)
    return m.group(1) if m else None


def page_problems(name: str) -> list[str]:
    page = os.path.join(ROOT, "docs", "passes", f"{name}.md")
    rel = os.path.relpath(page, ROOT)
    if not os.path.exists(page):
        return [f"passes/{name}/ has no page {rel}"]
    with open(page, encoding="utf-8") as f:
        text = f.read()
    decl = declared(name)
    problems = []
    for label, key in (("runs after", "run_after"), ("conflicts with", "conflicts_with")):
        row = _glance_row(text, label)
        if row is None:
            problems.append(f"{rel}: the 'At a glance' table has no '| {label} |' row")
            continue
        # the row names the passes only (`a`, `b`; '-' for none); the reasons are in the page's text
        stated = set(re.findall(r"`([a-z][a-z0-9_]*)`", row))
        if set(decl[key]) != stated:
            problems.append(f"{rel}: '{label}' states {sorted(stated)}, register_pass({name!r}) declares "
                            f"{sorted(decl[key])}")
    # an options table: a row whose first cell names the option (`targets` / `exclude` may share one row)
    first_cells = "\n".join(m.group(1) for m in re.finditer(r"^\|([^|\n]*)\|", text, re.M))
    missing = [o for o in decl["options"] if f"`{o}`" not in first_cells]
    if missing:
        problems.append(f"{rel}: options without a row of their own in an options table: {missing}")
    row = _glance_row(text, "phases")
    stated = set(re.findall(r"`([a-z_]+)`", row or ""))
    if row is not None and not set(decl["phases"]) <= stated:
        problems.append(f"{rel}: 'phases' does not name {sorted(set(decl['phases']) - stated)}, which the pass's "
                        f"hooks act in")
    for label in ("phases", "statistics", "tests"):
        if _glance_row(text, label) is None:
            problems.append(f"{rel}: the 'At a glance' table has no '| {label} |' row")
    if f"tests/passes/{name}/" not in text:
        problems.append(f"{rel}: does not name its tests folder tests/passes/{name}/")
    return problems


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Overrides conftest's autouse fixture of this name: these tests read files and need no Dynamo reset (whose
    first call imports torch._dynamo, ~15 s on the shared 2-core machine)."""
    yield


def test_relative_links_resolve():
    problems = broken_links()
    assert not problems, "broken relative links:\n" + "\n".join(problems)


def test_named_tests_exist():
    problems = stale_test_references()
    assert not problems, "\n".join(problems)


def test_every_pass_package_has_its_page_with_declared_facts():
    names = pass_packages()
    assert len(names) >= 14, names  # the oracle can fail: the built-in passes are found
    problems = [p for n in names for p in page_problems(n)]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_it_should(tmp_path):
    """The checks can fail: a missing file, a missing anchor and a stale run_after row are reported."""
    md = tmp_path / "a.md"
    md.write_text("# Title here\n[ok](a.md#title-here) [bad](missing.md) [anchor](a.md#nope) `[code](x.md)`\n"
                  "```\n[fenced](y.md)\n```\n")
    found = [t for _, t in links(str(md))]
    assert found == ["a.md#title-here", "missing.md", "a.md#nope"]
    assert anchors(str(md)) == {"title-here"}
    assert slug("`tile_sequence`: tiles, and more (v2)") == "tile_sequence-tiles-and-more-v2"
    assert [m.groups() for m in _TEST_REF.finditer("see tests/passes/x/test_x.py::test_y and tests/core/")] == [
        ("tests/passes/x/test_x.py", "test_y")]
    assert _glance_row("| Runs after | `a`, `b` |\n", "runs after").split() == ["`a`,", "`b`"]


if __name__ == "__main__":
    for p in broken_links() + stale_test_references() + [p for n in pass_packages() for p in page_problems(n)]:
        print(p)
