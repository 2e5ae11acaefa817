"""``shard_sequence``'s data side: samplers and loaders that give every rank of a sequence-parallel group the same
batches (torch ``DistributedSampler``, accelerate's prepared loaders) and the Hugging Face ``Trainer`` adapter.
"""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from .hooks import state_of

__all__ = ["sequence_parallel_sampler", "sequence_parallel_trainer", "shard_batches_for_group"]


def _data_rank(model_or_mesh, mesh_dim: str, who: str) -> tuple[int, int]:
    """(this rank's index over the mesh's dimensions other than ``mesh_dim``, their number)."""
    state = state_of(model_or_mesh) if isinstance(model_or_mesh, nn.Module) else None
    mesh = state.mesh if state is not None else model_or_mesh
    if mesh is None or isinstance(mesh, nn.Module):
        raise ValueError(f"{who}: pass the model prepared by shard_sequence (ShardSequence in its passes) or its "
                         "DeviceMesh")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh_dim not in names:
        raise ValueError(f"{who}: the mesh has no dimension {mesh_dim!r}; it has {list(names)}")
    coord, shape = mesh.get_coordinate(), mesh.shape
    dim = names.index(mesh_dim)
    index, replicas = 0, 1
    for i, (c, s) in enumerate(zip(coord, shape)):   # the rank's index over the mesh's other dimensions
        if i != dim:
            index, replicas = index * s + c, replicas * s
    return index, replicas


def sequence_parallel_sampler(dataset, model_or_mesh=None, *, mesh_dim: str = "sequence", shuffle: bool = True,
                              seed: int = 0, drop_last: bool = False):
    """A ``DistributedSampler`` over the *data* ranks only: every rank of a sequence-parallel group draws the
    same examples (what ``shard_sequence`` expects), different groups draw different ones."""
    from torch.utils.data.distributed import DistributedSampler

    index, replicas = _data_rank(model_or_mesh, mesh_dim, "sequence_parallel_sampler")
    return DistributedSampler(dataset, num_replicas=replicas, rank=index, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)


def shard_batches_for_group(dataloader, model_or_mesh, *, mesh_dim: str = "sequence"):
    """Re-shard a data loader that splits batches over *all* ranks so that it splits them over the data ranks
    only: every rank of a sequence-parallel group then gets the same batches (what ``shard_sequence`` needs).

    Serves accelerate's prepared loaders (what ``Trainer`` and ``accelerator.prepare`` return: the
    ``BatchSamplerShard`` or ``IterableDatasetShard`` inside) and torch loaders with a ``DistributedSampler``;
    changed in place and returned. Accelerate's shuffling is seeded the same on every rank, so the ranks of a
    group draw the same batches in the same order."""
    index, replicas = _data_rank(model_or_mesh, mesh_dim, "shard_batches_for_group")
    from torch.utils.data.distributed import DistributedSampler

    if type(dataloader).__name__ == "DataLoaderDispatcher":
        raise ValueError("shard_batches_for_group: accelerate's dispatch_batches loader (rank 0 reads and scatters "
                         "slices) cannot give a group the same batch; use dispatch_batches=False "
                         "(TrainingArguments(accelerator_config={'dispatch_batches': False}))")
    done = False
    for obj in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None)):
        if obj is not None and hasattr(obj, "num_processes") and hasattr(obj, "process_index"):
            if getattr(obj, "split_batches", False):
                raise ValueError("shard_batches_for_group: split_batches=True splits every batch over all ranks; "
                                 "use split_batches=False with shard_sequence")
            obj.num_processes, obj.process_index = replicas, index
            done = True
    sampler = getattr(dataloader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        sampler.num_replicas, sampler.rank = replicas, index
        n = len(sampler.dataset)
        sampler.num_samples = (n // replicas if sampler.drop_last and n % replicas
                               else -(-n // replicas))
        sampler.total_size = sampler.num_samples * replicas
        done = True
    if not done:
        raise ValueError(f"shard_batches_for_group: {type(dataloader).__name__} does not shard by rank through "
                         "accelerate (BatchSamplerShard / IterableDatasetShard) or a DistributedSampler; build it "
                         "with sequence_parallel_sampler(dataset, model) instead")
    return dataloader


def sequence_parallel_trainer(trainer):
    """Make a Hugging Face ``Trainer`` train a model prepared by ``shard_sequence``; returns the trainer.

    * its train and eval loaders give every rank of a sequence-parallel group the same batches
      (:func:`shard_batches_for_group`: accelerate otherwise gives every rank different ones);
    * the pass stops averaging gradients itself: the Trainer's DDP (or FSDP) averages them over all ranks.

    The Trainer's own loss accounting then holds: with ``average_tokens_across_devices`` it counts every
    group's tokens once per rank (``size`` times) and scales the loss by the number of processes, and the
    pass's loss carries gradient ``size`` towards each rank's share, so the averaged gradient is the
    gradient of the whole global batch's loss (``tests/passes/shard_sequence/test_shard_sequence.py`` compares it with one process)."""
    model = trainer.model
    state = state_of(getattr(model, "module", model))
    if state is None:
        raise ValueError("sequence_parallel_trainer: the Trainer's model was not prepared by shard_sequence; "
                         "compile it with effpass.compile(model, passes=[ShardSequence(size=N), ...]) before "
                         "building the Trainer")
    args = trainer.args
    if getattr(getattr(trainer.accelerator, "parallelism_config", None), "sp_enabled", False) or \
            getattr(getattr(trainer.accelerator, "parallelism_config", None), "cp_enabled", False):
        raise ValueError("sequence_parallel_trainer: TrainingArguments(parallelism_config=...) already splits "
                         "sequences (sp_size/cp_size); use either it or shard_sequence, not both")
    if getattr(args, "world_size", 1) != dist.get_world_size():
        raise ValueError(f"sequence_parallel_trainer: the Trainer sees {args.world_size} processes but "
                         f"torch.distributed has {dist.get_world_size()}; launch with torchrun")
    state.reduce_gradients = False
    train_loader, eval_loader = trainer.get_train_dataloader, trainer.get_eval_dataloader

    def get_train_dataloader():
        return shard_batches_for_group(train_loader(), state.mesh, mesh_dim=state.mesh_dim)

    def get_eval_dataloader(eval_dataset=None):
        return shard_batches_for_group(eval_loader(eval_dataset), state.mesh, mesh_dim=state.mesh_dim)

    trainer.get_train_dataloader = get_train_dataloader
    trainer.get_eval_dataloader = get_eval_dataloader
    return trainer
