"""``effpass cost CONFIG.json --batch B --seq S [--dtype bfloat16] [--passes a,b | --no-passes]
[--device h100|h200] [--json]``: the estimated cost of one training step of a Hugging Face config on a GPU
(:func:`effpass.cost.config_step_cost`). Estimates, not measurements: docs/cost_model.md."""
from __future__ import annotations

import json
import sys

import effpass

from ..devices import DEVICES

__all__: list[str] = []


def _add_arguments(sp) -> None:
    sp.add_argument("config", help="a Hugging Face config.json (random weights; fake tensors for a full-size model)")
    sp.add_argument("--batch", type=int, required=True)
    sp.add_argument("--seq", type=int, required=True)
    sp.add_argument("--dtype", default=None, help="model dtype (default: the config's, else float32), e.g. bfloat16")
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--passes", help="comma-separated pass names (default: the default pipeline on a GPU)")
    group.add_argument("--no-passes", action="store_true", help="no passes: plain torch.compile's graphs")
    sp.add_argument("--device", default="h100", help=f"the GPU the time is estimated on: {', '.join(sorted(DEVICES))}")
    sp.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (default: all)")
    sp.add_argument("--tensors", default="auto", help="real, fake (shapes only) or auto (fake above 256 MiB of "
                                                      "parameters)")
    sp.add_argument("--no-per-pass", action="store_true", help="skip the with/without runs of each pass")
    sp.add_argument("--top", type=int, default=12, help="ops shown in the per-op table")
    sp.add_argument("--json", action="store_true", help="print JSON: flops, bytes, host_syncs, kernels, "
                                                        "est_time_s, and the same under head and passes.<name>")


def _run(args) -> int:
    from . import config_step_cost, get_device

    try:
        get_device(args.device)
        passes = [] if args.no_passes else (
            None if args.passes is None else [p.strip() for p in args.passes.split(",") if p.strip()])
        cost = config_step_cost(args.config, args.batch, args.seq, dtype=args.dtype, passes=passes,
                                device=args.device, layers=args.layers, tensors=args.tensors,
                                per_pass=not args.no_per_pass)
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise SystemExit(msg if msg.startswith("effpass cost") else f"effpass cost: {msg}") from None
    if args.json:
        print(json.dumps(cost.to_dict(), indent=1, default=str))
    else:
        print(f"{args.config}: batch {args.batch} x seq {args.seq} (estimates, not measurements)")
        print(cost.summary(top=args.top))
    sys.stdout.flush()
    return 0


effpass.register_command("cost", help="estimate a training step's FLOPs, bytes, host syncs, kernels and time on a "
                                      "GPU from a HF config (on CPU)", add_arguments=_add_arguments, run=_run)
