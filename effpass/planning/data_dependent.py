"""Sizes the replay cannot know: data-dependent ops on fake tensors, answered by a stated routing model.

A replay runs on fake tensors (shapes, no values), so an op whose output *shape* depends on values cannot run:
``aten.nonzero`` (``Tensor.nonzero``, ``torch.where(mask)``) raises ``DynamicOutputShapeException``, and ``.item()``
has no value. Real models hit this in the eager code between graph breaks: the classic Hugging Face expert loop
(LongCat-Flash, and every MoE whose experts are not behind transformers' ``use_experts_implementation``)::

    expert_mask = one_hot(top_k_index, num_experts).permute(2, 1, 0)        # [experts, k, tokens]
    expert_hit = (expert_mask.sum(dim=(-1, -2)) > 0).nonzero()               # which experts got tokens
    for e in expert_hit:                                                     # e.item(): the expert's index
        slot, token = torch.where(expert_mask[e.item()].squeeze(0))         # its routed token slots
        ...                                                                  # sized by len(token)

:class:`RoutingHints` answers these under **balanced routing**, the assumption the prediction states
(:meth:`RoutingHints.notes`): a ``nonzero`` over a *vector* of length ``L`` is all true, its rows hold
``0 .. L-1`` (every expert gets tokens, visited in order: ``.item()`` on a row reads its index); the next ``L``
``nonzero`` calls over masks of one shape (one per expert) split that shape's elements evenly, the first
``numel % L`` of them one more, so that together they hold every element once (each routed token slot goes to
exactly one expert: the total routed, and so every byte saved per routed token, is exact; the spread over
experts is the assumption). A ``nonzero`` outside such a loop is sized as all true (an upper bound) and said so.
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch

__all__ = ["RoutingHints"]

_NONZERO = torch.ops.aten.nonzero.default
_ITEM = torch.ops.aten._local_scalar_dense.default


def _is_fake(t) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor) or (isinstance(t, torch.Tensor) and t.device.type == "meta")


class RoutingHints:
    """The answers a replay gives to data-dependent ops on fake tensors (see the module doc). One per tracker;
    :meth:`handles` says whether an op is answered here, :meth:`run` answers it."""

    def __init__(self):
        self._values: dict[int, list[int]] = {}  # storage key of a hinted vector's rows -> their values
        self._loop: list | None = None  # [experts L, calls made, the per-expert mask's shape]
        self.counts: Counter = Counter()  # what was hinted, for the prediction's note

    def reset(self) -> None:
        self._loop = None
        self.counts.clear()

    def handles(self, func, args) -> bool:
        if not args or not _is_fake(args[0]):
            return False
        if func is _NONZERO:
            return True
        return func is _ITEM and self._key(args[0]) in self._values

    @staticmethod
    def _key(t) -> int | None:
        try:
            return t.untyped_storage()._cdata
        except Exception:  # pragma: no cover - a tensor without a storage
            return None

    def run(self, func, args):
        x = args[0]
        if func is _ITEM:  # one element of a hinted vector's rows ([count, 1], contiguous): its index
            return self._values[self._key(x)][x.storage_offset()]
        return self._nonzero(x)

    def _nonzero(self, x):
        n = x.numel()
        shape = tuple(x.shape)
        if x.dim() == 1:
            count, kind = n, "vector"
            self._loop = [n, 0, None] if n else None
        elif self._loop is not None and self._loop[2] in (None, shape):
            experts, i, _ = self._loop
            count, kind = n // experts + (1 if i < n % experts else 0), "expert"
            self._loop[1], self._loop[2] = i + 1, shape
            if i + 1 >= experts:
                self._loop = None
        else:
            count, kind = n, "bound"
        self.counts[kind] += 1
        # the output is made below this mode (the fake mode): a fake index tensor of the hinted length; a vector's
        # rows hold 0 .. count-1 (read back by .item(): kept as plain ints, no tensor op runs under the fake mode)
        out = torch.empty((count, x.dim()), dtype=torch.int64, device=x.device)
        key = self._key(out)
        if key is not None and kind == "vector":
            self._values[key] = list(range(count))
            weakref.finalize(out.untyped_storage(), self._values.pop, key, None)  # keys are addresses: reused
        return out

    def notes(self) -> list[str]:
        """What the prediction assumed, in words (empty when nothing was hinted)."""
        if not self.counts:
            return []
        c = self.counts
        parts = []
        if c["vector"] or c["expert"]:
            parts.append(f"{c['vector']} expert loop(s) ({c['expert']} expert masks) sized by balanced routing: "
                         f"every expert gets tokens, each the routed slots / the experts (the total routed is exact; "
                         f"the spread over experts is assumed)")
        if c["bound"]:
            parts.append(f"{c['bound']} other aten.nonzero call(s) sized as all true (an upper bound)")
        return ["data-dependent sizes hinted (the replay has no values): " + "; ".join(parts)]
