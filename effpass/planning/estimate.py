"""Predict the peak memory of one training step by replaying it on fake tensors (:func:`estimate_memory`;
several pipelines of one model at once: :func:`estimate_many`).

The replay itself (fake copies, the backend built directly, two steps, the second tracked) is
:mod:`effpass.planning.replay`; its allocation tracker :mod:`effpass.planning.tracker`; the patches of torch
it needs :mod:`effpass.planning.patches`. Models with many identical blocks are replayed at 2, 3 and 4 blocks
and extrapolated (checked affine, :mod:`effpass.planning.depth`), the depths spread over forked workers
(:mod:`effpass.planning.pool`). Another optimizer than AdamW is built on fake parameters of the trainable
shapes (:func:`with_optimizer`).
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch

from .depth import AUTO_MIN_BLOCKS, DEPTHS, Unconfirmed, block_list, combine_depths, first_blocks
from .patches import replay_patches
from .pool import in_workers, plan_workers
from .replay import check_optimizer, module_groups, replay_many, target_device
from .optimizer_replay import optimizer_replay, with_optimizer  # noqa: F401  (re-exported)
from .result import MemoryEstimate, format_bytes, parse_size, training_step  # noqa: F401  (re-exported)
from .start_bytes import start_bytes_many  # noqa: F401  (re-exported)
from .tracker import replay_kernel  # noqa: F401  (re-exported: passes/step_in_backward uses it)

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_many", "confirm_many", "replay_at_depths", "estimate_units", "start_bytes_many", "training_step",
           "format_bytes", "parse_size", "with_optimizer", "optimizer_replay", "replay_patches", "replay_kernel",
           "fold_fsdp"]


def estimate_memory(model: torch.nn.Module, example_inputs, passes=None, optimizer: str | None = "adamw",
                    world_size: int = 1, *, device=None, loss_fn: Callable | None = None,
                    lr: float = 1e-3, extrapolate: bool | None = None, **compile_options) -> MemoryEstimate:
    """Predict the peak memory of one steady-state training step of ``model`` compiled with effpass.

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments (as Hugging Face
    models take them); real, fake or meta tensors (only shapes and dtypes are read). ``passes`` and
    ``compile_options`` (``lowering``, ``strict``, ``disable``, ...) are those of :func:`effpass.compile`.
    ``optimizer``: ``"adamw"`` (``torch.optim.AdamW`` over the trainable parameters), any name registered
    with ``effpass.register_optimizer`` (``"adamw8bit"``: torchao's 8-bit states; built on fake parameters,
    see :func:`with_optimizer`; ``"adamw_host"``: ``effpass.HostOffloadAdamW``, registered ``replayed=True``, so run
    inside the replayed step) or ``None`` (no optimizer: gradients are dropped after backward).
    ``world_size > 1``: per-rank figures under FSDP (ZeRO-3) sharding, see :func:`fold_fsdp`.
    ``device``: the device to predict for (default: the model's; a meta model is predicted for the CPU).

    The model is not changed: the replay works on a fake copy (no weights are allocated), so a model
    built on the meta device at full size (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``)
    works. Several pipelines of one model: :func:`estimate_many` (shares the capture between them).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"estimate_memory expects an nn.Module, got {type(model).__name__}")
    check_optimizer(optimizer)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(example_inputs, (tuple, list, Mapping, torch.Tensor)):
        raise TypeError(f"example_inputs must be a tuple of arguments or a dict of keyword arguments, got "
                        f"{type(example_inputs).__name__}")
    t0 = time.perf_counter()
    from effpass.memory_options import replayed_optimizer

    if not replayed_optimizer(optimizer):  # the AdamW replay's forward/backward, the optimizer built on fakes
        est = estimate_memory(model, example_inputs, passes, "adamw", 1, device=device, loss_fn=loss_fn, lr=lr,
                              extrapolate=extrapolate, **compile_options)
        est = with_optimizer(est, optimizer, device=est.device, lr=lr)
    else:
        (est,) = estimate_many(model, example_inputs, [passes], optimizer, device=device, loss_fn=loss_fn, lr=lr,
                               extrapolate=extrapolate, **compile_options)
        if isinstance(est, BaseException):
            raise est
    if world_size > 1:
        est = fold_fsdp(est, world_size, est.largest_unit_bytes)
    est.seconds = time.perf_counter() - t0
    return est


