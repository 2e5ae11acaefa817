"""``effpass plan CONFIG.json --batch B --seq T --budget 24GiB``: the memory plan for a Hugging Face config.

The model is built on the meta device from the config (no weights), then planned with
:func:`~effpass.planning.plan_memory` on fake tensors. Inputs: ``input_ids`` = ``labels`` of shape
``(batch, seq)``, ``use_cache=False`` (as trainers run). Predictions only.
"""
from __future__ import annotations

import json
import sys

import effpass

from .maxseq import PROBES


__all__ = ["model_from_config", "plan_config", "max_seq_config"]

LORA_TARGETS = ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj"]


def model_from_config(config, dtype: str | None = None):
    """A causal LM on the meta device from a Hugging Face config (a path to config.json, a dict or a
    ``PretrainedConfig``), with SDPA attention, in ``dtype`` (default: the config's ``torch_dtype``/``dtype``,
    else float32)."""
    import torch
    import transformers as tf

    from ..quantized import quiet_torchao_import

    with quiet_torchao_import():  # transformers' model code imports torchao, whose first import logs on a CPU build
        import transformers.modeling_utils  # noqa: F401
    if isinstance(config, str):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the Hugging Face config {config!r}: {e}") from None
    if isinstance(config, dict):
        d = dict(config)
        mt = d.pop("model_type", None)
        if "torch_dtype" in d and "dtype" not in d:  # config.json files often carry the deprecated name
            d["dtype"] = d.pop("torch_dtype")
        if mt is None:
            raise ValueError("the config has no 'model_type' (e.g. 'llama'); is it a Hugging Face config.json?")
        try:
            config = tf.AutoConfig.for_model(mt, **d)
        except ValueError as e:
            raise ValueError(f"model_type {mt!r}: {e}") from None
    # ``config.dtype`` only: transformers maps a config's ``torch_dtype`` onto it, and reading ``torch_dtype``
    # prints its deprecation warning (issue 38.5)
    name = dtype or getattr(config, "dtype", None) or "float32"
    torch_dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype; use e.g. 'float32', 'bfloat16', 'float16'")
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.train()
    return model


def plan_config(config, batch: int, seq: int, budget, allow=(), world_size: int = 1, passes=None,
                lora: int | None = None, optimizer: str | None = "adamw", dtype: str | None = None,
                device: str = "cpu", sequence_parallel: int = 1, prune: bool = True, gpu: str | None = None,
                host_budget=None, allocator: str = "default"):
    """(model, plan) for a config at ``batch`` x ``seq`` under ``budget`` (``prune``, ``gpu``, ``host_budget``,
    ``allocator``: see
    ``plan_memory``)."""
    import torch

    from .planner import plan_memory

    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    model = model_from_config(config, dtype)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    inputs = {"input_ids": tokens, "labels": tokens, "use_cache": False}
    pipeline = _pipeline_of(passes, lora)
    plan = plan_memory(model, inputs, budget, allow=allow, passes=pipeline, optimizer=optimizer,
                       world_size=world_size, device=device, lowering="eager", sequence_parallel=sequence_parallel,
                       prune=prune, gpu=gpu, host_budget=host_budget, allocator=allocator)
    return model, plan


def _pipeline_of(passes, lora):
    pipeline = list(passes or [])
    if isinstance(passes, dict):
        pipeline = [effpass.make_pass(n, o or {}) for n, o in passes.items()]
    if lora:
        pipeline.append(effpass.make_pass("inject_lora", {"rank": int(lora), "targets": LORA_TARGETS}))
    return pipeline


def max_seq_config(config, batch: int, budget, allow=(), world_size: int = 1, passes=None, lora: int | None = None,
                   optimizer: str | None = "adamw", dtype: str | None = None, device: str = "cpu", step: int = 1024,
                   probes=None, max_len: int = 1 << 24, host_budget=None,
                   allocator: str = "default", min_tiles: int | None = 12):
    """(model, :class:`~effpass.planning.planner.MaxSeqResult`): the longest sequence of ``batch`` rows of a
    config that fits ``budget``, and its plan."""
    import torch

    from .maxseq import plan_max_seq

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got batch={batch}")
    model = model_from_config(config, dtype)

    def make_inputs(seq):
        tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        return {"input_ids": tokens, "labels": tokens, "use_cache": False}

    res = plan_max_seq(model, make_inputs, budget, allow=allow, passes=_pipeline_of(passes, lora),
                       optimizer=optimizer, world_size=world_size, device=device, step=step,
                       probes=tuple(probes) if probes else PROBES,
                       max_len=max_len, lowering="eager", host_budget=host_budget, allocator=allocator,
                       min_tiles=min_tiles or None)
    return model, res


