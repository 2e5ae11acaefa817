"""The ``effpass`` command line: ``passes``, ``options``, ``inspect``, ``demo``, and the commands passes register
(``effpass estimate`` comes from wrap_fsdp).

Start-up is kept short: ``effpass --help`` and ``effpass passes`` read the built-in registry from data
(:mod:`effpass.cli.index`) and import nothing heavy; a command imports what it needs when it runs. Errors are
one line (``effpass CMD: ...``); ``--debug`` shows the traceback."""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

__all__ = ["main"]

WIDTH = 100  # tables fit this many columns (the last column wraps)


def _table(rows: list[tuple[str, ...]], width: int = WIDTH) -> str:
    """A plain-text table, the first row the header; the last column wraps at word boundaries so that every
    line fits ``width`` columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    room = max(width - sum(w + 2 for w in widths[:-1]), 16)
    widths[-1] = min(widths[-1], room)
    out = []
    for i, r in enumerate(rows):
        last = textwrap.wrap(r[-1], room) or [""]
        lead = "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths))
        out.append(f"{lead}  {last[0]}".rstrip())
        out += [(" " * (len(lead) + 2) + more).rstrip() for more in last[1:]]
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _plugins() -> list[str]:
    """Modules of ``effpass.passes`` entry points other than the built-ins (cheap: metadata only)."""
    import importlib.metadata as md

    try:
        return sorted({ep.value.split(":")[0] for ep in md.entry_points(group="effpass.passes")} - {"effpass.passes"})
    except Exception:  # pragma: no cover - broken metadata must not break the CLI
        return []


def _registry() -> dict:
    """Pass name -> what ``effpass passes`` shows: from the generated index (fast), or, with plugins installed,
    from the live registry (imports every pass)."""
    if not _plugins():
        from .index import load_index

        return load_index()["passes"]
    from ..pass_api import registered_passes
    import dataclasses

    out = {}
    for n, k in registered_passes().items():
        docs = k.option_docs()
        out[n] = {"summary": k.summary, "class": f"{k.__module__}.{k.__qualname__}",
                  "phases": [p.value for p in k.phases()], "run_after": list(k.run_after),
                  "conflicts_with": list(k.conflicts_with), "default": k.default_note(), "default_on_cpu": None,
                  "options": [[f.name, repr(f.default) if f.default is not dataclasses.MISSING else "...", docs[f.name]]
                              for f in dataclasses.fields(k)]}
    return out


def _command_names() -> dict[str, str]:
    """Name -> help of the commands passes register (built-ins from the index; plugins' read live)."""
    from .index import load_index

    out = dict(load_index()["commands"])
    if _plugins():
        from ..pass_api import registered_commands

        out.update({n: c.help for n, c in registered_commands().items()})
    return out


def unknown(kind: str, name: str, valid, cmd: str) -> SystemExit:
    """A one-line error for an unknown name, with a did-you-mean and the valid names."""
    import difflib

    close = difflib.get_close_matches(str(name), list(valid), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return SystemExit(f"effpass {cmd}: unknown {kind} {name!r}{hint}; valid: {', '.join(sorted(valid))}")


def check_pass_list(text: str | None, cmd: str) -> None:
    """``--passes`` (comma-separated names, or JSON ``{name: {option: value}}``): every name registered, checked
    before any work starts. Options are checked by effpass itself when the pipeline is built."""
    if text is None:
        return
    if text.strip().startswith("{"):
        try:
            names = list(json.loads(text))
        except (json.JSONDecodeError, TypeError) as e:
            raise SystemExit(f"effpass {cmd}: --passes is not valid JSON ({e}); give comma-separated names or "
                             '{"name": {"option": value}}') from None
    else:
        names = [p.strip() for p in text.split(",") if p.strip()]
    valid = _registry()
    for n in names:
        if n not in valid:
            raise unknown("pass", n, valid, cmd)


def _device_type(name: str | None) -> str:
    """The device ``effpass passes`` describes: the one named, else cuda when torch sees a GPU. Without a GPU
    driver on the machine that is the CPU, known without importing torch."""
    if name:
        if name.split(":")[0] not in ("cpu", "cuda", "xpu", "mps", "meta"):
            raise SystemExit(f"effpass passes: unknown device {name!r}; valid: cpu, cuda (cuda:N), xpu, mps")
        return name.split(":")[0]
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/kfd", "/dev/nvidiactl")):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------------
def cmd_passes(args) -> int:
    passes = _registry()
    if args.name and args.name not in passes:
        raise unknown("pass", args.name, passes, "passes")
    device = _device_type(args.device)
    if device == "cpu" and all(v["default_on_cpu"] is not None for v in passes.values()):
        defaults = [n for n, v in sorted(passes.items()) if v["default_on_cpu"]]
    else:  # another device (or plugins): ask the passes themselves
        import torch

        from ..config import default_pipeline
        from ..quantized import quiet_torchao_import

        with quiet_torchao_import():
            defaults = [p.name for p in default_pipeline(torch.device(args.device or device))]
    if args.name:
        k = passes[args.name]
        print(f"{args.name}: {k['summary']}")
        print(f"  class: {k['class']}")
        print(f"  phases: {', '.join(k['phases'])}")
        print(f"  run after: {', '.join(k['run_after']) or '-'};  conflicts with: {', '.join(k['conflicts_with']) or '-'}")
        print(f"  default: {k['default']}")
        print("  options:")
        for name, default, doc in k["options"]:
            print(textwrap.fill(f"{name} = {default}: {doc}", WIDTH, initial_indent="    ", subsequent_indent="      "))
        return 0
    if args.json:
        print(json.dumps({n: {"phases": k["phases"], "run_after": k["run_after"], "conflicts_with": k["conflicts_with"],
                              "default": k["default"], "in_default_pipeline": n in defaults, "summary": k["summary"]}
                          for n, k in sorted(passes.items())}, indent=1))
        return 0
    rows = [("#", "pass", "phases", f"on ({device})", "default")]
    for i, (n, k) in enumerate(passes.items()):
        rows.append((str(i), n, ",".join(k["phases"]), "yes" if n in defaults else "no", k["default"]))
    print(_table(rows) if len(rows) > 1 else "(no passes registered)")
    print()
    for label, key in (("runs after", "run_after"), ("conflicts with", "conflicts_with")):
        edges = [f"{n} after {', '.join(k[key])}" if key == "run_after" else f"{n} x {', '.join(k[key])}"
                 for n, k in passes.items() if k[key]]
        if edges:
            print(textwrap.fill(f"{label}: " + "; ".join(edges), WIDTH, subsequent_indent="  "))
    print(textwrap.fill(f"default pipeline on {device} (torch.compile(model, backend=\"effpass\")): "
                        f"{', '.join(defaults) or '(empty)'}", WIDTH))
    print("order: passes run in the order above within each phase: module, torch_ir, joint, post_grad")
    print("summaries and options: effpass passes NAME")
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

    check_pass_list(args.passes, "export")
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
    check_pass_list(args.passes, "verify")
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    p = argparse.ArgumentParser(prog="effpass", description="effpass: graph passes for faster, leaner training",
                                epilog="--debug (anywhere): show the traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("passes", help="list registered passes: phases, ordering, defaults")
    sp.add_argument("name", nargs="?", help="show one pass with its options")
    sp.add_argument("--device", help="say what the default pipeline is on this device (cpu, cuda)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_passes)

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

    sp = sub.add_parser("options", help="effpass's options and environment variables, with what each does")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_options)

    sub.add_parser("demo", help="train the embedded Llama-style model eagerly and with effpass, interleaved and "
                                "repeated, with a verdict", add_help=False)

    # Commands that passes and plugins contribute through the registry (e.g. wrap_fsdp's ``estimate``): listed
    # from the index; their arguments (and the passes that define them) load only when one of them runs.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in sorted(_command_names().items()):
        sp = sub.add_parser(name, help=help_text)
        if name == chosen:
            import importlib

            from ..pass_api import registered_commands

            importlib.import_module("effpass.planning.cli")  # registers ``effpass plan``
            importlib.import_module("effpass.cost.cli")  # registers ``effpass cost``

            command = registered_commands()[name]
            command.add_arguments(sp)
            sp.set_defaults(func=command.run)

    if chosen == "demo":
        from .demo import main as demo_main

        rest = argv[argv.index("demo") + 1:]
        for i, a in enumerate(rest):  # checked before anything is imported or trained
            if a == "--passes" and i + 1 < len(rest):
                check_pass_list(rest[i + 1], "demo")
            elif a.startswith("--passes="):
                check_pass_list(a.split("=", 1)[1], "demo")
        return _run(lambda: demo_main(rest), "demo", debug)
    args = p.parse_args(argv)
    check_pass_list(getattr(args, "passes", None), args.cmd)  # before any work (and before torch loads)
    return _run(lambda: args.func(args), args.cmd, debug)


def _run(fn, cmd: str, debug: bool) -> int:
    """Run a command: a user error is one line on stderr (exit status 1 or 2), the traceback only with --debug."""
    import contextlib

    try:
        if cmd == "passes" and not _plugins():
            quiet = contextlib.nullcontext()  # reads the index: no torch (cmd_passes quiets its slow path itself)
        else:
            from ..quantized import quiet_torchao_import

            quiet = quiet_torchao_import()  # torchao's import noise, wherever a command first imports it
        with quiet:
            return fn()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        print(f"effpass {cmd}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"effpass {cmd}: {type(e).__name__}: {first} (run with --debug for the traceback)", file=sys.stderr)
        return 1