def estimate_many(model: torch.nn.Module, example_inputs, pipelines: Sequence, optimizer: str | None = "adamw", *,
                  device=None, loss_fn: Callable | None = None, lr: float = 1e-3, extrapolate: bool | None = None,
                  share: bool = True, workers: int | None = None, screen: bool = False, check: Sequence[int] = (),
                  **compile_options) -> list:
    """:func:`estimate_memory` of ``model`` under each pipeline of ``pipelines`` (one rank; ``optimizer``
    ``"adamw"`` or ``None``), sharing work between them: pipelines whose module phase is the same (the same
    module-level passes, e.g. the same quantized base and adapters) are replayed on one fake copy with one
    Dynamo capture, each compiling the captured graphs with its own graph-level passes; with depth
    extrapolation each depth is replayed once for all of them. Returns, per pipeline, its
    :class:`MemoryEstimate` (the same bytes as ``estimate_memory`` alone) or the exception its replay
    raised (not raised here).

    ``workers``: processes that replay the extrapolation's depths at once (forked from this one, Linux only;
    default ``EFFPASS_PLAN_WORKERS`` or up to 2 where this process may use 2 cores; 1: all in this process).
    A worker that fails hands its depths back to this process.

    ``screen`` (extrapolated models only): each pipeline is replayed at the first two depths (2 and 3 blocks),
    not three; where the peak is at the same node at both, its estimate is the affine prediction through them,
    marked ``provisional`` (:func:`confirm_many` replays the third depth and checks it; the planner confirms
    every plan it chooses or names as the smallest). Where the peak moved, the pipeline is confirmed here.
    ``check``: indices of pipelines replayed at all three depths all the same (known to need a checked
    figure; their third depth is replayed beside the others' first two, over the same workers)."""
    return estimate_units(model, [(example_inputs, pipelines)], optimizer, device=device, loss_fn=loss_fn, lr=lr,
                          extrapolate=extrapolate, share=share, workers=workers, screen=screen, check=[check],
                          **compile_options)[0]


def estimate_units(model: torch.nn.Module, units: Sequence, optimizer: str | None = "adamw", *, device=None,
                   loss_fn: Callable | None = None, lr: float = 1e-3, extrapolate: bool | None = None,
                   share: bool = True, workers: int | None = None, screen: bool = False,
                   check: Sequence[Sequence[int]] | None = None, **compile_options) -> list[list]:
    """:func:`estimate_many` of several inputs at once: ``units`` is a list of ``(example_inputs, pipelines)``;
    returns per unit what ``estimate_many(model, example_inputs, pipelines, ...)`` returns, the same figures,
    with every unit's depths replayed over the workers together (one pool for all: the tile-count extrapolation's
    short lengths, :mod:`effpass.planning.tiles`). ``check``: per unit, as ``estimate_many``'s."""
    from effpass.memory_options import replayed_optimizer

    if not replayed_optimizer(optimizer):
        raise ValueError(f"estimate_many: optimizer {optimizer!r} is not replayed: only 'adamw', None and optimizers "
                         f"registered with replayed=True (e.g. 'adamw_host') are; other optimizers: with_optimizer on "
                         f"the AdamW replay")
    t0 = time.perf_counter()
    dev = target_device(model, device)
    units = [(inputs, list(pipelines)) for inputs, pipelines in units]
    check = list(check) if check is not None else [()] * len(units)
    outs: list = [[None] * len(p) for _, p in units]
    todos = [list(range(len(p))) for _, p in units]
    blocks = block_list(model) if extrapolate is not False else None
    if blocks is not None and len(blocks) > max(DEPTHS) and (extrapolate or len(blocks) >= AUTO_MIN_BLOCKS):
        flat, index, bases = [], [], []  # every unit's pipelines in one list: (unit, pipeline) per flat index
        for u, (_, pipes) in enumerate(units):
            bases.append(len(flat))
            index += [(u, i) for i in range(len(pipes))]
            flat += pipes
        checked = [set(range(len(p))) if not screen else set(c) for (_, p), c in zip(units, check)]
        depths_of = [DEPTHS if not screen else DEPTHS[:2] for _ in units]
        jobs = [(inputs, [j for j, (u_, i) in enumerate(index) if u_ == u and (k in depths_of[u] or i in checked[u])], k)
                for u, (inputs, _) in enumerate(units) for k in DEPTHS]
        got = _depth_units(model, flat, [j for j in jobs if j[1]], optimizer, dev, loss_fn, lr, compile_options, share,
                           workers, blocks)
        per = {}  # (flat index, depth) -> replay
        for (_, idx, k), res in zip([j for j in jobs if j[1]], got):
            per.update({(j, k): r for j, r in zip(idx, res)})
        for u, (inputs, pipes) in enumerate(units):
            out, todo, unsure = outs[u], [], []
            base = bases[u]
            for i in range(len(pipes)):
                ests = [per[(base + i, k)] for k in DEPTHS if (base + i, k) in per]
                bad = next((e for e in ests if isinstance(e, BaseException)), None)
                if bad is not None and not isinstance(bad, RuntimeError):
                    out[i] = bad  # a user error (bad targets, options): as the replay alone raises it
                    continue
                est = None if bad is not None else combine_depths(ests, len(blocks))
                if est is None and screen and bad is None and len(ests) == 2:
                    unsure.append(i)  # the peak moved between the two depths: the third depth decides
                elif est is None:
                    todo.append(i)  # not affine (or a depth failed): the full model is replayed
                else:
                    est.seconds = time.perf_counter() - t0
                    out[i] = est
            if unsure:
                for i, r in zip(unsure, confirm_many(model, inputs, [pipes[i] for i in unsure],
                                                     [Unconfirmed([per[(base + i, k)] for k in DEPTHS[:2]])
                                                      for i in unsure], optimizer, device=device, loss_fn=loss_fn,
                                                     lr=lr, share=share, workers=workers, **compile_options)):
                    out[i] = r
            todos[u] = todo
    for u, (inputs, pipes) in enumerate(units):
        _replay_whole(model, inputs, pipes, todos[u], outs[u], optimizer, dev, loss_fn, lr, compile_options, share,
                      t0)
    return outs


