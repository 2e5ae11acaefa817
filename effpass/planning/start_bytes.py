"""The bytes live at the start of a plan's training step, without replaying the step
(:func:`start_bytes_many`): a lower bound of its predicted peak, which the candidate search prunes with."""
from __future__ import annotations

from typing import Sequence

import torch
from torch.utils._pytree import tree_flatten

from .depth import AUTO_MIN_BLOCKS, DEPTHS, block_list, first_blocks
from .patches import replay_patches
from .pool import in_workers, plan_workers
from .replay import (check_optimizer, fake_copy, module_phase_key, prepare_replay_model, replay_options,
                     split_compile_options, target_device, without_fsdp)
from .optimizer_replay import optimizer_replay
from .tracker import Tracker, tracked_bytes

__all__ = ["start_bytes_many"]


def start_bytes_many(model: torch.nn.Module, example_inputs, plans: Sequence, *, device=None,
                     lr: float = 1e-3, **compile_options) -> list:
    """The bytes live at the start of each plan's training step, without replaying the step: parameters,
    buffers, optimizer states and inputs after the plan's module phase, counted as the replay counts them
    (the tracked step's ``start`` in the replay: storage-true, each storage once). ``plans``: ``(pipeline, optimizer)``
    pairs (``optimizer`` a registered name or None). Every predicted peak is these bytes plus the step's own
    peak above them (>= 0), so this is a lower bound of the peak the replay would predict: the planner prunes
    with it (a plan whose start alone exceeds the budget cannot fit). Plans with the same module phase share
    one fake copy. A model of identical blocks that :func:`estimate_many` extrapolates is counted as it is
    replayed: at the first 2, 3 and 4 blocks, extrapolated when the three counts are affine in depth (else at
    full depth). Returns per plan an int, or the exception raised (the caller replays that plan, which
    reports it)."""
    check_optimizer(None)  # loads the registered passes and optimizers
    dev = target_device(model, device)
    blocks = block_list(model)
    if blocks is None or len(blocks) <= max(DEPTHS) or len(blocks) < AUTO_MIN_BLOCKS:
        return _start_bytes(model, example_inputs, plans, dev, lr, compile_options)
    def at_depth(k):
        with first_blocks(blocks, k):
            return _start_bytes(model, example_inputs, plans, dev, lr, compile_options)

    per_depth = in_workers(at_depth, list(DEPTHS), [k + 2 for k in DEPTHS], plan_workers())
    out: list = []
    todo = []
    for i, (a, b, c) in enumerate(zip(*per_depth)):
        if not all(isinstance(x, int) for x in (a, b, c)):
            out.append(next(x for x in (a, b, c) if not isinstance(x, int)))
        elif b - a == c - b:
            out.append(c + (len(blocks) - DEPTHS[-1]) * (c - b))
        else:  # not affine: counted at full depth
            out.append(None)
            todo.append(i)
    if todo:
        for i, r in zip(todo, _start_bytes(model, example_inputs, [plans[i] for i in todo], dev, lr, compile_options)):
            out[i] = r
    return out


def _start_bytes(model, example_inputs, plans, dev, lr, compile_options) -> list:
    """:func:`start_bytes_many` of ``model`` as it is (no extrapolation)."""
    from effpass.memory_options import build_optimizer

    _, lowering, opts = split_compile_options(compile_options)
    out: list = [None] * len(plans)
    groups: dict = {}
    for i, (passes, _opt) in enumerate(plans):
        try:
            options, kwargs = replay_options(without_fsdp(passes, dev), lowering, opts, dev)
            groups.setdefault(module_phase_key(options, kwargs), []).append((i, options, kwargs))
        except Exception as e:
            out[i] = e
    for members in groups.values():
        _, options, kwargs = members[0]
        try:
            fake_mode, work, inputs = fake_copy(model, example_inputs, dev)
            with replay_patches(dev, inductor=lowering == "inductor"), fake_mode, Tracker(device=dev):
                prepare_replay_model(work, options, kwargs, dev)
                params, buffers = list(work.parameters()), list(work.buffers())
                trainable = [p for p in params if p.requires_grad]
                flat_inputs = [x for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]
                shapes = [(tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in trainable]
                by_optimizer: dict = {None: tracked_bytes(params + buffers + flat_inputs, dev)}
                if trainable and any(plans[i][1] is not None for i, _o, _k in members):
                    # AdamW's states as the replay's first step leaves them (one step on empty gradients)
                    opt = build_optimizer("adamw", trainable, lr=lr, device=dev)
                    for p in trainable:
                        p.grad = torch.empty_like(p)
                    opt.step()
                    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                    for p in trainable:
                        p.grad = None
                    by_optimizer["adamw"] = tracked_bytes(params + buffers + states + flat_inputs, dev)
                    del opt, states
            for i, _o, _k in members:
                name = plans[i][1]
                if name not in by_optimizer:  # as with_optimizer sizes them on the AdamW replay
                    by_optimizer[name] = by_optimizer[None] + (optimizer_replay(name, shapes, dev, lr)[0]
                                                               if trainable else 0)
                out[i] = by_optimizer[name]
        except Exception as e:
            for i, _o, _k in members:
                if out[i] is None:
                    out[i] = e
        finally:
            torch._dynamo.reset()
    return out
