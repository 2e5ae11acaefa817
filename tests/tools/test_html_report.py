"""The HTML report (``effpass inspect DUMP --html``, ``effpass.report(model).to_html``), checked in a real
headless Chromium: the page loads with no console output at all (no errors, no logs), its script ran, it
shows every pass that ran, and the numbers it carries equal ``effpass inspect DUMP --json``. Bad dumps
(missing, empty, another version, half-written) give a page that says what is wrong and shows the rest.

Chromium is Debian's ``chromium`` package; ``scripts/dev.sh test`` installs it when missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from html.parser import HTMLParser

import pytest
import torch

import effpass
from effpass.cli import main as cli_main
from effpass.inspect import load_dump, to_json
from effpass.testing import model_case

from _browser import chromium, load_in_chromium, needs_chromium  # noqa: E402,F401  (chromium: the fixture)


class _Rows(HTMLParser):
    """Collects the attributes of every element with a given class, and element text by id."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.pipeline: list[str] = []
        self.ids: dict[str, str] = {}
        self._id = None
        self.root: dict[str, str] = {}
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "html":
            self.root = a
        classes = (a.get("class") or "").split()
        if "pass-row" in classes:
            self.rows.append(a)
        if "pipeline-pass" in classes:
            self.pipeline.append(a["data-pass"])
        if a.get("id", "").startswith("n-"):
            self._id = a["id"]
        for k in ("src", "href"):
            if a.get(k):
                self.links.append(a[k])

    def handle_data(self, data):
        if self._id:
            self.ids[self._id] = self.ids.get(self._id, "") + data

    def handle_endtag(self, tag):
        if tag == "span":
            self._id = None


def _parse(dom: str) -> _Rows:
    p = _Rows()
    p.feed(dom)
    return p