def _add_arguments(p) -> None:
    p.add_argument("config", help="a Hugging Face config.json")
    p.add_argument("--batch", type=int, required=True, help="micro-batch (per rank)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (required unless --max-seq)")
    p.add_argument("--max-seq", dest="max_seq", action="store_true",
                   help="print the longest sequence that fits the budget, with its plan (predicted)")
    p.add_argument("--step", type=int, default=1024, help="--max-seq: the answer is a multiple of this")
    p.add_argument("--probes", type=int, nargs="+", default=list(PROBES),
                   help="--max-seq: lengths every candidate plan is replayed at, to fit its peak against the length "
                        "(two: a linear fit; three: quadratic, where attention scores are materialised)")
    p.add_argument("--max-len", dest="max_len", type=int, default=1 << 24, help="--max-seq: the longest length tried")
    p.add_argument("--min-tiles", dest="min_tiles", type=int, default=12, metavar="N",
                   help="--max-seq: the search predicts a length whose pipeline unrolls more than N tiles from replays "
                        "at 4-6 tiles extrapolated over the tile count, place by place (exact; where the places do "
                        "not line up, a lower bound: then only 'over the budget' is taken from it and the answer is "
                        "replayed at full length); 0: every length replayed (default 12; docs/memory_planner.md, "
                        "extrapolation over the tile count)")
    p.add_argument("--budget", required=True, help="memory per device, e.g. 24GiB")
    p.add_argument("--allow", nargs="*", default=[], help="lossy techniques the plan may use (the memory options registered passes declare, e.g. a quantized base or 8-bit optimizer states; docs/memory_planner.md)")
    p.add_argument("--world-size", dest="world_size", type=int, default=1, help="ranks (FSDP is tried when > 1)")
    p.add_argument("--sequence-parallel", "--sp", dest="sequence_parallel", type=int, default=1, metavar="N",
                   help="ranks per sequence (shard_sequence): per-rank prediction of seq/N tokens plus what a rank "
                        "holds whole; --world-size counts all ranks (data x N)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK", help="train LoRA adapters of this rank")
    p.add_argument("--passes", default=None, help='the pipeline as JSON, e.g. \'{"fuse_attention": {}}\'')
    p.add_argument("--optimizer", default="adamw", help="an optimizer registered with effpass.register_optimizer "
                   "(adamw is torch's AdamW), or none")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: the config's)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="device to predict for (fake tensors). cuda: the caching allocator's segments are modelled "
                        "and fitted to the budget; made on any machine (CPU fake tensors where there is no GPU); "
                        "not yet checked against a GPU")
    from effpass.devices import DEVICES

    p.add_argument("--gpu", default=None, choices=tuple(DEVICES),
                   help="with --device cuda: the GPU each plan's step time (and host-link transfers) is estimated on "
                        "(default h100)")
    p.add_argument("--host-budget", dest="host_budget", default=None, metavar="SIZE",
                   help="with --device cuda: host memory a plan may hold (offloaded activations, optimizer states on "
                        "the host), e.g. 512GiB; a plan over it is not a candidate. Default: unbounded (the plan is "
                        "for a CUDA machine, not this one)")
    p.add_argument("--expandable-segments", dest="allocator", action="store_const", const="expandable",
                   default="default",
                   help="with --device cuda: fit the reserved bytes of CUDA's caching allocator with expandable "
                        "segments (train with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); default: its "
                        "default mode")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--all", dest="replay_all", action="store_true",
                   help="replay every candidate of the tiers tried (the whole table), also those whose bytes at the "
                        "start of the step already exceed the budget (by default they are listed as not replayed)")
    p.add_argument("--html", metavar="OUT.html", help="also draw where memory goes: live bytes over one step, "
                   "stacked by category, one curve per candidate plan")
    p.add_argument("--memory-viz", dest="memory_viz", metavar="OUT.pickle",
                   help="also write the chosen plan's timeline as a snapshot for https://pytorch.org/memory_viz")


