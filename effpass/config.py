"""effpass's options, validated into one :class:`Options` object before any compilation.

Options arrive either from Python (``effpass.compile(model, passes=[...], ...)``) or as a JSON-able dict
(``torch.compile(model, backend="effpass", options={...})``). Both end here: :func:`compile_options` turns
keyword arguments into the dict :func:`parse_options` validates. Each option is documented once, on its field of
:class:`Options`; whatever lists options (valid keys in errors, ``OPTION_DOCS``, ``effpass options``, the README
check) reads the fields. Environment variables are read in this module and nowhere else: :data:`ENV_VARS` names
each with what it does, :func:`env_overrides` and the ``*_from_env`` functions read them.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .pass_api import Pass, get_pass_class, make_pass, registered_passes

__all__ = ["Options", "parse_options", "compile_options", "env_overrides", "default_pipeline", "option_docs",
           "OPTION_DOCS", "ENV_VARS"]

LOWERINGS = ("inductor", "eager", "tensorrt")


@dataclass
class Options:
    """The validated options of one effpass backend: one field per option, each documented on itself
    (``metadata["doc"]``, what :func:`option_docs`, the valid keys in errors, the README check and ``effpass
    options`` read). A field whose metadata says ``"key": False`` is no key of the ``options`` dict: ``mode``
    is torch.compile's own argument, ``default_pipeline`` is derived."""

    passes: list[Pass] = field(default_factory=list, metadata={
        "doc": "the pipeline: {name: {option: value}} or a list of names / pass objects; omitted: the default "
               "pipeline"})
    lowering: str = field(default="inductor", metadata={
        "doc": "'inductor' (default: Triton on GPU, C++ on CPU), 'eager' (AOTAutograd without Inductor) or "
               "'tensorrt' (torch_tensorrt on a CUDA GPU, inference; untested)"})
    dump_dir: str | None = field(default=None, metadata={
        "doc": "folder for per-graph dumps (input graph, one file per changing pass, index.json)"})
    strict: bool = field(default=False, metadata={
        "doc": "raise when a pass fails instead of falling back to the graph before it"})
    allow_fallback: bool = field(default=False, metadata={
        "doc": "when every lowering fails on a graph, run it as captured (torch-IR passes applied) with a warning, "
               "although its joint/post-grad passes (checkpointing, ...) then do not run; False: raise, naming them"})
    bisect: int | None = field(default=None, metadata={
        "doc": "run only the first N passes of the ordered pipeline (debugging)"})
    disable: tuple[str, ...] = field(default=(), metadata={"doc": "pass names to leave out of the pipeline"})
    inductor_config: dict[str, Any] = field(default_factory=dict, metadata={
        "doc": "extra torch._inductor.config patches applied around lowering"})
    mode: str | None = field(default=None, metadata={
        "key": False, "doc": "torch.compile's mode ('max-autotune', ...), applied to Inductor (the mode= argument "
                             "of effpass.compile / torch.compile, not a key of options)"})
    detailed_stats: bool = field(default=False, metadata={
        "doc": "also compute statistics that cost extra compile work (e.g. checkpoint_activations' saved bytes "
               "before/after from two extra partitions); on whenever dump_dir is set"})
    default_pipeline: bool = field(default=False, metadata={
        "key": False, "doc": "True when the user gave no pipeline (the default pipeline was chosen for them)"})
    memory_budget: int | None = field(default=None, metadata={
        "doc": "fit the training step into this many bytes ('24GiB'): effpass.compile(model, memory_budget=...) "
               "chooses passes, with example_inputs= before compiling, else on the first call (effpass.planning; "
               "docs/memory_planner.md)"})
    allow: tuple[str, ...] = field(default=(), metadata={
        "doc": "lossy techniques the memory planner may use: the memory options registered passes declare "
               "(effpass.config.allow_techniques())"})


