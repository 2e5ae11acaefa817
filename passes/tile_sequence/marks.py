"""``tile_sequence``'s joint-graph marks for AOTAutograd's partitioner: a tile's row computations are recomputed
tile by tile in the backward, its output is saved, and what it computes from weights alone keeps its owner's marks."""
from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from effpass.graph import is_tangent


def mark_tiles(gm: fx.GraphModule, tag: str) -> dict:
    """Mark the forward nodes that ``tile_sequence`` copied into tiles (``meta["custom"][tag]``); returns the
    statistics ``marked_recompute``, ``marked_save`` and ``weight_nodes_left``."""
    bwd: set[fx.Node] = set()
    rows: set[fx.Node] = set()  # forward values computed from a tile's rows
    recompute = save = kept = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if is_tangent(n):
                bwd.add(n)
            continue
        if n.op != "call_function":
            continue
        if n.meta.get("partitioner_tag") == "is_backward" or any(a in bwd for a in n.all_input_nodes):
            bwd.add(n)
            continue
        info = (n.meta.get("custom") or {})
        if tag not in info:
            continue
        gid = 10_000 + int(info[tag])
        if info.get("role") in ("split", "slice") or any(a in rows for a in n.all_input_nodes):
            rows.add(n)
        elif info.get("role") != "output":
            # NOTE(weights in a tile): a node copied into a tile that reads no row of it computes from
            # parameters and constants alone (a quantized base's dequantization, a weight's cast or transpose,
            # inherited from the tile's linear when AOTAutograd decomposes it). Its marks stay its owner's:
            # quantize_linear's MUST_RECOMPUTE, checkpoint_activations' block. Marking it here gave it the
            # region's ac_graph_id, above the block id of its own input (the int32 copy of NF4's packed codes),
            # and torch's cleanup_recompute_tags then saved that input for the backward: 2 bytes per weight,
            # the size of a bf16 copy of every tiled weight (Llama-3-8B QLoRA + checkpoint(full) + tiles: 11.5
            # GiB more predicted; reproduced, predicted and measured to the byte, on a small Llama).
            kept += 1
            continue
        if info.get("role") == "output":
            # NOTE(one tile at a time): the region's output is saved, even inside a block that
            # checkpoint_activations recomputes: recomputing it in the backward (for a later norm's gradient,
            # say) would compute every tile at once and keep all their intermediates alive until each tile's
            # gradient is taken. At a block's end it is the boundary that checkpointing saves anyway.
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            n.meta.setdefault("ac_graph_id", gid)
            save += 1
            continue
        if n.meta.get("recompute") is not CheckpointPolicy.MUST_RECOMPUTE:  # another pass's hard constraint
            n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
        n.meta.setdefault("ac_graph_id", gid)
        recompute += 1
    return {"marked_recompute": recompute, "marked_save": save, "weight_nodes_left": kept}
