"""Graph helpers shared by the core and every pass: public, for people who write their own passes.

* reading graphs: :func:`op_name`, :func:`op_histogram`, :func:`tensor_meta`, :func:`placeholder_values`
* joint graphs: :func:`is_tangent`, :func:`is_primal`, :func:`has_tangents`
* rollback and dumps: :func:`snapshot_graph`, :func:`restore_graph`, :class:`GraphCheckpoint` (a rollback point that
  copies no node), :func:`copy_graph_into`, :func:`runnable_source`, :func:`lazy_graph_module`
* module paths: :func:`normalize_module_path`, :func:`module_stack_of_node`, :func:`module_path_of_node`,
  :func:`source_path` (the parameter or buffer a torch-IR placeholder stands for), :func:`is_buffer_source`
* nodes a pass creates: :func:`copy_provenance`, :func:`infer_fake_values` (the one fake-value updater),
  :func:`annotate_new_nodes` (both, for a rewrite's new nodes), :func:`erase_dead` (the one dead-node eraser)
* sites: :func:`ancestors`, :func:`site_name` (how reports name a site)
* symbolic sizes (dynamic shapes: a packed length): :func:`size_hint` (an int for statistics and budgets, no guard),
  :func:`same_size` / :func:`same_shape` (equal without guarding), :func:`is_static`
* matching torch-IR nodes: :func:`is_fn`, :func:`is_method`, :func:`val`, :func:`shape_of`, :func:`is_number`,
  :class:`Skip` (a site left alone, with its reason), :data:`MASK_FILL_THRESHOLD`
* autocast: :class:`AutocastRegions` / :func:`autocast_dtype_at` (the one reader of autocast regions, including
  autocast entered around the compiled call), :func:`is_autocast_enter`, :func:`is_autocast_exit`
* models: :func:`transformer_blocks` (the repeated layers of a model)
"""
from __future__ import annotations

import collections
import operator
import re
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx

__all__ = ["op_name", "op_histogram", "snapshot_graph", "GraphCheckpoint", "lazy_graph_module", "forward_nodes", "restore_graph", "copy_graph_into", "runnable_source",
           "tensor_meta",
           "placeholder_values", "is_tangent", "is_primal", "has_tangents", "transformer_blocks",
           "normalize_module_path", "module_stack_of_node", "module_path_of_node", "source_path", "is_buffer_source",
           "PROVENANCE_KEYS", "copy_provenance", "infer_fake_values", "annotate_new_nodes", "erase_dead",
           "ancestors", "site_name", "arg", "size_hint", "same_size", "same_shape", "is_static",
           "is_fn", "is_method", "is_random_op", "is_softmax", "val", "shape_of", "is_number", "Skip", "MASK_FILL_THRESHOLD",
           "AutocastRegions", "autocast_dtype_at", "is_autocast_enter", "is_autocast_exit",
           "ENTER_AUTOCAST", "EXIT_AUTOCAST"]


def op_name(node: fx.Node) -> str:
    """A stable, readable name for what a node does (``aten.mm``, ``torch.matmul``, ``.view``)."""
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return f"aten.{t.overloadpacket.__name__}" if t.namespace == "aten" else f"{t.namespace}.{t.overloadpacket.__name__}"
        if isinstance(t, torch._ops.OpOverloadPacket):
            return f"{t._qualified_op_name.replace('::', '.')}"
        if isinstance(t, torch._ops.HigherOrderOperator):
            return f"hop.{t.name()}"
        mod = getattr(t, "__module__", None) or ""
        name = getattr(t, "__name__", repr(t))
        if t in (operator.getitem,):
            return "getitem"
        if mod.startswith("torch"):
            if mod.startswith("torch._C._nn") or mod == "torch.nn.functional":
                return f"F.{name}"
            return f"torch.{name}"
        return f"{mod.split('.')[-1]}.{name}" if mod else name
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"module.{node.target}"
    return node.op


def op_histogram(graph: fx.Graph) -> dict[str, int]:
    """How many nodes of each op the graph has (placeholders, outputs and getitems excluded)."""
    c = collections.Counter(op_name(n) for n in graph.nodes
                            if n.op in ("call_function", "call_method", "call_module"))
    c.pop("getitem", None)
    return dict(sorted(c.items()))


