"""``inject_lora``: LoRA adapters on the targeted linears, trained under compile, in PEFT's format.

Phases:

* module (``prepare_module``): wraps every targeted linear-like module (``nn.Linear``, GPT-2's ``Conv1D``,
  fused projections such as Phi's ``qkv_proj``, and quantized linears that declare
  ``__effpass_linear__ = True``) in a :class:`~effpass.passes.lora.LoRALinear` holding real
  ``nn.Parameter`` adapters, and freezes every other parameter. This must happen on the eager model:
  the adapters must exist before the user builds the optimizer and must be in ``state_dict()``.
* torch IR (``transform_torch_ir``): adapters that read the same input (q/k/v; gate/up) compute their
  down-projections ``x @ A_i^T`` as one matmul on the concatenated ``A`` weights, then split the result.
  With dropout > 0 every adapter draws its own mask (as PEFT), so their inputs differ and they are left
  alone (reported in ``skipped``).

Ordering: runs after ``quantize_linear`` (NOTE(ordering): adapters wrap the quantized base, as QLoRA does;
the other order would quantize the adapters' base while they hold a reference to the float one).

Invariants: after ``prepare_module`` the eager model computes ``W x + b + scaling * B A dropout(x)``
(reference semantics), with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``); the
torch-IR rewrite changes only how the ``A`` products are grouped, never what is computed.

Save, load, merge and unmerge live in :mod:`effpass.passes.lora` and are re-exported here.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx

import effpass
from effpass.graph import copy_provenance, infer_fake_values, source_path
from effpass.linear_like import direct_weight_read
from effpass.scope import Scope, check_patterns, glob_match, glob_match_within

from . import lora
from .lora import LoRALinear, load, merge, save, unmerge  # noqa: F401  (the public helpers)

__all__ = ["InjectLoRA", "save", "load", "merge", "unmerge", "LoRALinear"]


@effpass.register_pass("inject_lora", run_after=("quantize_linear",))
@dataclass(frozen=True, kw_only=True)
class InjectLoRA(effpass.Pass):
    """Add trainable low-rank adapters to the targeted linears and freeze everything else.

    Module level, for ``targets=["*.q_proj", "*.v_proj"]``::

        before: q_proj = Linear(64, 64)
        after:  q_proj = LoRALinear(base_layer=Linear(64, 64) [frozen],
                                    lora_A=Linear(64, r), lora_B=Linear(r, 64) [zero init])
                q_proj(x) == base_layer(x) + alpha/r * lora_B(lora_A(dropout(x)))

    Torch IR, q/k/v adapters reading the same ``x`` (dropout 0)::

        before: a_q = linear(x, A_q); a_k = linear(x, A_k); a_v = linear(x, A_v)
        after:  a = linear(x, cat([A_q, A_k, A_v])); a_q, a_k, a_v = split(a, [r, r, r], -1)
    """

    rank: int = field(default=8, metadata={"doc": "adapter rank r"})
    alpha: float = field(default=16.0, metadata={"doc": "scaling numerator: the update is scaled by alpha/r"})
    dropout: float = field(default=0.0, metadata={"doc": "dropout probability on the adapter input (0 <= p < 1)"})
    use_rslora: bool = field(default=False, metadata={"doc": "rank-stabilised scaling alpha/sqrt(r) instead of alpha/r"})
    init: Literal["kaiming", "gaussian"] = field(
        default="kaiming", metadata={"doc": "A's initialisation (B is always zero): kaiming-uniform as PEFT, or N(0, 1/r)"})
    adapter_dtype: torch.dtype | None = field(
        default=None, metadata={"doc": "adapter weight dtype; None: the base dtype, fp32 for fp16/bf16 bases (as PEFT)"})
    merge_shared_inputs: bool = field(
        default=True, metadata={"doc": "compute the A products of adapters sharing an input as one matmul"})

    def validate(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"inject_lora: rank must be > 0, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"inject_lora: alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"inject_lora: dropout must be in [0, 1), got {self.dropout}")
        if self.adapter_dtype is not None and not self.adapter_dtype.is_floating_point:
            raise ValueError(f"inject_lora: adapter_dtype must be a floating dtype, got {self.adapter_dtype}")

    # ---- module phase ----------------------------------------------------------------------------
    def prepare_module(self, model: torch.nn.Module, ctx) -> effpass.PassResult:
        def candidate(name: str, mod: torch.nn.Module) -> bool:
            # Adapters' own lora_A/lora_B and an adapter's base_layer are not candidates; a module that
            # already has an adapter is (it matches the targets) but is left as it is.
            return (isinstance(mod, LoRALinear) or lora.is_linear_like(mod)) and ".lora_" not in name \
                and not name.endswith(".base_layer")

        # MoE expert tensors (3-D parameters) are adapted when a targets glob names the tensor itself
        # (``*.experts.gate_up_proj``); the other globs select linear modules as before.
        expert_params = lora.expert_parameters(model)
        expert_globs = [g for g in self.targets if any(glob_match(n, g) for n in expert_params)]
        module_globs = [g for g in self.targets if g not in expert_globs]
        experts = [n for n in expert_params if glob_match(n, expert_globs)
                   and ctx.scope.matches_globs(n) is not False and not _excluded(n, self.exclude)]
        linear_names = [n for n, m in model.named_modules() if n and candidate(n, m)]
        already = lora.lora_modules(model)
        if not linear_names and not already and not experts:
            raise ValueError(f"inject_lora: the model ({type(model).__name__}) has no linear-like module "
                             "(nn.Linear, Conv1D, or a module with __effpass_linear__) to put adapters on")
        if expert_globs and not module_globs:
            selected = []
            for g in self.exclude:  # the exclude globs are still checked against the names that exist
                check_patterns("inject_lora", (), (g,), [n for n, _ in model.named_modules() if n]
                                             + list(expert_params))
        else:
            scope = ctx.scope if not expert_globs else Scope(
                "inject_lora", tuple(module_globs), self.exclude, root=model)
            selected = scope.select_modules(model, candidate, what="linear")
            if not selected:
                raise effpass.TargetMatchError(
                    f"inject_lora: targets {list(self.targets)} / exclude {list(self.exclude)} leave no linear module; "
                    f"linear names here include: {', '.join(repr(n) for n in linear_names[:8])}"
                    f"{' ...' if len(linear_names) > 8 else ''}")
        # NOTE(direct reads): a linear whose weight its parent reads directly (Mamba's dt_proj.weight @ x) would
        # bypass an adapter on that path: the adapter would not train there while the statistics counted it
        bypassed = {n: direct_weight_read(model, n) for n, m in selected if not isinstance(m, LoRALinear)}
        bypassed = {n: why for n, why in bypassed.items() if why}
        names = lora.inject(model, [n for n, m in selected if not isinstance(m, LoRALinear) and n not in bypassed],
                            rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                            use_rslora=self.use_rslora, init=self.init, dtype=self.adapter_dtype)
        had = lora.expert_lora_modules(model)
        expert_names = lora.inject_experts(model, [n for n in experts if n not in had], rank=self.rank,
                                           alpha=self.alpha, dropout=self.dropout, use_rslora=self.use_rslora,
                                           init=self.init, dtype=self.adapter_dtype)
        lora.freeze_base(model)
        ex = lora.expert_lora_modules(model)
        stats = {"adapters": len(names), "adapter_params": sum(
            m.lora_A.weight.numel() + m.lora_B.weight.numel() for n, m in lora.lora_modules(model).items() if n in names)}
        if experts:
            stats["expert_adapters"] = len(expert_names)
            stats["expert_adapter_params"] = sum(ex[n].lora_A.numel() + ex[n].lora_B.numel() for n in expert_names)
            # what PEFT's ParamWrapper allocates per forward and effpass never does: the delta of every adapted
            # expert tensor (E x d1 x d2 in the weight's dtype)
            stats["delta_weight_bytes_avoided"] = sum(
                getattr(expert_params[n][0], expert_params[n][1]).numel() * ex[n].lora_A.element_size()
                for n in expert_names)
            stats["adapter_params"] += stats["expert_adapter_params"]
        stats.update(lora.parameter_stats(model))
        stats["modules"] = names
        if experts:
            stats["expert_parameters"] = expert_names
        skipped = [{"site": n, "reason": "already has a LoRA adapter"} for n, m in selected if isinstance(m, LoRALinear)]
        skipped += [{"site": n, "reason": f"an nn.Linear subclass with a forward of its own ({type(m).__name__}): "
                                          "not a plain linear map, an adapter would change what it returns"}
                    for n, m in model.named_modules() if n and lora.overrides_linear_forward(m)
                    and ctx.scope.matches_globs(n) is not False and not _excluded(n, self.exclude)]
        skipped += [{"site": n, "reason": "already has a LoRA adapter"} for n in experts if n in had]
        skipped += [{"site": n, "reason": f"{why}, outside the linear's forward: an adapter there would be bypassed on "
                                          "that path (it would not train there)"} for n, why in bypassed.items()]
        why = "" if (names or expert_names) else (f"every selected module's weight is read directly by its parent "
                                                  f"({len(bypassed)}: see 'skipped')" if bypassed else
            f"every selected module already has a LoRA adapter ({len(skipped)}; a model prepared before keeps its "
            "adapters: nothing new to inject)" if skipped else "no module selected")
        return effpass.PassResult(changed=bool(names or expert_names), stats=stats, skipped=skipped, why_unchanged=why)

    # ---- torch-IR phase --------------------------------------------------------------------------
    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        a_weights = _lora_a_placeholders(gm, ctx)
        stats = {"adapters_in_graph": 0, "merged_groups": 0, "merged_adapters": 0}
        skipped: list[dict] = []
        if not a_weights:
            return effpass.PassResult(changed=False, stats=stats, why_unchanged=(
                "no LoRA adapter is called in this graph (its modules have none, or they are outside targets)"))
        groups: dict[fx.Node, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            if not _is_linear(node) or len(node.args) < 2 or node.args[1] not in a_weights:
                continue
            stats["adapters_in_graph"] += 1
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if bias is not None:
                continue
            if not ctx.allows(node):
                skipped.append({"site": a_weights[node.args[1]], "reason": "out of scope (targets/exclude/skip)"})
                continue
            groups.setdefault(_input_key(node.args[0]), []).append(node)
        if not self.merge_shared_inputs:
            return effpass.PassResult(changed=False, stats=stats, skipped=skipped)
        changed = False
        for key, nodes in groups.items():
            x = nodes[0].args[0]  # the first in graph order: defined before every linear of the group
            if len(nodes) < 2:
                site = a_weights[nodes[0].args[1]]
                reason = ("dropout > 0: each adapter draws its own mask, so no two adapters share an input"
                          if _is_dropout(x) else "no other adapter reads this input")
                skipped.append({"site": site, "reason": reason})
                continue
            _merge_group(gm.graph, x, nodes)
            stats["merged_groups"] += 1
            stats["merged_adapters"] += len(nodes)
            changed = True
        return effpass.PassResult(changed=changed, stats=stats, skipped=skipped)


def _excluded(name: str, exclude) -> bool:
    return glob_match_within(name, exclude)


# ------------------------------------------------------------------------------------------------------
# torch-IR helpers
# ------------------------------------------------------------------------------------------------------
_LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _LINEAR_TARGETS


def _is_dropout(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (
        torch.nn.functional.dropout, torch.dropout, torch._C._nn.dropout if hasattr(torch._C._nn, "dropout") else None)


def _input_key(x):
    """Adapters reading ``x.to(dtype)`` of the same ``x`` share their input (each adapter casts its own)."""
    if isinstance(x, fx.Node) and x.op == "call_method" and x.target == "to" and not x.kwargs:
        return ("to", _input_key(x.args[0]), tuple(a for a in x.args[1:]))
    return x


def _lora_a_placeholders(gm: fx.GraphModule, ctx) -> dict[fx.Node, str]:
    """Placeholders of the graph that are ``lora_A`` weights -> the adapted module's name.

    Found by identity with the model's adapter parameters (Dynamo hands over the real ``nn.Parameter``),
    else by the placeholder's Dynamo source name (graphs of submodules compiled on their own, e.g. FSDP
    units, whose parameters are swapped for unsharded tensors)."""
    model = ctx.model
    by_id = {id(m.lora_A.weight): name for name, m in lora.lora_modules(model).items()} if model is not None else {}
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = list(ctx.example_inputs) if ctx.example_inputs is not None else [None] * len(placeholders)
    for node, value in zip(placeholders, values):
        if isinstance(value, torch.Tensor) and id(value) in by_id:
            out[node] = by_id[id(value)]
            continue
        path = source_path(node)
        if path.endswith(".lora_A.weight"):
            out[node] = path[: -len(".lora_A.weight")]
    return out


def _merge_group(graph: fx.Graph, x: fx.Node, nodes: list[fx.Node]) -> None:
    """``linear(x, A_i)`` for every i -> one ``linear(x, cat(A_i))`` split back into the i parts."""
    first = min(nodes, key=lambda n: list(graph.nodes).index(n))
    ranks = [n.meta["example_value"].shape[-1] if "example_value" in n.meta else None for n in nodes]
    with graph.inserting_before(first):
        weights = [n.args[1] for n in nodes]
        cat = graph.call_function(torch.cat, (weights, 0))
        fused = graph.call_function(torch._C._nn.linear, (x, cat))
        if None in ranks:
            sizes = [graph.call_method("size", (w, 0)) for w in weights]
        else:
            sizes = [int(r) for r in ranks]
        parts = graph.call_function(torch.split, (fused, sizes, -1))
        for i, n in enumerate(nodes):
            part = graph.call_function(operator.getitem, (parts, i))
            copy_provenance(part, n, values=True)
            n.replace_all_uses_with(part)
    for src in (cat, fused, parts):
        copy_provenance(src, first)
    # example values for passes that run after this one and read them (fake tensors, as Dynamo's)
    if all(isinstance(s, int) for s in sizes):
        infer_fake_values([cat, fused, parts])
    for n in nodes:
        graph.erase_node(n)