def _replay_whole(model, example_inputs, pipelines, todo, out, optimizer, dev, loss_fn, lr, compile_options, share,
                  t0) -> None:
    """``out[i]`` for each ``i`` in ``todo``: pipeline ``i`` replayed at the model's full depth (counts not
    affine in depth, or a depth failed), or the exception raised."""
    if not todo:
        return
    full = replay_many(model, example_inputs, [pipelines[i] for i in todo], optimizer, dev, loss_fn, lr,
                        compile_options, share)
    for i, r in zip(todo, full):
        if not isinstance(r, BaseException):
            r.seconds = time.perf_counter() - t0
        out[i] = r


def confirm_many(model: torch.nn.Module, example_inputs, pipelines: Sequence, estimates: Sequence,
                 optimizer: str | None = "adamw", *, device=None, loss_fn: Callable | None = None, lr: float = 1e-3,
                 share: bool = True, workers: int | None = None, **compile_options) -> list:
    """The estimates of ``pipelines`` checked at the third depth: ``estimates`` are :func:`estimate_many`'s
    ``screen`` results for them (``provisional``, with the replays of the first two depths). Each pipeline
    is replayed at the third depth (pipelines with one module phase share the capture, depths over the
    workers as in :func:`estimate_many`) and extrapolated from all three when every count is affine in
    depth; if not, the full model is replayed. Returns per pipeline the confirmed :class:`MemoryEstimate`
    (the figures :func:`estimate_many` gives without ``screen``) or the exception its replay raised. An
    estimate that is not provisional is returned as it is."""
    t0 = time.perf_counter()
    dev = target_device(model, device)
    pipelines = list(pipelines)
    out: list = list(estimates)
    idx = [i for i, e in enumerate(estimates) if getattr(e, "depth_replays", None)]
    if not idx:
        return out
    blocks = block_list(model)
    (third,) = _replay_depths(model, example_inputs, [pipelines[i] for i in idx], DEPTHS[2:], optimizer, dev,
                              loss_fn, lr, compile_options, share, workers, blocks)
    todo = []
    for i, r in zip(idx, third):
        if isinstance(r, BaseException):
            todo.append(i)
            continue
        est = combine_depths(list(estimates[i].depth_replays) + [r], len(blocks))
        if est is None:
            todo.append(i)
        else:
            est.seconds = time.perf_counter() - t0
            out[i] = est
    _replay_whole(model, example_inputs, pipelines, todo, out, optimizer, dev, loss_fn, lr, compile_options, share, t0)
    return out


