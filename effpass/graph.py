"""Graph helpers shared by the core and every pass: public, for people who write their own passes.

The names live in four modules by responsibility (``graph_nodes``: reading graphs and module paths;
``graph_snapshot``: rollback and dumps; ``graph_rewrite``: nodes a pass creates and erases; ``graph_match``:
matching torch-IR nodes, symbolic sizes, autocast) and are imported from here.

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

from .graph_match import (MASK_FILL_THRESHOLD, ENTER_AUTOCAST, EXIT_AUTOCAST, AutocastRegions, Skip, arg,
                          autocast_dtype_at, is_autocast_enter, is_autocast_exit, is_fn, is_method, is_number,
                          is_softmax, is_static, same_shape, same_size, shape_of, size_hint, val)
from .graph_nodes import (forward_nodes, has_tangents, is_buffer_source, is_primal, is_random_op, is_tangent,
                          module_path_of_node, module_stack_of_node, normalize_module_path, op_histogram, op_name,
                          parameter_input_flags, parameter_only_nodes, placeholder_values, source_path, tensor_meta,
                          transformer_blocks)
from .graph_rewrite import (PROVENANCE_KEYS, ancestors, annotate_new_nodes, copy_provenance, erase_dead,
                            infer_fake_values, site_name)
from .graph_snapshot import (GraphCheckpoint, copy_graph_into, lazy_graph_module, restore_graph, runnable_source,
                             snapshot_graph)

__all__ = [
    "op_name", "op_histogram", "tensor_meta", "placeholder_values", "is_tangent", "is_primal",
    "parameter_input_flags", "parameter_only_nodes", "forward_nodes", "has_tangents", "transformer_blocks",
    "normalize_module_path", "module_stack_of_node", "module_path_of_node", "source_path", "is_buffer_source",
    "is_random_op", "snapshot_graph", "copy_graph_into", "restore_graph", "GraphCheckpoint", "lazy_graph_module",
    "runnable_source", "PROVENANCE_KEYS", "copy_provenance", "infer_fake_values", "annotate_new_nodes", "ancestors",
    "site_name", "erase_dead", "MASK_FILL_THRESHOLD", "Skip", "is_fn", "is_method", "is_softmax", "arg", "val",
    "shape_of", "size_hint", "is_static", "same_size", "same_shape", "is_number", "ENTER_AUTOCAST", "EXIT_AUTOCAST",
    "is_autocast_enter", "is_autocast_exit", "AutocastRegions", "autocast_dtype_at"
]
