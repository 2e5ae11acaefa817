"""Write the README's demo sample from a real run's results: ``effpass demo --json bench/results/demo_cpu.json``,
then ``python scripts/demo_readme.py``. tests/tools/test_readme.py fails when the README block is not what
``effpass.cli.demo.render`` makes of that file (a stale format or fields)."""
import json
import os
import re
import sys

from effpass.cli.demo import render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "demo_cpu.json")
BLOCK = re.compile(r"(<!-- demo:begin[^\n]*-->\n)(.*?)(<!-- demo:end -->)", re.S)


def block(results_path: str = RESULTS) -> str:
    with open(results_path) as fh:
        return "```\n" + render(json.load(fh)) + "\n```\n"


def main() -> int:
    path = os.path.join(ROOT, "README.md")
    text = open(path).read()
    if not BLOCK.search(text):
        sys.exit("scripts/demo_readme.py: README.md has no <!-- demo:begin --> ... <!-- demo:end --> block")
    with open(path, "w") as fh:
        fh.write(BLOCK.sub(lambda m: m.group(1) + block() + m.group(3), text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
