"""``offload_activations``: tensors saved for backward copied to host memory in the forward and brought back
in the backward (CUDA; ALST's and Unsloth's checkpoint offloading, found in an unmodified model's graph).

What it does
    torch's partitioner has activation offloading (``torch._functorch._activation_offloading``,
    ``functorch.config.enable_activation_offloading``): a forward node of the joint graph with
    ``node.meta["should_offload"]`` that ends up saved for the backward is copied to the CPU after its last
    forward use (``ao.offload`` on a dedicated transfer stream into a pinned-memory pool, waited on where
    the forward ends) and copied back before its first backward use (``ao.reload``, moved earlier by the
    bandwidth estimate ``activation_offload_cpu_gpu_bw`` so the copy overlaps compute:
    ``activation_reload_prefetch``). This pass marks the joint graph (which forward values may be
    offloaded: floating, contiguous, not views, at least ``min_bytes``, inside ``targets``) and turns
    torch's switches on around the lowering; torch chooses among the marked values those that are saved
    (``can_offload``) and rewrites both graphs. Composed with ``checkpoint_activations(policy="full")`` the
    saved values are the block inputs: checkpoints offloaded to the host.

Device
    GPU only. On a CPU graph the pass does nothing and says so in the report (``skipped``), unless
    ``cpu="emulate"``: the same marks and torch's synchronous rewrite (``prims.device_put`` to the CPU and
    back to the graph's device, here CPU to CPU), for tests of which tensors move and where the copies sit.
    ``cpu="error"`` raises instead.

Exactness
    Lossless (a copy there and back).

Phases
    ``joint`` (marks), ``compile_config`` (torch's offloading switches), ``post_grad`` (statistics).

Statistics
    ``marked`` (joint nodes), ``offloaded`` / ``offloaded_bytes`` (forward copies to the host and their bytes),
    ``reloaded`` (backward copies back); ``skipped`` with the reason on CPU.

Untested on GPU (no GPU in the session that wrote it): the stream variant (``ao.offload``/``ao.reload``/
``ao.wait_tensor``), its overlap with compute, pinned memory, and the memory it saves.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.fx as fx

import effpass
from effpass.graph import forward_nodes, tensor_meta

__all__ = ["OffloadActivations", "offload_supported"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def offload_supported() -> bool:
    """Whether the installed torch's partitioner can offload activations (feature test)."""
    import torch._functorch.config as fc

    return hasattr(fc, "enable_activation_offloading")


def _forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """call_function nodes of the joint graph that do not depend on a tangent."""
    return [n for n in forward_nodes(graph) if n.op == "call_function"]


def _is_offload(n: fx.Node) -> bool:
    return n.op == "call_function" and n.name.startswith("cpu_offload_")


def _is_reload(n: fx.Node) -> bool:
    return n.op == "call_function" and n.name.startswith("gpu_reload_")


