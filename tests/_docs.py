"""The statistics a pass's docs page defines (docs/passes/<name>.md names each in backticks, or in a
`prefix_a/b/c` group): the oracle of "every statistic a pass reports is defined" (issue 38.2), shared by the
docs test's one-process pipelines and the distributed tests, whose passes report only inside ranks."""
import os
import re

from _paths import ROOT


def documented_statistics(name: str) -> set[str]:
    with open(os.path.join(ROOT, "docs", "passes", f"{name}.md")) as fh:
        doc = fh.read()
    names = set(re.findall(r"`([a-z][a-z0-9_]*)`", doc))
    for prefix, group in re.findall(r"`([a-z][a-z0-9_]*_)([a-z0-9]+(?:/[a-z0-9]+)+)`", doc):
        names |= {prefix + g for g in group.split("/")}
    return names


def undocumented_statistics(name: str, reported) -> list[str]:
    """The reported statistic names that docs/passes/<name>.md does not define (empty: all defined)."""
    return sorted(set(reported) - documented_statistics(name))


def glance_statistics(name: str) -> set[str]:
    """The statistic names in the 'At a glance' table's ``statistics`` row of docs/passes/<name>.md (a
    `prefix_a/b/c` group stands for prefix_a, prefix_b, prefix_c; links to sections are not names)."""
    with open(os.path.join(ROOT, "docs", "passes", f"{name}.md")) as fh:
        row = next(line for line in fh.read().splitlines() if line.startswith("| statistics |"))
    cell = re.sub(r"\(\[.*?\]\(.*?\)\)", "", row.split("|")[2])
    names = set()
    for tok in re.findall(r"`([a-z][a-z0-9_/]*)`", cell):
        head, *rest = tok.split("/")
        names |= {head} | {head.rsplit("_", 1)[0] + "_" + r for r in rest}
    return names - {"ulysses", "ring"}   # values of shard_sequence's `attention`, not statistics