def option_docs(*, keys_only: bool = True) -> dict[str, str]:
    """``{option: doc}`` read from the fields of :class:`Options`, in field order: the keys the ``options`` dict
    accepts (``keys_only=False``: every field, with ``mode`` and the derived ones)."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(Options)
            if not keys_only or f.metadata.get("key", True)}


#: the keys the ``options`` dict accepts and what each does (read-only; derived from the fields of :class:`Options`)
OPTION_DOCS: Mapping[str, str] = types.MappingProxyType(option_docs())


# ------------------------------------------------------------------------------------------------------
# environment variables: every one effpass reads, read here and nowhere else
# ------------------------------------------------------------------------------------------------------
#: Environment variables effpass reads, with what each does (the README's Options section lists them; the
#: architecture test fails on a read of ``os.environ`` anywhere else in effpass/ or passes/).
ENV_VARS: dict[str, str] = {
    "EFFPASS_BISECT": "overrides the bisect option: run only the first N passes of the ordered pipeline",
    "EFFPASS_DISABLE": "overrides the disable option: comma-separated pass names to leave out",
    "EFFPASS_DUMP_DIR": "overrides the dump_dir option: write a dump per compiled graph into this folder",
    "EFFPASS_STRICT": "overrides the strict option: 1/true/yes/on raise when a pass fails, anything else falls back",
    "EFFPASS_LOWERING": "overrides the lowering option: inductor, eager or tensorrt",
    "EFFPASS_PROGRESS": "progress bars of planning, verification and replays: 0/false/no hides them, any other value "
                        "shows them; unset: shown only when standard error is a terminal",
    "EFFPASS_ROWWISE_COMPILE": "0: fuse_cross_entropy's row-wise tile program runs eagerly instead of compiled with "
                               "Inductor on CPU and CUDA (large vocabularies)",
    "EFFPASS_PLAN_WORKERS": "processes for a planner replay's independent parts (a whole number >= 1; 1: all in this "
                            "process); unset: up to 2 where this process may use 2 cores",
    "TRITON_INTERPRET": "Triton's own: 1 runs Triton kernels in its interpreter on CPU tensors; effpass's Triton "
                        "loss-head kernels (fuse_cross_entropy(kernel='triton')) then run on a CPU",
}


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Options set through environment variables (they override the ones given in code)."""
    env = _environ(environ)
    out: dict[str, Any] = {}
    if env.get("EFFPASS_BISECT", "") != "":
        try:
            out["bisect"] = int(env["EFFPASS_BISECT"])
        except ValueError:
            raise ValueError(f"EFFPASS_BISECT={env['EFFPASS_BISECT']!r} is not an integer") from None
    if env.get("EFFPASS_DISABLE"):
        out["disable"] = [s.strip() for s in env["EFFPASS_DISABLE"].split(",") if s.strip()]
    if env.get("EFFPASS_DUMP_DIR"):
        out["dump_dir"] = env["EFFPASS_DUMP_DIR"]
    if env.get("EFFPASS_STRICT", "") != "":
        out["strict"] = env["EFFPASS_STRICT"].lower() in ("1", "true", "yes", "on")
    if env.get("EFFPASS_LOWERING"):
        out["lowering"] = env["EFFPASS_LOWERING"]
    return out


def progress_from_env(environ: Mapping[str, str] | None = None) -> bool | None:
    """``EFFPASS_PROGRESS``: False for 0/false/no, True for any other value, None when unset (then progress bars
    show only on a terminal: :func:`effpass.progress.progress`)."""
    value = _environ(environ).get("EFFPASS_PROGRESS")
    return None if value is None else value not in ("0", "false", "no")