def snapshot_graph(graph: fx.Graph, val_map: dict[fx.Node, fx.Node] | None = None) -> fx.Graph:
    """A structural copy of ``graph`` (node meta dicts are shallow-copied) for rollback; ``val_map``, when given,
    is filled with each node's copy."""
    g = fx.Graph(tracer_cls=graph._tracer_cls)
    copy_graph_into(g, graph, {} if val_map is None else val_map)
    g._codegen = graph._codegen
    return g


def copy_graph_into(dst: fx.Graph, src: fx.Graph, val_map: dict[fx.Node, fx.Node]) -> None:
    """Append ``src``'s nodes and its output (with the output's meta) to ``dst``; ``val_map`` maps ``src``'s
    nodes to ``dst``'s (pre-filled entries are used for those nodes, e.g. placeholders kept)."""
    out = dst.graph_copy(src, val_map, return_output_node=True)
    out_val, out_node = out if isinstance(out, tuple) else (out, None)
    new_out = dst.output(out_val)
    if out_node is not None:
        new_out.meta = dict(out_node.meta)


def restore_graph(graph: fx.Graph, snapshot: fx.Graph) -> None:
    """Make ``graph`` equal to ``snapshot`` in place, keeping ``graph``'s own placeholder nodes (callers
    such as the partitioner know them by identity). Placeholders a failed pass added are removed."""
    snap_ph = [n for n in snapshot.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    missing = [p.name for p in snap_ph if p.name not in by_name]
    if missing:  # checked before anything is erased: the graph is left as the pass left it
        raise RuntimeError(f"cannot roll back a pass that removed graph inputs {missing}")
    keep = {by_name[p.name] for p in snap_ph}
    # Reverse order erases every user before the node it uses; then the inputs the pass added.
    for n in reversed(list(graph.nodes)):
        if n.op != "placeholder":
            graph.erase_node(n)
    for n in [n for n in graph.nodes if n not in keep]:
        graph.erase_node(n)
    copy_graph_into(graph, snapshot, {p: by_name[p.name] for p in snap_ph})


class GraphCheckpoint:
    """A rollback point of ``graph`` that copies no node: each node's op, target, arguments, name, type and a
    shallow copy of its meta, in order (fx keeps arguments in immutable containers, so a pass that rewires a
    node replaces them and never edits the recorded ones). :meth:`restore` makes the graph equal to the
    recorded one in place, as :func:`restore_graph` does with a :func:`snapshot_graph` copy: the graph's own
    placeholder nodes are kept (callers such as the partitioner know them by identity), the nodes after them
    are built again, and placeholders a failed pass added are removed. Taking one costs a tuple per node
    (a snapshot builds a second graph), so every pass hook can afford one."""

    __slots__ = ("graph", "records", "codegen")

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.records = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, dict(n.meta)) for n in graph.nodes]
        self.codegen = graph._codegen

    def restore(self) -> None:
        graph = self.graph
        placeholders = [r for r in self.records if r[1] == "placeholder"]
        missing = [r[5] for r in placeholders if getattr(r[0], "_erased", False) or r[0].graph is not graph]
        if missing:  # checked before anything is erased: the graph is left as the pass left it
            raise RuntimeError(f"cannot roll back a pass that removed graph inputs {missing}")
        keep = {r[0] for r in placeholders}
        for n in reversed(list(graph.nodes)):
            if n.op != "placeholder":
                graph.erase_node(n)
        for n in [n for n in graph.nodes if n not in keep]:
            graph.erase_node(n)
        env: dict[fx.Node, fx.Node] = {}
        for node, op, target, args, kwargs, name, type_, meta in self.records:
            if op == "placeholder":
                node.meta = dict(meta)
                env[node] = node
                continue
            new = graph.create_node(op, target, fx.map_arg(args, env.__getitem__), fx.map_arg(kwargs, env.__getitem__),
                                    name=name, type_expr=type_)
            new.meta = dict(meta)
            env[node] = new
        graph._codegen = self.codegen