class _Broken(torch.nn.Module):
    """Two linears with a graph break between them: two graphs."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(y)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """A dump of two compiles: a Hugging Face Llama (fuse_attention + checkpoint_activations, forward
    and backward) and a module with a graph break (two graphs)."""
    d = str(tmp_path_factory.mktemp("dump"))
    torch._dynamo.reset()
    reports = []
    for name in ("llama",):
        case = model_case(name)
        m = effpass.compile(case.model, passes=["fuse_attention", "checkpoint_activations"], lowering="eager",
                            dump_dir=d)
        out = m(**case.inputs)
        (out[0] if isinstance(out, tuple) else out.loss).backward()
        reports.append(effpass.report(m))
    m = effpass.compile(_Broken(), passes=["checkpoint_activations"], lowering="eager", dump_dir=d)
    m(torch.randn(2, 8, requires_grad=True)).sum().backward()
    reports.append(effpass.report(m))
    return d, reports


def _page_rows_equal_json(rows: list[dict[str, str]], graphs: list[dict]) -> None:
    records = [(g["_name"], r) for g in graphs for r in g["passes"]]
    assert len(rows) == len(records)
    for row, (gname, r) in zip(rows, records):
        assert json.loads(row["data-graph"]) == gname
        assert json.loads(row["data-pass"]) == r["name"]
        assert json.loads(row["data-phase"]) == r["phase"]
        assert json.loads(row["data-kind"]) == r["graph"]
        assert json.loads(row["data-changed"]) == r["changed"]
        assert json.loads(row["data-ms"]) == r["ms"]
        assert json.loads(row["data-nodes-before"]) == r["nodes_before"]
        assert json.loads(row["data-nodes-after"]) == r["nodes_after"]
        assert json.loads(row["data-skipped"]) == len(r["skipped"])
        assert json.loads(row["data-stats"]) == r["stats"]


@needs_chromium
def test_page_from_dump_loads_clean_and_equals_inspect_json(dump, tmp_path, capsys):
    d, _ = dump
    out = str(tmp_path / "report.html")
    assert cli_main(["inspect", d, "--html", out]) == 0
    capsys.readouterr()
    assert cli_main(["inspect", d, "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    graphs = load_dump(d)
    assert json.loads(to_json(graphs)) == as_json

    dom, console = load_in_chromium(out)
    assert console == [], console
    page = _parse(dom)
    n_records = sum(len(g["passes"]) for g in as_json)
    assert page.root.get("data-effpass-ready") == str(n_records)  # the page's script ran to its end
    _page_rows_equal_json(page.rows, graphs)
    ran = {r["name"] for g in as_json for r in g["passes"]}
    assert ran == {"fuse_attention", "checkpoint_activations"}
    assert ran <= {json.loads(r["data-pass"]) for r in page.rows}
    assert set(page.pipeline) >= {"fuse_attention", "checkpoint_activations"}
    # graphs, breaks: llama (1 graph), the broken module (2 graphs, >= 1 break)
    assert int(page.ids["n-graphs"]) == len([g for g in as_json if g["graph_id"] != "module"]) == 3
    assert int(page.ids["n-breaks"]) >= 1
    assert int(page.ids["n-recompiles"]) == 0
    # the saved-for-backward numbers shown are checkpoint_activations' own
    ck = [r for g in as_json for r in g["passes"] if r["name"] == "checkpoint_activations" and r["graph"] == "joint"]
    assert len(ck) == 3 and ck[0]["stats"]["saved_bytes_after"] < ck[0]["stats"]["saved_bytes_before"]
    # self-contained: no resource is loaded from anywhere (the only URL is the SVG namespace)
    assert page.links == []
    text = open(out).read()
    assert not re.search(r"<link|<img|<iframe|@import|url\(|\bsrc=", text)  # (graph-break reasons quote URLs as text)
    assert text.count("<svg") >= 2 and 'class="diff"' in text  # charts and per-pass diffs


@needs_chromium
def test_page_opens_with_memory_and_time_and_fits_1280_px(dump, tmp_path):
    """What a user asks first comes first: per graph and for the step, saved activations and peaks (predicted,
    said so), FLOPs, an estimated time and the compile time (measured); no column wider than a 1,280 px window
    (the page measures its own width); the header counts the graphs the body shows."""
    d, _ = dump
    out = str(tmp_path / "report.html")
    assert cli_main(["inspect", d, "--html", out]) == 0
    shot = str(tmp_path / "first_screen.png")
    dom, console = load_in_chromium(out, window=(1280, 900), screenshot=shot)
    assert console == [], console
    page = _parse(dom)
    assert page.root.get("data-effpass-fits") == "yes", page.root.get("data-effpass-fits")
    assert dom.index("Memory and time") < dom.index("Pipeline and options") < dom.index("Passes per graph")
    assert "predicted" in dom and "measured" in dom and "roofline estimate" in dom
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # the saved-for-backward figure of each graph is what checkpoint_activations measured on that backward graph
    graphs = [g for g in load_dump(d) if g["_name"] != "module"]
    figs = dict(re.findall(r'class="fig-row" data-graph="([^"]+)" data-flops="\d+" data-saved="(\d+)"', dom))
    assert len(figs) == len(graphs) == int(page.ids["n-graphs-head"]) == int(page.ids["n-graphs"]) == 3
    for g in graphs:
        measured = [r["stats"]["saved_bytes_measured"] for r in g["passes"]
                    if r["name"] == "checkpoint_activations" and "saved_bytes_measured" in r["stats"]]
        assert measured and int(figs[g["_name"]]) == measured[0] == g["figures"]["backward"]["saved_bytes"]


@needs_chromium
def test_width_check_can_fail(dump, tmp_path):
    d, _ = dump
    out = str(tmp_path / "report.html")
    assert cli_main(["inspect", d, "--html", out]) == 0
    text = open(out).read().replace("<h1>", '<div style="width:3000px;height:2px"></div><h1>', 1)
    with open(out, "w") as f:
        f.write(text)
    dom, console = load_in_chromium(out, window=(1280, 900))
    assert console == [] and _parse(dom).root.get("data-effpass-fits", "").startswith("no:")


@needs_chromium
def test_console_check_can_fail(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('boom')</script></body></html>")
    _, console = load_in_chromium(str(bad))
    assert any("boom" in line for line in console)


@needs_chromium
def test_report_to_html_from_python(dump, tmp_path):
    _, reports = dump
    path = str(tmp_path / "live.html")
    assert reports[0].to_html(path) == path
    dom, console = load_in_chromium(path)
    assert console == []
    rows = _parse(dom).rows
    recs = reports[0].records()
    assert [json.loads(r["data-pass"]) for r in rows] == [r.name for r in recs]
    assert [json.loads(r["data-ms"]) for r in rows] == [r.ms for r in recs]
    assert [json.loads(r["data-stats"]) for r in rows] == [r.current_stats() for r in recs]  # live ones too
    assert 'class="diff"' in open(path).read()  # the live report had a dump: diffs shown


def _copy(d: str, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(d, dst)
    return dst


@needs_chromium
def test_half_written_and_foreign_dump_says_what_is_wrong_and_shows_the_rest(dump, tmp_path, capsys):
    src, _ = dump
    d = _copy(src, tmp_path)
    names = sorted(n for n in os.listdir(d) if n.startswith("graph_"))
    # 1: crash mid-write: a temporary file left, and a truncated index
    open(os.path.join(d, names[0], ".tmp-xyzindex.json"), "w").write('{"graph_id": ')
    open(os.path.join(d, names[1], "index.json"), "w").write('{"graph_id": "x", "passes": [')
    # 2: another effpass version (graph 2), a compile that did not finish: no timing (graph 0)
    p = os.path.join(d, names[2], "index.json")
    idx = json.load(open(p))
    idx["effpass_version"] = "9.9.9"
    json.dump(idx, open(p, "w"))
    p = os.path.join(d, names[0], "index.json")
    idx = json.load(open(p))
    del idx["timing"]
    json.dump(idx, open(p, "w"))
    # 3: a graph folder with files but no index
    os.makedirs(os.path.join(d, "graph_099"))
    open(os.path.join(d, "graph_099", "00_input_torch_ir.py"), "w").write("# graph\n")

    out = str(tmp_path / "r.html")
    assert cli_main(["inspect", d, "--html", out]) == 0
    err = capsys.readouterr().err
    for needle in ("half-written", f"{names[1]}/index.json cannot be read", "written by effpass 9.9.9",
                   "did not finish", "graph_099: graph files but no index.json"):
        assert needle in err
    dom, console = load_in_chromium(out)
    assert console == []
    page = _parse(dom)
    good = [g for g in load_dump(src) if g["_name"] != names[1]]
    assert len(page.rows) == sum(len(g["passes"]) for g in good)
    assert 'id="problems"' in dom and "9.9.9" in dom


@pytest.mark.parametrize("kind", ["missing", "empty", "not_a_dump"])
def test_missing_or_empty_dump(kind, tmp_path, capsys):
    d = tmp_path / "d"
    if kind != "missing":
        d.mkdir()
    if kind == "not_a_dump":
        (d / "notes.txt").write_text("hello")
    out = tmp_path / "r.html"
    assert cli_main(["inspect", str(d), "--html", str(out)]) == 1
    err = capsys.readouterr().err
    assert ("does not exist" if kind == "missing" else "no effpass dump") in err
    text = out.read_text()
    assert 'id="problems"' in text and ("does not exist" in text or "no effpass dump" in text)
    assert "it is empty" in text if kind == "empty" else True


def test_memory_plan_hook_is_rendered(dump, tmp_path):
    """A memory planner's ``memory_plan`` entry in index.json is shown on the page (the documented hook)."""
    src, _ = dump
    d = _copy(src, tmp_path)
    p = os.path.join(d, "graph_000", "index.json")
    idx = json.load(open(p))
    idx["memory_plan"] = {"peak_bytes": 123456789, "rows": [{"layer": "model.layers.0", "saved_bytes": 4242},
                                                            {"layer": "model.layers.1", "saved_bytes": 4343}]}
    json.dump(idx, open(p, "w"))
    out = str(tmp_path / "r.html")
    assert cli_main(["inspect", d, "--html", out]) == 0
    text = open(out).read()
    assert 'class="memory-plan"' in text and "model.layers.1" in text and "4,343" in text
    assert "123,456,789" in text
    # without the entry the page says there is none
    shutil.rmtree(d)
    out2 = str(tmp_path / "r2.html")
    cli_main(["inspect", src, "--html", out2])
    assert 'class="memory-plan"' not in open(out2).read()
