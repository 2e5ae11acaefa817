"""Facts: what one pass of a pipeline establishes that another pass must know (the declared contracts).

A pass never reads another pass's options by name. It declares, from its options, the facts it provides
(:meth:`effpass.Pass.facts`: instances of the frozen dataclasses below); the
:class:`~effpass.manager.PassManager` collects the facts of its active passes before any hook runs (two
passes declaring different values of one fact is a :class:`~effpass.manager.PipelineError`), and a hook
asks for one by its class::

    mp = ctx.fact(MixedPrecision)          # None when no pass of the pipeline declares it
    param_dtype = mp.dtype if mp is not None else None

A fact says what holds for the pipeline, not which pass holds it, so a plugin pass may provide one too
(subclass :class:`Fact` as a frozen dataclass for a new contract; put it here when built-in passes share it).

==================  ======================  =====================================================
fact                provided by             read by
==================  ======================  =====================================================
MixedPrecision      apply_autocast          wrap_fsdp (FSDP's parameter dtype), scale_loss
LossScaling         scale_loss              apply_autocast (warns for float16 without it)
ShardsParameters    wrap_fsdp               shard_sequence (leaves gradient reduction to FSDP)
FusesLossHead       fuse_cross_entropy      wrap_fsdp (warns when the head would run eagerly)
==================  ======================  =====================================================
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Fact", "MixedPrecision", "LossScaling", "ShardsParameters", "FusesLossHead"]


@dataclass(frozen=True)
class Fact:
    """Base class of the facts a pass declares for the rest of its pipeline (:meth:`effpass.Pass.facts`).
    Subclass it as a frozen dataclass; the class is the key ``ctx.fact(cls)`` looks up, so a reader names
    what it expects and two passes never collide on a string."""


@dataclass(frozen=True)
class MixedPrecision(Fact):
    """The pipeline runs the model's floating-point compute in ``dtype`` (``apply_autocast``: autocast
    regions around the model's modules). ``wrap_fsdp`` keeps FSDP's parameters in this dtype unless its own
    ``param_dtype`` says otherwise; ``scale_loss`` does nothing for ``torch.bfloat16`` (float32's exponent
    range: gradients do not underflow)."""

    dtype: torch.dtype


@dataclass(frozen=True)
class LossScaling(Fact):
    """The pipeline scales the loss so float16 gradients do not underflow (``scale_loss``: a dynamic loss
    scaler). Without it ``apply_autocast`` warns when it runs the model in float16."""


@dataclass(frozen=True)
class ShardsParameters(Fact):
    """The pipeline shards the model's parameters over the ranks and reduces their gradients across all of
    them (``wrap_fsdp``: FSDP2's reduce-scatter). ``shard_sequence`` then leaves the gradient reduction over
    its sequence-parallel group to it (its ``reduce_gradients=None``)."""


@dataclass(frozen=True)
class FusesLossHead(Fact):
    """The pipeline fuses the output projection with the loss in the graph that holds both
    (``fuse_cross_entropy``), which needs the head compiled in one graph with the loss. ``wrap_fsdp`` warns when
    the head runs eagerly (its root module is not compiled)."""