def lazy_graph_module(root, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose Python code is generated when it is first read or
    called, not at construction and not at each ``recompile()`` (torch's ``_LazyGraphModule``, which Dynamo
    and Inductor use; a plain ``GraphModule`` where the installed torch lacks it). For copies that passes
    edit before anything runs them."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - feature-tested
        return fx.GraphModule(root, graph, class_name=class_name)
    return _LazyGraphModule(root, graph, class_name=class_name)


def tensor_meta(node: fx.Node) -> Any:
    """The fake/example value of a node, whichever key the graph level uses."""
    return node.meta.get("val", node.meta.get("example_value"))


def placeholder_values(graph: fx.Graph) -> list[Any]:
    return [tensor_meta(n) for n in graph.nodes if n.op == "placeholder"]


def is_tangent(node: fx.Node) -> bool:
    """A joint or backward graph's input that carries an output's gradient (``tangents_*``)."""
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def is_primal(node: fx.Node) -> bool:
    """A joint graph's forward input (``primals_*``: parameters, buffers and user inputs)."""
    return node.op == "placeholder" and str(node.target).startswith("primals")


def parameter_input_flags(example_inputs: Sequence[Any]) -> tuple[bool, ...]:
    """For each ``primals_*`` input of the joint graph AOTAutograd makes from a Dynamo graph's
    ``example_inputs``, whether it holds (a piece of) a model parameter. Tensor subclasses are flattened into
    their inner tensors (``__tensor_flatten__`` order, recursively), as AOTAutograd flattens them."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def leaves(t: Any) -> int:
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            return sum(leaves(getattr(t, n)) for n in names)
        return 1

    flags: list[bool] = []
    for x in example_inputs:
        flags += [isinstance(x, torch.nn.Parameter)] * leaves(x)
    return tuple(flags)


def parameter_only_nodes(graph: fx.Graph, flags: Sequence[bool] | None
                         ) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """``(derived, params)``: the joint graph's parameter placeholders (from :func:`parameter_input_flags`)
    and the ops computed from parameters alone (and constants): a weight's dequantization, cast or
    transpose, which a backward can recompute from the parameters instead of saving. None when ``flags``
    does not match the graph's primals (unknown: do nothing)."""
    prims = [n for n in graph.nodes if is_primal(n)]
    if flags is None or len(prims) != len(flags):
        return None
    params = {n for n, f in zip(prims, flags) if f}
    derived: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function" or is_random_op(n):
            continue
        if all(i in params or i in derived for i in n.all_input_nodes):
            derived.add(n)
    return derived, params


def forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Nodes of a joint forward+backward graph that do not depend on a tangent (and are not tagged backward by
    the partitioner), in graph order: its non-tangent placeholders and forward ops."""
    backward: set[fx.Node] = set()
    out = []
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            if is_tangent(n):
                backward.add(n)
            else:
                out.append(n)
            continue
        if n.meta.get("partitioner_tag") == "is_backward" or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        else:
            out.append(n)
    return out


def has_tangents(graph: fx.Graph) -> bool:
    """Whether ``graph`` is a training graph (joint or backward) rather than a forward or inference one."""
    return any(is_tangent(n) for n in graph.find_nodes(op="placeholder"))


def transformer_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated blocks (transformer layers): the entries of every ``ModuleList`` whose entries
    share one class (a one-layer model has one block).

    Nested repeated lists (a block inside a block) are not blocks of their own: the outermost wins.
    """
    blocks: list[tuple[str, torch.nn.Module]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < 1 or len({type(m) for m in mod}) != 1:
            continue
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(b + ".") for b, _ in blocks):
            continue  # inside an already found block
        blocks += [(f"{prefix}{i}", m) for i, m in enumerate(mod)]
    return blocks


# ------------------------------------------------------------------------------------------------------
# module paths: where a node or a graph input came from
# ------------------------------------------------------------------------------------------------------
_BRACKET = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_BOUND_SELF = re.compile(r"\.?[^.]+\.__self__")


def normalize_module_path(path: str) -> str:
    """Dynamo's ``"L['self'].model.layers.0"`` (or ``._modules['layers']['0']``) -> ``"model.layers.0"``."""
    p = path
    # The root module of the traced frame: ``self`` of a forward, or the first positional argument of a
    # ``wrapper(*args, **kwargs)`` decorator around it (transformers >= 5.24 wraps ``forward`` so).
    for prefix in ("L['self']", 'L["self"]', "L['args'][0]", 'L["args"][0]', "L['mod']", "L['fn']", "self"):
        if p == prefix or p.startswith(prefix + ".") or p.startswith(prefix + "["):
            p = p[len(prefix):]
            break
    p = p.replace("._modules", "")
    p = _BRACKET.sub(r".\1", p)
    # A forward stored on the instance as a bound method shows up as "<attr>.__self__": the object it is
    # bound to is the module that holds it, so the two segments name nothing.
    p = _BOUND_SELF.sub("", p)
    return p.strip(".")


def module_stack_of_node(node: torch.fx.Node) -> list[tuple[str, type | None]]:
    """[(module path, module class)] from outermost to innermost for a node (empty when unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, klass = value if isinstance(value, tuple) else (value, None)
        if isinstance(klass, str):
            klass = None
        out.append((normalize_module_path(str(path)), klass))
    return out


def module_path_of_node(node: torch.fx.Node) -> str:
    stack = module_stack_of_node(node)
    return stack[-1][0] if stack else ""


def source_path(node: torch.fx.Node) -> str:
    """torch-IR graphs: the dotted name of the parameter or buffer a placeholder stands for, read from
    Dynamo's ``_dynamo_source`` (``L['self']._modules['q_proj']._parameters['weight']`` ->
    ``"q_proj.weight"``); "" for user inputs and nodes without a source."""
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        return ""
    name = getattr(source, "name", "")
    name = name() if callable(name) else str(name)
    if "_parameters" not in name and "_buffers" not in name:
        return ""  # a user input (L['args'][0], L['input_ids']) or another local
    return normalize_module_path(name).replace("._parameters.", ".").replace("._buffers.", ".")


def is_buffer_source(node: torch.fx.Node) -> bool:
    """Whether a torch-IR placeholder stands for a registered buffer of the model."""
    source = getattr(node, "_dynamo_source", None)
    name = getattr(source, "name", "") if source is not None else ""
    return "_buffers" in (name() if callable(name) else str(name))


# ------------------------------------------------------------------------------------------------------
# metadata of nodes a pass creates
# ------------------------------------------------------------------------------------------------------
#: meta keys that say where a node came from (copied onto the nodes that replace it)
PROVENANCE_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")


def copy_provenance(dst: torch.fx.Node, src: torch.fx.Node, *, values: bool = False) -> None:
    """Give ``dst`` the provenance of ``src`` (and its example value, with ``values=True``)."""
    keys = PROVENANCE_KEYS + (("example_value", "val") if values else ())
    for key in keys:
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def infer_fake_values(nodes: Iterable[torch.fx.Node], *, strict: bool = False) -> bool:
    """Compute ``meta["example_value"]`` for new ``call_function`` nodes (in graph order) by running them
    under the fake mode of their inputs' example values, as Dynamo records them for its own nodes. Best
    effort: returns False (leaving the rest unset) when there is no fake mode or an op fails on fake
    tensors; AOTAutograd re-traces the graph anyway, so only passes that read values later care.
    ``strict=True``: an op that fails on fake tensors raises (for passes that check the new values).

    NOTE: torch's ``FakeTensorUpdater`` (torch._inductor.fx_utils) updates ``meta["val"]`` of a whole
    aten-level graph; torch-IR graphs keep ``example_value`` and their targets are torch functions and
    methods, so the new nodes are run here directly."""
    from torch._guards import detect_fake_mode

    from torch._subclasses.fake_tensor import FakeTensor

    nodes = list(nodes)
    inputs = [tensor_meta(a) for n in nodes for a in n.all_input_nodes]
    # NOTE: the inputs' own fake mode first: the ambient TracingContext's mode (which detect_fake_mode prefers)
    # can be another one than the mode Dynamo recorded the example values in, and fake modes cannot be mixed
    modes = {id(v.fake_mode): v.fake_mode for v in inputs if isinstance(v, FakeTensor)}
    fake_mode = next(iter(modes.values())) if len(modes) == 1 else detect_fake_mode(
        [v for v in inputs if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return False
    env: dict[torch.fx.Node, Any] = {}

    def value(a):
        return env[a] if a in env else tensor_meta(a)

    with fake_mode:
        for n in nodes:
            args = torch.fx.node.map_arg(n.args, value)
            kwargs = torch.fx.node.map_arg(n.kwargs, value)
            try:
                target = getattr(torch.Tensor, n.target) if n.op == "call_method" else n.target
                env[n] = target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - metadata is best effort
                if strict:
                    raise
                return False
            n.meta["example_value"] = env[n]
    return True



def annotate_new_nodes(nodes: Iterable[fx.Node], like: fx.Node | None = None) -> None:
    """Nodes a rewrite inserted: the provenance of the node they replace (``like``, if given) and fake example
    values, node by node in the order given (best effort: a node whose op fails on fake tensors stays
    without one; AOTAutograd re-traces the graph anyway)."""
    for n in nodes:
        if like is not None:
            copy_provenance(n, like)
        infer_fake_values([n])


def ancestors(node: fx.Node, *, include_self: bool = True) -> set[fx.Node]:
    """Every node ``node`` is computed from (and ``node`` itself, unless ``include_self=False``)."""
    seen: set[fx.Node] = set()
    stack = [node] if include_self else list(node.all_input_nodes)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return seen


def site_name(node: fx.Node) -> str:
    """How a report names a site: ``module.path:node_name`` (``<root>`` outside any module)."""
    return f"{module_path_of_node(node) or '<root>'}:{node.name}"


def erase_dead(graph: fx.Graph, nodes: Iterable[fx.Node], *, producers: bool = False) -> None:
    """Erase ``nodes`` once nothing uses them, consumers first (the matched nodes a rewrite replaced).

    ``producers=True`` also erases every pure producer that became unused through them (a repeated K/V,
    a causal mask's construction); in-place, random and impure ops are kept unless listed in ``nodes``.
    """
    nodes = list(nodes)
    must = set(nodes)
    erased: set[fx.Node] = set()
    progress = True
    while progress:  # a chain: erase from its consumer end until nothing more goes
        progress = False
        for n in nodes:
            if n in erased or n.users:
                continue
            stack = [n]
            while stack:
                x = stack.pop()
                if x in erased or x.users or (x not in must and (
                        x.op not in ("call_function", "call_method") or not _pure(x))):
                    continue
                inputs = x.all_input_nodes
                graph.erase_node(x)
                erased.add(x)
                if producers:
                    stack.extend(i for i in inputs if i not in must)
            progress = True


_RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "poisson")


def is_random_op(x: fx.Node) -> bool:
    """Whether a node draws random numbers (by its op's name: rand*, dropout, bernoulli, ...)."""
    return any(w in op_name(x).lower() for w in _RANDOM_WORDS)


def _pure(x: fx.Node) -> bool:
    return not (x.is_impure() or op_name(x).endswith("_") or is_random_op(x))


# ------------------------------------------------------------------------------------------------------
# matching torch-IR nodes (after effpass.canonicalize: one spelling per function, method and operator)
# ------------------------------------------------------------------------------------------------------
#: an additive mask value at or below this counts as "masked out" (HF uses finfo(dtype).min; fp16's is -65504)
MASK_FILL_THRESHOLD = -1e4


class Skip(Exception):
    """A site a pass looked at and left alone; the message is the reason (it goes to the report)."""


def is_fn(n: Any, fns) -> bool:
    """``n`` is a ``call_function`` node whose target is in ``fns``."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in fns


def is_method(n: Any, names) -> bool:
    """``n`` is a ``call_method`` node whose method name is in ``names``."""
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


_SOFTMAX_FNS = frozenset({torch.softmax, torch.nn.functional.softmax, torch.special.softmax})


def is_softmax(n: Any) -> bool:
    """A softmax in any of its torch-IR spellings (``torch.softmax``, ``F.softmax``, ``.softmax``)."""
    return is_fn(n, _SOFTMAX_FNS) or is_method(n, {"softmax"})


def arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` of a call, positional or by keyword ``name`` (``default`` when absent)."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def val(n: Any) -> Any:
    """The example value of a node (None for a non-node argument)."""
    return tensor_meta(n) if isinstance(n, fx.Node) else None


def shape_of(n: Any) -> tuple | None:
    """The shape of a node's tensor value, or None."""
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def size_hint(a: Any) -> int:
    """A size as a Python int without adding a guard: an int as is, a ``SymInt`` (a dynamic dim, e.g. the packed
    length ``pack_sequences`` marks dynamic) its hint, the value of the example the graph was traced with.

    NOTE(recompiles): ``int(symint)`` specialises the graph to that value (a guard), so every new packed length would
    recompile; use this for statistics and budgets, never for a size the graph computes with."""
    if isinstance(a, int):
        return int(a)
    from torch.fx.experimental import symbolic_shapes as ss

    hint = getattr(ss, "optimization_hint", None)
    if hint is not None:
        return int(hint(a))
    return int(a.node.hint)  # older torch (2.11): the SymNode carries the hint


def is_static(shape: Iterable[Any]) -> bool:
    """Every dim a Python int (no symbolic size)."""
    return all(isinstance(d, int) for d in shape)


def same_size(a: Any, b: Any, *, guard: bool = False) -> bool:
    """``a == b`` for sizes that may be symbolic, true only when provably equal (no guard added).

    ``guard=True``: sizes that are not provably equal but were equal in the traced example (two inputs whose relation
    Dynamo cannot see, e.g. the hidden states an FSDP boundary returns, with a size of their own, and the labels)
    are made equal by a guard ``a == b`` on the graph: it then only runs on inputs where they are (others
    recompile), never on sizes it was not traced for."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(a == b):
        return True
    if guard and size_hint(a) == size_hint(b):
        return bool(a == b)  # installs the guard (a symbolic relation; against an int, that int)
    return False


def same_shape(a: Iterable[Any], b: Iterable[Any], *, guard: bool = False) -> bool:
    """Shapes equal dim by dim (:func:`same_size`)."""
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(same_size(x, y, guard=guard) for x, y in zip(a, b))


def is_number(x: Any) -> bool:
    """A Python int or float constant (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------------------
# autocast: the one reader of autocast regions
# ------------------------------------------------------------------------------------------------------
ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def is_autocast_enter(node: Any) -> bool:
    return is_fn(node, {ENTER_AUTOCAST})


def is_autocast_exit(node: Any) -> bool:
    return is_fn(node, {EXIT_AUTOCAST})


class AutocastRegions:
    """Which autocast state each node of a torch-IR graph runs under: the regions Dynamo recorded
    (``_enter_autocast``/``_exit_autocast`` nodes: a model's own ``with torch.autocast``, apply_autocast's
    module wrappers) on top of the state around the compiled call (accelerate/TRL/Trainer enter autocast
    around the model call; passes run while the call is traced, so that state is the ambient one).

    Build once per graph and pass (the nodes are indexed once); rebuild after inserting autocast nodes."""

    def __init__(self, graph: fx.Graph):
        self.stack_at: dict[fx.Node, tuple] = {}
        stack: list[fx.Node] = []
        #: every exit closes an open region and every region is closed by the end of the graph
        self.balanced = True
        for n in graph.nodes:
            self.stack_at[n] = tuple(stack)
            if is_autocast_enter(n):
                stack.append(n)
            elif is_autocast_exit(n):
                if stack:
                    stack.pop()
                else:
                    self.balanced = False
        self.balanced = self.balanced and not stack

    def inside(self, node: fx.Node) -> bool:
        """Whether ``node`` runs inside a region recorded in the graph (not counting the outer autocast)."""
        return bool(self.stack_at.get(node))

    def dtype_at(self, node: fx.Node, device_type: str) -> torch.dtype | None:
        """The autocast dtype ``node`` runs under on ``device_type``, or None when autocast is off there."""
        for enter in reversed(self.stack_at.get(node, ())):
            args = list(enter.args)
            dev = args[0] if args else enter.kwargs.get("device_type")
            if dev != device_type:
                continue
            dtype = args[1] if len(args) > 1 else enter.kwargs.get("dtype")
            enabled = args[2] if len(args) > 2 else enter.kwargs.get("enabled", True)
            if not enabled:
                return None
            return dtype if isinstance(dtype, torch.dtype) else torch.get_autocast_dtype(device_type)
        return self.outer_dtype(device_type)

    @staticmethod
    def outer_dtype(device_type: str) -> torch.dtype | None:
        """The autocast dtype entered around the compiled call (accelerate, TRL), or None."""
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None


def autocast_dtype_at(graph: fx.Graph, node: fx.Node, device_type: str) -> torch.dtype | None:
    """:meth:`AutocastRegions.dtype_at` for one node (build :class:`AutocastRegions` for many)."""
    return AutocastRegions(graph).dtype_at(node, device_type)


def _import_line(name: str, obj: Any) -> str | None:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(obj, type(torch)):
        return f"import {obj.__name__} as {name}" if obj.__name__ != name else f"import {name}"
    if mod and qual and "<" not in qual:
        if "." in qual:
            return f"import {mod}\n{name} = {mod}.{qual}"
        return f"from {mod} import {qual} as {name}" if qual != name else f"from {mod} import {name}"
    return None


def _example_input(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        shape = tuple(int(s) if not isinstance(s, torch.SymInt) else 8 for s in v.shape)
        dt = str(v.dtype)
        if v.dtype.is_floating_point:
            return f"torch.randn({shape}, dtype={dt})"
        if v.dtype == torch.bool:
            return f"torch.ones({shape}, dtype=torch.bool)"
        return f"torch.zeros({shape}, dtype={dt})"
    if isinstance(v, (int, float, bool)):
        return repr(v)
    if isinstance(v, torch.SymInt):
        return "8"
    return "None"


def runnable_source(gm: fx.GraphModule, title: str = "") -> str:
    """Python source for a graph that imports and runs on its own with random inputs of the right shape."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # hooks run under a fake mode; constants are real tensors
        return _runnable_source(gm, title)


def _runnable_source(gm: fx.GraphModule, title: str) -> str:
    graph = snapshot_graph(gm.graph)
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs (joint graphs use a pytree signature)
    code = graph.python_code(root_module="self", verbose=True)
    lines = ["# " + l for l in title.splitlines()] if title else []
    lines += ["import torch", "import operator", "import math", "from math import inf, nan",
              "from torch import device", "import torch.fx._symbolic_trace",
              "try:\n    import torch._inductor.inductor_prims  # Inductor's prims (fma, ...) in joint graphs\nexcept Exception:\n    pass",
              "try:\n    import effpass.passes  # registers the passes' custom ops (torch.ops.effpass.*)\nexcept Exception:\n    pass", ""]
    for name, obj in sorted(code.globals.items()):
        if name in ("torch", "operator", "math", "inf", "nan", "device", "builtins"):
            continue
        line = _import_line(name, obj)
        if line is None:
            lines.append(f"{name} = None  # not importable: {obj!r}"[:200])
        else:
            lines.append(f"try:\n    {line.replace(chr(10), chr(10) + '    ')}\nexcept Exception:\n    {name} = None")
    body = code.src.replace("\n", "\n    ")
    lines += ["", "", "class Graph(torch.nn.Module):", "    def __init__(self):", "        super().__init__()"]
    for n in graph.nodes:  # constants the graph reads with get_attr
        if n.op != "get_attr":
            continue
        try:
            value = _getattr_path(gm, n.target)
        except AttributeError:
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() <= 64:
                init = f"torch.tensor({value.detach().cpu().tolist()!r}, dtype={value.dtype})"
            else:
                init = _example_input(value)
            lines.append(f"        setattr(self, {n.target!r}, {init})")
    lines += [f"    {body}", ""]
    inputs = [_example_input(v) for v in placeholder_values(graph)]
    lines += ["", "def example_inputs():", f"    return [{', '.join(inputs)}]", "",
              "", "if __name__ == '__main__':",
              "    with torch.no_grad():",
              "        out = Graph()(*example_inputs())",
              "    print(type(out).__name__)", ""]
    return "\n".join(lines)


def _getattr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
