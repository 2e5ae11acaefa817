import json, glob, sys
def load(tags):
    out = {}
    for t in tags:
        for f in sorted(glob.glob(f"/tmp/arch2_rec/{t}_*.json")):
            try:
                d = json.load(open(f))
            except Exception as e:
                print("unreadable", f, e); continue
            for k, v in d.items():
                if k in out: print("dup", k, f)
                out.setdefault(k, v)
    return out
b = load(["before", "before2"]); a = load(["after", "after2", "after3"])
json.dump(b, open("/work/wt/arch2/bench/results/issue22_behaviour/before_arch2.json", "w"), indent=0, sort_keys=True)
json.dump(a, open("/work/wt/arch2/bench/results/issue22_behaviour/after_arch2.json", "w"), indent=0, sort_keys=True)
print("before", len(b), "after", len(a))