@effpass.register_pass("offload_activations", run_after=("checkpoint_activations", "tile_sequence", "apply_autocast"))
@dataclass(frozen=True, kw_only=True)
class OffloadActivations(effpass.Pass):
    """Saved-for-backward activations offloaded to pinned host memory (CUDA), reloaded before use.

    Joint graph: forward values marked ``meta["should_offload"] = True``. Forward graph after torch's
    rewrite (stream variant)::

        add_3 = aten.add(...); ...                         # last forward use of add_3
        cpu_offload_add_3 = ao.offload(add_3); ...         # D2H on the transfer stream, pinned buffer
        wait = ao.wait_tensor(cpu_offload_add_3)           # before the forward returns
        return (out, ..., wait)

    Backward: ``gpu_reload_add_3 = ao.reload(cpu_offload_add_3, cuda)`` scheduled ahead of its use and
    ``ao.wait_tensor`` right before it.
    """

    #: the planner's replay on CPU for a CUDA target runs this pass as cpu="emulate" and counts its copies to the
    #: host as host memory (effpass/planning/host_memory.py)
    host_offload: ClassVar[bool] = True

    min_bytes: int = field(default=1 << 20, metadata={
        "doc": "saved tensors smaller than this stay on the device (transfers of small tensors waste bandwidth)"})
    separate_stream: bool = field(default=True, metadata={
        "doc": "copies on a dedicated CUDA stream overlapping compute (torch's ao.offload/ao.reload); False: "
               "synchronous device_put"})
    prefetch: bool = field(default=True, metadata={
        "doc": "issue each reload early enough to overlap compute (torch's bandwidth-based schedule)"})
    cpu: Literal["skip", "error", "emulate"] = field(default="skip", metadata={
        "doc": "on a CPU graph: 'skip' (reported), 'error', or 'emulate' (tests: the synchronous rewrite, "
               "CPU to CPU)"})

    @classmethod
    def memory_options(cls, model=None, *, world_size=1, device=None):
        """For the memory planner: lossless, host memory for device memory (CUDA only: none for a plan on
        another device, or for a model whose parameters are on the CPU when the device is not given)."""
        if device is not None and torch.device(device).type != "cuda":
            return []
        if device is None and model is not None and any(p.device.type == "cpu" for p in model.parameters()):
            return []
        return [effpass.MemoryOption(technique="offload_activations", options={}, lossless=True,
                                     group="activation_offload", changes="activations", label="offload",
                                     cost="saved activations copied to host memory and back over PCIe "
                                          "(overlapped with compute on a side stream; CUDA only)"),
                # the synchronous copies free each device tensor at its last forward use (the stream variant holds
                # them until the forward ends) but do not overlap compute
                effpass.MemoryOption(technique="offload_activations", options={"separate_stream": False},
                                     lossless=True, group="activation_offload", changes="activations",
                                     label="offload (sync)", order=1,
                                     cost="saved activations copied to host memory at their last forward use and "
                                          "back at their first backward use, not overlapped with compute (CUDA only)")]

    @classmethod
    def default_note(cls) -> str:
        return "off (CUDA only: host memory for device memory; opt in)"

    def validate(self) -> None:
        if self.min_bytes < 0:
            raise ValueError(f"offload_activations.min_bytes: {self.min_bytes!r} must be >= 0")

    def _device_ok(self, device) -> bool:
        return device is not None and torch.device(device).type == "cuda"

    def _emulating(self, device) -> bool:
        return not self._device_ok(device) and self.cpu == "emulate"

    # -- torch's switches ----------------------------------------------------------------------------
    def compile_config(self, ctx) -> dict:
        device = ctx.get("device")
        if not self._device_ok(device) and self.cpu != "emulate":
            if self.cpu == "error":
                raise ValueError(f"offload_activations: the graph is on {device}, not CUDA; activation offload "
                                 "to host memory needs a CUDA device (cpu='skip' leaves CPU graphs alone)")
            return {}
        if not offload_supported():
            raise RuntimeError(f"offload_activations: torch {torch.__version__} has no partitioner activation "
                               "offloading (functorch.config.enable_activation_offloading)")
        import torch._functorch.config as fc

        stream = self.separate_stream and self._device_ok(device)
        want = {"enable_activation_offloading": True, "activation_offload_separate_stream": stream,
                "activation_offload_sink_wait": stream, "activation_reload_prefetch": stream and self.prefetch}
        # NOTE(versions): only the switches the installed torch has (the stream ones are newer)
        return {f"functorch.{k}": v for k, v in want.items() if hasattr(fc, k)}

    def lowering_context(self, ctx):
        """Around the lowering (the partition runs torch's offloading): forward outputs that are not graph values
        (``None``) kept out of torch's rewrite (:func:`_none_outputs_kept_out`)."""
        return _none_outputs_kept_out() if offload_supported() else None

    # -- joint: marks ----------------------------------------------------------------------------------
    def transform_joint(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        if ctx.graph_kind != "joint":
            return effpass.PassResult(skipped=[{"site": "graph", "reason": "inference graph: nothing is saved"}])
        if not self._device_ok(ctx.device) and not self._emulating(ctx.device):
            return effpass.PassResult(skipped=[{"site": "graph", "reason": f"graph on {ctx.device}: offload to "
                                                "host memory needs CUDA (cpu='emulate' tests the rewrite on CPU)"}])
        nodes = ctx.scope.select_nodes(gm, _forward_nodes(gm.graph), what="forward op")
        marked = 0
        small = 0
        for n in nodes:
            val = tensor_meta(n)
            if (not isinstance(val, torch.Tensor) or val.dtype not in _FLOATS or n.target is operator.getitem
                    or (isinstance(n.target, torch._ops.OpOverload) and n.target.is_view)):
                continue
            if not all(isinstance(s, int) for s in val.shape) or not val.is_contiguous():
                continue
            if val.numel() * val.element_size() < self.min_bytes:
                small += 1
                continue
            n.meta["should_offload"] = True
            marked += 1
        return effpass.PassResult(changed=bool(marked), stats={"marked": marked, "below_min_bytes": small})

    # -- post-grad: what torch did -----------------------------------------------------------------------
    def transform_post_grad(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        if ctx.graph_kind == "forward":
            offl = [n for n in gm.graph.nodes if _is_offload(n)]
            nbytes = 0
            for n in offl:
                v = tensor_meta(n)
                if isinstance(v, torch.Tensor):
                    nbytes += v.numel() * v.element_size()
            return effpass.PassResult(stats={"offloaded": len(offl), "offloaded_bytes": nbytes})
        if ctx.graph_kind == "backward":
            return effpass.PassResult(stats={"reloaded": sum(1 for n in gm.graph.nodes if _is_reload(n))})
        return None


@contextlib.contextmanager
def _none_outputs_kept_out():
    """torch's ``enable_activation_offloading`` with the forward graph's non-node outputs taken out around it.

    NOTE(torch 2.13): ``offload_activation_fw`` (and its async and ``offload_chosen_sets`` siblings) read ``.meta``
    and ``.name`` of every forward output; a forward that returns ``None`` among the model's outputs (the logits
    under ``fuse_cross_entropy``) raised ``AttributeError: 'NoneType' object has no attribute 'meta'`` in the
    partition, so no pipeline with the fused loss could offload. The ``None`` entries are removed from the output
    (the count of model outputs lowered by those before it), torch rewrites the rest, and they are put back at
    their places (torch maps the output tuple element by element, so the order is kept)."""
    from torch._functorch._activation_offloading import activation_offloading as mod

    orig = mod.enable_activation_offloading

    def kept_out(fwd_module, bwd_module, num_fwd_outputs, *args, **kwargs):
        out = fwd_module.graph.find_nodes(op="output")[0]
        vals = list(out.args[0])
        holes = {i for i, v in enumerate(vals) if not isinstance(v, fx.Node)}
        if not holes:
            return orig(fwd_module, bwd_module, num_fwd_outputs, *args, **kwargs)
        out.update_arg(0, tuple(v for i, v in enumerate(vals) if i not in holes))
        try:
            return orig(fwd_module, bwd_module, num_fwd_outputs - sum(1 for i in holes if i < num_fwd_outputs),
                        *args, **kwargs)
        finally:
            done = iter(out.args[0])
            out.update_arg(0, tuple(v if i in holes else next(done) for i, v in enumerate(vals)))

    mod.enable_activation_offloading = kept_out
    try:
        yield
    finally:
        mod.enable_activation_offloading = orig