def rowwise_compile_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``EFFPASS_ROWWISE_COMPILE``: False when set to 0 (fuse_cross_entropy's row-wise tiles then run eagerly)."""
    return _environ(environ).get("EFFPASS_ROWWISE_COMPILE", "1") != "0"


def triton_interpret_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``TRITON_INTERPRET`` (Triton's own variable): ``1`` runs Triton kernels in Triton's interpreter on CPU
    tensors; effpass's Triton kernels (``fuse_cross_entropy(kernel="triton")``) may then run on a CPU (tests)."""
    return _environ(environ).get("TRITON_INTERPRET", "0") == "1"


def default_pipeline(device=None, dtype=None) -> list[Pass]:
    """The passes ``torch.compile(model, backend="effpass")`` runs: those on by default on ``device`` for
    a model whose floating-point inputs/parameters are ``dtype``.

    The backend calls this when it compiles a graph, with that graph's inputs' device and dtype. A pass's
    ``enabled_by_default`` receives ``dtype`` when it accepts it. Only passes that act on graphs can run
    from the string backend (module-level passes need ``effpass.compile``), so the default pipeline holds
    graph passes only.
    """
    import inspect

    from .pass_api import Phase

    out = []
    for name, klass in sorted(registered_passes().items()):
        if Phase.MODULE in klass.phases():
            continue
        takes_dtype = "dtype" in inspect.signature(klass.enabled_by_default).parameters
        on = klass.enabled_by_default(device, dtype=dtype) if takes_dtype else klass.enabled_by_default(device)
        if on:
            out.append(klass())
    return out


def _tensorrt_missing() -> list[str]:
    """What ``lowering="tensorrt"`` needs and this machine lacks (empty when it can run)."""
    import importlib.util

    import torch

    missing = []
    if importlib.util.find_spec("torch_tensorrt") is None:
        missing.append("torch_tensorrt (pip install 'effpass[tensorrt]')")
    if not torch.cuda.is_available():
        missing.append("a CUDA device")
    return missing


def _check_dump_dir(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"dump_dir must be a path string, got {type(path).__name__} {path!r}")
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".effpass-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"dump_dir {path!r} is not writable: {e.strerror or e}") from None
    return path


def _build_passes(spec: Any) -> list[Pass]:
    if isinstance(spec, Mapping):
        out = []
        for name, opts in spec.items():
            if not isinstance(name, str):
                raise TypeError(f"pass names must be strings, got {name!r}")
            if opts is None:
                opts = {}
            if not isinstance(opts, Mapping):
                raise TypeError(f"options of pass {name!r} must be a dict, got {type(opts).__name__} {opts!r}")
            out.append(make_pass(name, opts))
        return out
    if isinstance(spec, (str, Pass)):
        spec = [spec]
    if not isinstance(spec, Sequence):
        raise TypeError(f"passes must be a dict {{name: options}} or a list of pass names/objects, got {type(spec).__name__}")
    out = []
    for item in spec:
        if isinstance(item, Pass):
            out.append(item)
        elif isinstance(item, str):
            out.append(make_pass(item))
        elif isinstance(item, type) and issubclass(item, Pass):
            out.append(item())
        else:
            raise TypeError(f"a pipeline entry must be a pass object or name, got {type(item).__name__} {item!r}; "
                            f"registered passes: {sorted(registered_passes())}")
    names = [p.name for p in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"pass {dupes[0]!r} appears more than once in the pipeline")
    return out


def compile_options(*, mode: str | None = None, device=None, environ: Mapping[str, str] | None = None,
                    **options: Any) -> Options:
    """:class:`Options` from keyword arguments (``effpass.compile``, ``effpass.prepare``, ``effpass.export_onnx``):
    the one place keyword options become the dict :func:`parse_options` validates. A keyword set to ``None`` is
    not given (its default applies); an iterable ``disable`` / ``allow`` becomes a list; an unknown keyword raises
    the unknown-option error."""
    raw = {k: v for k, v in options.items() if v is not None}
    for key in ("disable", "allow"):
        value = raw.get(key)
        if isinstance(value, Iterable) and not isinstance(value, (str, list, tuple, Mapping)):
            raw[key] = list(value)
    return parse_options(raw, mode=mode, device=device, environ=environ)


def parse_options(options: Mapping[str, Any] | None = None, *, mode: str | None = None, device=None,
                  environ: Mapping[str, str] | None = None) -> Options:
    """Validate user options (Python or JSON-able) and environment overrides into :class:`Options`."""
    if options is None:
        options = {}
    if isinstance(options, Options):
        return options
    if not isinstance(options, Mapping):
        raise TypeError(f"effpass options must be a dict, got {type(options).__name__}")
    options = dict(options)  # torch.compile reuses the same dict for every graph: never mutate it
    valid = list(option_docs())
    for key in options:
        if key not in valid:
            import difflib

            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown effpass option {key!r}{hint}; valid options: {valid}")
    options.update(env_overrides(environ))

    out = Options(mode=mode)
    if "passes" in options and options["passes"] is not None:
        out.passes = _build_passes(options["passes"])
    else:
        out.passes = default_pipeline(device)
        out.default_pipeline = True

    lowering = options.get("lowering", "inductor")
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering {lowering!r} is not valid; choose one of {list(LOWERINGS)}")
    if lowering == "tensorrt":
        missing = _tensorrt_missing()
        if missing:
            raise RuntimeError(f"lowering='tensorrt' needs {' and '.join(missing)}, which this machine lacks; "
                               f"use lowering='inductor' or 'eager' here")
    out.lowering = lowering

    if options.get("dump_dir") is not None:
        out.dump_dir = _check_dump_dir(options["dump_dir"])

    strict = options.get("strict", False)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__} {strict!r}")
    out.strict = strict

    allow_fallback = options.get("allow_fallback", False)
    if not isinstance(allow_fallback, bool):
        raise TypeError(f"allow_fallback must be a bool, got {type(allow_fallback).__name__} {allow_fallback!r}")
    out.allow_fallback = allow_fallback

    detailed = options.get("detailed_stats", False)
    if not isinstance(detailed, bool):
        raise TypeError(f"detailed_stats must be a bool, got {type(detailed).__name__} {detailed!r}")
    out.detailed_stats = detailed or out.dump_dir is not None

    bisect = options.get("bisect")
    if bisect is not None and (isinstance(bisect, bool) or not isinstance(bisect, int) or bisect < 0):
        raise ValueError(f"bisect must be a non-negative int (run the first N passes), got {bisect!r}")
    out.bisect = bisect

    disable = options.get("disable", ())
    if isinstance(disable, str):
        disable = [disable]
    if not isinstance(disable, (list, tuple)):
        raise TypeError(f"disable must be a list of pass names, got {type(disable).__name__} {disable!r}")
    known = registered_passes()
    for name in disable:
        if name not in known:
            get_pass_class(name)  # raises with the list of valid names
    out.disable = tuple(disable)

    inductor_config = options.get("inductor_config", {}) or {}
    if not isinstance(inductor_config, Mapping):
        raise TypeError(f"inductor_config must be a dict, got {type(inductor_config).__name__}")
    if inductor_config:
        import torch._inductor.config as ic

        for key in inductor_config:
            if not hasattr(ic, key.split(".")[0]):
                raise ValueError(f"inductor_config: unknown Inductor config key {key!r}")
    out.inductor_config = dict(inductor_config)
    if options.get("memory_budget") is not None:
        out.memory_budget = parse_size(options["memory_budget"], "memory_budget")
    allow = options.get("allow") or ()
    if isinstance(allow, str):
        allow = [allow]
    if not isinstance(allow, (list, tuple)):
        raise TypeError(f"allow must be a list of technique names, got {type(allow).__name__} {allow!r}")
    valid = allow_techniques()
    bad = [a for a in allow if a not in valid]
    if bad:
        raise ValueError(f"allow: {bad[0]!r} names no technique; valid: {valid}")
    out.allow = tuple(allow)
    if mode is not None:
        valid_modes = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
        if mode not in valid_modes:
            raise ValueError(f"mode {mode!r} is not valid; choose one of {valid_modes}")
    return out


def allow_techniques() -> list[str]:
    """What ``allow`` may name: every technique the registered passes declare as a memory option
    (``Pass.memory_options``, ``effpass.register_memory_option``); lossless ones are accepted and ignored."""
    from .memory_options import declared_memory_options

    return sorted({o.technique for o in declared_memory_options(None, world_size=2)})

_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any, what: str = "memory_budget") -> int:
    """A byte count from ``"24GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"24G"`` (read as ``"24GB"``) or a number of
    bytes. Raises ``ValueError`` / ``TypeError`` naming the value and the units."""
    import math
    import re

    if isinstance(value, bool):
        raise TypeError(f"{what} must be a size such as '24GiB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{what} must be a positive size, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a size such as '24GiB' or a number of bytes, got "
                        f"{type(value).__name__} {value!r}")
    m = re.match(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$", value)
    unit = m.group(2).lower() if m else ""
    if unit and not unit.endswith("b"):
        unit += "b"
    if not m or unit not in ("",) + tuple(_SIZE_UNITS):
        raise ValueError(f"{what}: cannot read {value!r} as a size; use e.g. '24GiB', '512MiB', '1.5GB' or a "
                         f"number of bytes (units: {sorted(_SIZE_UNITS, key=_SIZE_UNITS.get)})")
    n = float(m.group(1)) * _SIZE_UNITS[unit or "b"]
    if n <= 0:
        raise ValueError(f"{what} must be a positive size, got {value!r}")
    return int(n)


def describe_options(opts: Options) -> dict[str, Any]:
    """A JSON-able summary (for dumps and errors)."""
    d = dataclasses.asdict(opts)
    d["passes"] = [{"name": p.name, "options": p.options()} for p in opts.passes]
    return d


# ---- planning ----
def plan_workers_setting() -> int | None:
    """``EFFPASS_PLAN_WORKERS``: processes the memory planner may use to replay an extrapolation's depths
    (forked from this one, Linux only; :func:`effpass.planning.pool.plan_workers`). None when unset or empty
    (the planner's default: up to 2, as the cores allow); raises ``ValueError`` when not a whole number."""
    env = os.environ.get("EFFPASS_PLAN_WORKERS")
    if not env:
        return None
    try:
        return max(1, int(env))
    except ValueError:
        raise ValueError(f"EFFPASS_PLAN_WORKERS={env!r}: expected a whole number of processes >= 1") from None
