"""Compare two recordings of bench/behaviour_record.py (a pytest plugin): per test, the pass statistics and skip
reasons, and the losses and gradients (bit for bit).

    python bench/behaviour_compare.py BEFORE.json AFTER.json
"""
import json, sys
if len(sys.argv) != 3:
    raise SystemExit("usage: python bench/behaviour_compare.py BEFORE.json AFTER.json")
_b, _a = sys.argv[1:3]
b = json.load(open(_b)); a = json.load(open(_a))
common = [k for k in a if k in b]
print("before", len(b), "after", len(a), "common", len(common))
def norm_stats(st):
    out = []
    for name, phase, graph, stats, skipped, fb in st:
        stats = {k: v for k, v in stats.items() if k != "flash_attn"}
        out.append((name, phase, graph, json.dumps(stats, sort_keys=True), json.dumps(skipped), fb))
    return out
same_stats = same_num = 0
for k in common:
    sa, sb = norm_stats(a[k]["stats"]), norm_stats(b[k]["stats"])
    if sa == sb: same_stats += 1
    else:
        print("STATS DIFF", k)
        for x, y in zip(sb, sa):
            if x != y: print("  before", x[:4], "\n  after ", y[:4]); break
        if len(sa) != len(sb): print("  records", len(sb), len(sa))
    if a[k]["loss"] == b[k]["loss"] and a[k]["grads"] == b[k]["grads"]: same_num += 1
    else:
        dl = max([abs(x - y) for x, y in zip(a[k]["loss"], b[k]["loss"])] or [0])
        print("NUM DIFF", k, "max loss diff", dl, len(a[k]["loss"]), len(b[k]["loss"]))
print("same stats", same_stats, "/", len(common), " identical loss+grads", same_num, "/", len(common))
