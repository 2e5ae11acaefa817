"""The ``effpass`` command line: ``passes``, ``options``, ``inspect``, ``demo``, and the commands passes register
(``effpass estimate`` comes from wrap_fsdp)."""
from __future__ import annotations

import argparse
import json
import sys

from ..inspect import table as _table
from ..pass_api import registered_commands

__all__ = ["main"]


# ------------------------------------------------------------------------------------------------------
def cmd_passes(args) -> int:
    import torch

    from ..config import default_pipeline
    from ..manager import order_passes
    from ..pass_api import registered_passes

    passes = registered_passes()
    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    defaults = [p.name for p in default_pipeline(device)]
    if args.name:
        from ..pass_api import get_pass_class

        klass = get_pass_class(args.name)
        print(f"{klass.name}: {klass.summary}")
        print(f"  class: {klass.__module__}.{klass.__qualname__}")
        print(f"  phases: {', '.join(p.value for p in klass.phases())}")
        print(f"  run after: {', '.join(klass.run_after) or '-'};  conflicts with: {', '.join(klass.conflicts_with) or '-'}")
        print(f"  default: {klass.default_note()}")
        print("  options:")
        import dataclasses

        docs = klass.option_docs()
        for f in dataclasses.fields(klass):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
            print(f"    {f.name} = {default!r}: {docs[f.name]}")
        return 0
    if args.json:
        print(json.dumps({n: {"phases": [p.value for p in k.phases()], "run_after": list(k.run_after),
                               "conflicts_with": list(k.conflicts_with), "default": k.default_note(),
                               "in_default_pipeline": n in defaults, "summary": k.summary}
                          for n, k in sorted(passes.items())}, indent=1))
        return 0
    ordered = order_passes([k() for k in passes.values()], check_conflicts=False) if passes else []
    rows = [("#", "pass", "phases", "runs after", "conflicts", f"on ({device.type})", "default")]
    for i, p in enumerate(ordered):
        k = type(p)
        rows.append((str(i), k.name, ",".join(ph.value for ph in k.phases()), ",".join(k.run_after) or "-",
                     ",".join(k.conflicts_with) or "-", "yes" if k.name in defaults else "no", k.default_note()[:80]))
    print(_table(rows) if len(rows) > 1 else "(no passes registered)")
    print(f"\ndefault pipeline on {device.type} (torch.compile(model, backend=\"effpass\")): "
          f"{', '.join(defaults) or '(empty)'}")
    print("order: passes run in the order above within each phase: module, torch_ir, joint, post_grad")
    print("summaries and options: effpass passes NAME")
    return 0


# ------------------------------------------------------------------------------------------------------
def cmd_options(args) -> int:
    """effpass's options and environment variables, read from ``effpass.config`` (each option's doc is on its
    field of ``Options``)."""
    import dataclasses

    from ..config import ENV_VARS, Options

    fields = [f for f in dataclasses.fields(Options) if f.metadata.get("key", True)]
    if args.json:
        print(json.dumps({"options": {f.name: {"doc": f.metadata["doc"], **(
                              {"default": f.default} if f.default is not dataclasses.MISSING else {})}
                                      for f in fields},
                          "environment": ENV_VARS}, indent=1, default=repr))
        return 0
    print("options (effpass.compile(model, ...) keywords; torch.compile(..., backend='effpass', options={...}) keys):")
    for f in fields:
        default = f" = {f.default!r}" if f.default is not dataclasses.MISSING else ""
        print(f"  {f.name}{default}: {f.metadata['doc']}")
    print("environment variables (read in effpass/config.py):")
    for name, doc in ENV_VARS.items():
        print(f"  {name}: {doc}")
    return 0


# ------------------------------------------------------------------------------------------------------
def cmd_inspect(args) -> int:
    from ..inspect import DumpError, diff_pass, format_dump, load_dump, to_json

    if args.html:
        from ..inspect.html import write_dump_html

        problems = write_dump_html(args.dump_dir, args.html)
        for prob in problems:
            print(f"effpass inspect: {prob}", file=sys.stderr)
        print(f"wrote {args.html}")
        # a page is written even for a bad dump (it says what is wrong); the status says whether it had graphs
        return 0 if not any(p.startswith(("no effpass dump", repr(args.dump_dir))) for p in problems) else 1
    try:
        graphs = load_dump(args.dump_dir)
        if args.diff:
            sys.stdout.write(diff_pass(graphs, *args.diff))
        elif args.json:
            print(to_json(graphs))
        else:
            print(format_dump(graphs, ops=args.ops))
    except DumpError as e:
        raise SystemExit(f"effpass inspect: {e}") from None
    return 0


# ------------------------------------------------------------------------------------------------------
def _load_hf(source: str):
    """A Hugging Face model from a config file / folder (random weights) or a saved model folder."""
    import os

    import torch

    from ..quantized import quiet_torchao_import

    with quiet_torchao_import():  # transformers' model code imports torchao, whose first import logs on a CPU build
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if not os.path.exists(source):
        raise SystemExit(f"effpass export: {source!r} does not exist (give a config.json or a saved model folder)")
    weights = os.path.isdir(source) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(source))
    cfg = AutoConfig.from_pretrained(source)
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            if weights:
                return auto.from_pretrained(source, config=cfg), cfg, True
            torch.manual_seed(0)
            return auto.from_config(cfg), cfg, False
        except ValueError:
            continue
    raise SystemExit(f"effpass export: no Hugging Face model class for config type {cfg.model_type!r}")