def _run(args) -> int:
    from .candidates import MemoryBudgetError

    passes = json.loads(args.passes) if args.passes else None
    if args.max_seq:
        return _run_max_seq(args, passes)
    if args.seq is None:
        raise SystemExit("effpass plan: --seq is required (or --max-seq for the longest sequence that fits)")
    try:
        model, plan = plan_config(args.config, args.batch, args.seq, args.budget, allow=args.allow,
                                  world_size=args.world_size, passes=passes, lora=args.lora,
                                  optimizer=None if args.optimizer == "none" else args.optimizer, dtype=args.dtype,
                                  device=args.device, sequence_parallel=args.sequence_parallel,
                                  prune=not args.replay_all, gpu=args.gpu, host_budget=args.host_budget,
                                  allocator=args.allocator)
    except MemoryBudgetError as e:
        print(f"effpass plan: {e}", file=sys.stderr)
        if e.candidates:
            from .candidates import MemoryPlan

            fake = MemoryPlan(budget=0, chosen=e.plan, candidates=e.candidates, passes=[], optimizer=None,
                              world_size=args.world_size, reason="")
            print(fake.table(), file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        raise SystemExit(f"effpass plan: {e}") from None
    if args.html or args.memory_viz:
        _write_pictures(plan, args)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    n = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n / 1e9:.3g}B parameters, batch {args.batch} x seq {args.seq}"
          + (f", {args.world_size} ranks" if args.world_size > 1 else "")
          + (f", sequence parallel {args.sequence_parallel} (seq/{args.sequence_parallel} tokens per rank)"
             if args.sequence_parallel > 1 else "") + " (predictions, not measurements)")
    print(_assumptions(model, args))
    print(plan.summary())
    return 0


def _run_max_seq(args, passes) -> int:
    from .candidates import MemoryBudgetError

    if args.seq is not None:
        raise SystemExit("effpass plan: --seq and --max-seq exclude each other (--max-seq finds the length)")
    try:
        model, res = max_seq_config(args.config, args.batch, args.budget, allow=args.allow,
                                    world_size=args.world_size, passes=passes, lora=args.lora,
                                    optimizer=None if args.optimizer == "none" else args.optimizer, dtype=args.dtype,
                                    device=args.device, step=args.step, probes=args.probes, max_len=args.max_len,
                                    host_budget=args.host_budget, allocator=args.allocator,
                                    min_tiles=args.min_tiles)
    except MemoryBudgetError as e:
        print(f"effpass plan: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        raise SystemExit(f"effpass plan: {e}") from None
    if args.json:
        print(json.dumps(res.to_dict(), indent=1))
        return 0
    n = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n / 1e9:.3g}B parameters, batch {args.batch}"
          + (f", {args.world_size} ranks" if args.world_size > 1 else "") + " (predictions, not measurements)")
    print(_assumptions(model, args))
    print(res.summary())
    return 0


def _assumptions(model, args) -> str:
    """One line with what the prediction assumes beyond the shape: dtype, optimizer, adapters, device."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    lora = getattr(args, "lora", None)
    return (f"assumes: {dtype} weights ({'--dtype' if getattr(args, 'dtype', None) else 'the config'}), optimizer "
            f"{getattr(args, 'optimizer', None) or 'none'}, {f'LoRA rank {lora} (base frozen)' if lora else 'full fine-tuning'}"
            f", device {getattr(args, 'device', None) or 'the default'}"
            + (", expandable segments" if getattr(args, "allocator", "default") == "expandable" else ""))


def _write_pictures(plan, args) -> None:
    from ..inspect.timeline import memory_viz_snapshot, write_timeline_html

    curves = plan.timelines()
    if args.html:
        write_timeline_html(args.html, curves, title=f"effpass plan: {args.config}, batch {args.batch} x {args.seq}",
                            text=plan.summary())
        print(f"wrote {args.html}", file=sys.stderr)
    if args.memory_viz:
        import pickle

        if not curves:
            raise SystemExit("effpass plan: the chosen plan has no recorded timeline to export")
        with open(args.memory_viz, "wb") as f:
            pickle.dump(memory_viz_snapshot(curves[0][1]), f)
        print(f"wrote {args.memory_viz}", file=sys.stderr)


effpass.register_command("plan", help="choose passes that fit a training step of a HF config into a memory budget",
                         add_arguments=_add_arguments, run=_run)
