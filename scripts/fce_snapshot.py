"""Snapshot of fuse_cross_entropy's statistics and numerics on the family suite (issue 22: behaviour
unchanged). Usage: python scripts/fce_snapshot.py OUT.json; compare two snapshots with --compare A B."""
import json, sys
import torch

sys.path.insert(0, "tests")


def run(out_path):
    import effpass
    from effpass.passes import FuseCrossEntropy, InjectLoRA, QuantizeLinear
    from _families import FAMILIES, family_case
    res = {}
    for fam in FAMILIES:
        for arm, passes in (("plain", lambda: [FuseCrossEntropy()]),
                            ("lora_head", lambda: [InjectLoRA(rank=4, init="gaussian", targets=["lm_head"]),
                                                   FuseCrossEntropy()]),
                            ("int8", lambda: [QuantizeLinear(scheme="int8"), FuseCrossEntropy()])):
            key = f"{fam}/{arm}"
            try:
                case = family_case(fam)
                model = case.model.train()
                torch.manual_seed(0)
                compiled = effpass.compile(model, passes=passes(), lowering="eager")
                out = compiled(**case.inputs)
                loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
                loss.backward()
                stats = [r.stats for r in effpass.report(compiled).records("fuse_cross_entropy")
                         if r.phase == "torch_ir"]
                skipped = [s["reason"] for r in effpass.report(compiled).records("fuse_cross_entropy")
                           for s in r.skipped]
                grads = {n: float(p.grad.double().abs().sum()) for n, p in model.named_parameters()
                         if p.grad is not None}
                res[key] = {"loss": float(loss), "stats": stats, "skipped": skipped, "grads": grads}
            except Exception as e:  # noqa
                res[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(key, res[key].get("error") or (res[key]["loss"], res[key]["stats"][-1:] if res[key]["stats"] else None), flush=True)
    json.dump(res, open(out_path, "w"), indent=1, sort_keys=True)


def compare(a, b):
    A, B = json.load(open(a)), json.load(open(b))
    bad = 0
    for k in sorted(set(A) | set(B)):
        x, y = A.get(k), B.get(k)
        if x is None or y is None or ("error" in x) != ("error" in y):
            print("DIFF presence/error", k, x and x.get("error"), y and y.get("error")); bad += 1; continue
        if "error" in x:
            if x["error"] != y["error"]:
                print("DIFF error", k, x["error"], "|", y["error"]); bad += 1
            continue
        if x["stats"] != y["stats"] or x["skipped"] != y["skipped"]:
            print("DIFF stats", k, x["stats"], y["stats"], x["skipped"], y["skipped"]); bad += 1
        rel = abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-30)
        g = max((abs(x["grads"][n] - y["grads"].get(n, float("nan"))) / max(abs(x["grads"][n]), 1e-30)
                 for n in x["grads"]), default=0.0)
        if set(x["grads"]) != set(y["grads"]) or not rel <= 1e-6 or not g <= 1e-6:
            print("DIFF numerics", k, rel, g); bad += 1
    print(f"{len(A)} sites compared, {bad} differ")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
    run(sys.argv[1])