def _replay_depths(model, example_inputs, pipelines, depths, optimizer, dev, loss_fn, lr, compile_options, share,
                   workers, blocks, only: dict | None = None) -> list[list]:
    """Per depth of ``depths``, per pipeline: its replay with only the first ``depth`` blocks (or the
    exception raised; None where ``only[depth]``, a set of pipeline indices, leaves it out)."""
    only = only or {}
    units = [(example_inputs, [i for i in range(len(pipelines)) if k not in only or i in only[k]], k) for k in depths]
    got = _depth_units(model, pipelines, units, optimizer, dev, loss_fn, lr, compile_options, share, workers, blocks)
    per_depth = [[None] * len(pipelines) for _ in depths]
    for (_, idx, k), res in zip(units, got):
        for i, r in zip(idx, res):
            per_depth[depths.index(k)][i] = r
    return per_depth


def replay_at_depths(model: torch.nn.Module, units: Sequence, optimizer: str | None = "adamw", *, device=None,
                     loss_fn: Callable | None = None, lr: float = 1e-3, share: bool = True, workers: int | None = None,
                     **compile_options) -> list[list]:
    """Replays of ``model`` with only its first blocks, several at once: ``units`` is a list of
    ``(example_inputs, pipelines, depth)``; returns per unit, per pipeline, the replay of the first ``depth``
    blocks (a :class:`MemoryEstimate` of that shorter model, not extrapolated) or the exception raised. Every
    unit's work (one depth of one module phase) is spread over the workers together, so replays of different
    lengths and depths run at once (the tile-count extrapolation's checks, :mod:`effpass.planning.tiles`)."""
    dev = target_device(model, device)
    blocks = block_list(model)
    if blocks is None:
        raise ValueError("replay_at_depths: the model has no list of identical blocks")
    flat, units_i = [], []
    for inputs, pipes, k in units:
        units_i.append((inputs, list(range(len(flat), len(flat) + len(pipes))), k))
        flat += list(pipes)
    got = _depth_units(model, flat, units_i, optimizer, dev, loss_fn, lr, compile_options, share, workers, blocks)
    return [list(r) for r in got]


def _depth_units(model, pipelines, units, optimizer, dev, loss_fn, lr, compile_options, share, workers,
                 blocks) -> list[list]:
    """Per unit ``(example_inputs, pipeline indices, depth)``: the replays of those pipelines with the first
    ``depth`` blocks. The work units spread over the workers: one depth of one module phase (its plans share a
    capture)."""
    jobs = []
    for u, (inputs, idx, k) in enumerate(units):
        groups = (module_groups([pipelines[i] for i in idx], dev, compile_options) if share
                  else [[j] for j in range(len(idx))])
        jobs += [(u, inputs, k, [idx[j] for j in g]) for g in groups if g]

    def replay_job(job):
        _, inputs, k, g = job
        with first_blocks(blocks, k):
            return replay_many(model, inputs, [pipelines[i] for i in g], optimizer, dev, loss_fn, lr,
                                compile_options, share)

    results = in_workers(replay_job, jobs, [(k + 2) * (len(g) + 1) * _size(inputs) for _, inputs, k, g in jobs],
                         plan_workers() if workers is None else workers)
    out = [dict() for _ in units]
    for (u, _, _, g), res in zip(jobs, results):
        out[u].update(zip(g, res))
    return [[o[i] for i in idx] for o, (_, idx, _) in zip(out, units)]


def _size(inputs) -> float:
    """A unit's relative cost from its inputs' length (replays of longer sequences unroll more tiles): the largest
    last dimension among the inputs' tensors, relative to 1."""
    from torch.utils._pytree import tree_flatten

    sizes = [x.shape[-1] for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor) and x.dim() >= 1]
    return float(max(sizes)) if sizes else 1.0


def fold_fsdp(est: MemoryEstimate, world_size: int, unit_bytes: int) -> MemoryEstimate:
    """Per-rank figures under FSDP2 / ZeRO-3 (``wrap_fsdp``), from a one-rank replay: the one sharding
    arithmetic, :func:`effpass.planning.sharding.fold_sharding` (also behind ``effpass estimate``)."""
    from .sharding import fold_sharding

    return fold_sharding(est, world_size, unit_bytes, "zero3")
