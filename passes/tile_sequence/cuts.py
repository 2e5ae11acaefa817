"""``tile_sequence``'s cuts: where the tiles of a length fall (:func:`_tile_bounds`) and which nodes of a row-wise
component can be tiled at all (:func:`_without_early_outputs`)."""
from __future__ import annotations

import math

import torch.fx as fx


def _tile_bounds(rows: int, tile_rows: int, cut: str = "even") -> list[tuple[int, int]]:
    """``cut="even"``: ceil(rows / tile_rows) tiles of one size (the last smaller by fewer rows than there are
    tiles); ``"exact"``: tiles of exactly ``tile_rows``, the last one the rest."""
    n = max(1, math.ceil(rows / tile_rows))
    step = tile_rows if cut == "exact" else math.ceil(rows / n)
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


def _without_early_outputs(comp: list[fx.Node], order: dict) -> list[fx.Node]:
    """``comp`` without the nodes whose value is used outside it before its last node, nor what they depend on
    in it: the tiles are computed after the region's last node, so such a value (a parallel block's norm, read by
    the attention's projections and by the MLP: Cohere) stays computed once, untiled, an input of the tiles."""
    while comp:
        cs, end = set(comp), order[comp[-1]]
        early = [m for m in comp if any(u not in cs and order[u] < end for u in m.users)]
        if not early:
            return comp
        drop, stack = set(), list(early)
        while stack:
            m = stack.pop()
            if m in drop:
                continue
            drop.add(m)
            stack += [a for a in m.all_input_nodes if a in cs]
        comp = [m for m in comp if m not in drop]
    return comp