def cmd_export(args) -> int:
    import torch

    from ..export import OnnxExportError, export_onnx

    passes = None
    if args.passes is not None:
        passes = json.loads(args.passes) if args.passes.strip().startswith("{") else \
            [p for p in args.passes.split(",") if p.strip()]
    model, cfg, pretrained = _load_hf(args.source)
    vocab = getattr(cfg, "vocab_size", None) or 256
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(0, vocab, (args.batch, args.seq), generator=g)}
    try:
        res = export_onnx(model, inputs, args.out, passes=passes, opset=args.opset, inplace=True,
                          check=not args.no_check, dump_dir=args.dump_dir)
    except (OnnxExportError, ValueError, TypeError, ImportError) as e:
        raise SystemExit(f"effpass export: {e}") from None
    print(f"wrote {res.path} ({'pretrained weights' if pretrained else 'random weights from the config'}; "
          f"KV cache off; input shapes fixed to batch={args.batch}, seq={args.seq})")
    print(f"  inputs {res.input_names} -> outputs {res.output_names}")
    print("  stored weights: " + ", ".join(f"{k} {v:,} B" for k, v in sorted(res.initializer_bytes.items())))
    print(f"  int8 linears (DequantizeLinear): {len(res.int8_linears)};  dequantized in-graph: {len(res.dequantized_linears)}")
    for name, err in res.max_rel_error.items():
        print(f"  onnxruntime (CPU) vs the transformed PyTorch graph, {name}: max relative error {err:.2e}")
    print(res.report.summary())
    return 0


def cmd_verify(args) -> int:
    from ..verification import hf_inputs, model_from_hf_config, verify

    passes = None
    if args.passes is not None:
        passes = json.loads(args.passes) if args.passes.strip().startswith("{") else \
            [p for p in args.passes.split(",") if p.strip()]
    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"effpass verify: --set {item!r} must be KEY=VALUE (e.g. hidden_size=64)")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:
        model, cfg = model_from_hf_config(args.config, layers=args.layers, overrides=overrides)
        inputs = hf_inputs(cfg, batch=args.batch, seq=args.seq)
        rep = verify(model, inputs, passes, lowering=args.lowering, packed=True if args.packed else None,
                     alone=not args.no_alone)
    except (ValueError, TypeError, ImportError) as e:
        raise SystemExit(f"effpass verify: {e}") from None
    if args.json:
        import dataclasses

        print(json.dumps({"ok": rep.ok, "failing_pass": rep.failing_pass, "site": rep.site,
                          "seconds": rep.seconds, "checks": [dataclasses.asdict(c) for c in rep.checks]},
                         indent=1, default=str))
    else:
        print(f"{cfg.model_type}: {args.layers} layers, batch {args.batch} x {args.seq} tokens, fp32, "
              f"lowering={args.lowering}")
        print(rep.to_text())
    return 0 if rep.ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="effpass", description="effpass: graph passes for faster, leaner training")
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("passes", help="list registered passes: phases, ordering, defaults")
    sp.add_argument("name", nargs="?", help="show one pass with its options")
    sp.add_argument("--device", help="say what the default pipeline is on this device (cpu, cuda)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_passes)

    sp = sub.add_parser("options", help="effpass's options and environment variables, with what each does")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_options)

    sp = sub.add_parser("inspect", help="show the graphs and passes of a dump, with statistics")
    sp.add_argument("dump_dir")
    sp.add_argument("--diff", nargs=2, metavar=("GRAPH", "PASS"), help="what PASS changed in GRAPH (unified diff)")
    sp.add_argument("--ops", action="store_true", help="also show each pass's op-count changes")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML report (charts, diffs) to OUT.html")
    sp.set_defaults(func=cmd_inspect)

    sp = sub.add_parser("export", help="apply passes to a Hugging Face model (config or saved folder) and write ONNX")
    sp.add_argument("source", help="a config.json, or a folder with one (random weights) or with saved weights")
    sp.add_argument("out", help="the .onnx file to write")
    sp.add_argument("--passes", help="comma-separated pass names, or JSON {name: {option: value}}; default: the "
                                     "default pipeline")
    sp.add_argument("--batch", type=int, default=1)
    sp.add_argument("--seq", type=int, default=16)
    sp.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    sp.add_argument("--dump-dir", default=None, help="also leave an effpass dump of the passes")
    sp.add_argument("--no-check", action="store_true", help="skip the onnxruntime check")
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("verify", help="check a pipeline against the eager model on a Hugging Face config (2 layers): "
                                       "each pass alone, all together, packed rows; bisects a mismatch to its pass")
    sp.add_argument("config", help="a config.json, a folder with one, or a model type (llama, qwen3, mixtral, ...)")
    sp.add_argument("--passes", help="comma-separated pass names, or JSON {name: {option: value}}; default: the "
                                     "default pipeline")
    sp.add_argument("--layers", type=int, default=2)
    sp.add_argument("--batch", type=int, default=2)
    sp.add_argument("--seq", type=int, default=16)
    sp.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a config field (JSON value), e.g. --set hidden_size=64 (repeatable)")
    sp.add_argument("--packed", action="store_true", help="also check packed rows against examples alone")
    sp.add_argument("--no-alone", action="store_true", help="skip the each-pass-alone checks")
    sp.add_argument("--lowering", default="eager", choices=("eager", "inductor"))
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_verify)

    sub.add_parser("demo", help="train the embedded Llama-style model eagerly and with effpass", add_help=False)

    from ..planning import cli as _plan_cli  # noqa: F401  (registers ``effpass plan``)

    # Commands that passes and plugins contribute through the registry (e.g. wrap_fsdp's ``estimate``).
    for name, command in sorted(registered_commands().items()):
        sp = sub.add_parser(name, help=command.help)
        command.add_arguments(sp)
        sp.set_defaults(func=command.run)

    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = p.parse_args(argv)
    return args.func(args)

