"""Hugging Face configs for ``effpass verify CONFIG`` and the family tests: a shrunk random-weight model and inputs."""
from __future__ import annotations

import copy

import torch


# ------------------------------------------------------------------------------------------------------
# Hugging Face configs: effpass verify CONFIG
# ------------------------------------------------------------------------------------------------------
def apply_config_overrides(config, overrides, who: str = "effpass") -> None:
    """Set ``overrides`` (field -> value) on a Hugging Face config; a field the config does not have is an error
    naming it (a misspelt field must not be added silently)."""
    for k, v in (overrides or {}).items():
        if not hasattr(config, k):
            raise ValueError(f"{who}: config field {k!r} does not exist on {type(config).__name__}")
        setattr(config, k, v)


def shrink_config(config, layers: int = 2):
    """A copy of a Hugging Face config with ``layers`` hidden layers (per-layer lists cut to match)."""
    config = copy.deepcopy(config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        n = getattr(config, key, None)
        if isinstance(n, int) and n > layers:
            for k, v in list(vars(config).items()):
                if isinstance(v, list) and len(v) == n:
                    setattr(config, k, v[:layers])
            setattr(config, key, layers)
    for key in ("first_k_dense_replace",):  # MoE models whose first layers are dense: keep one of each
        v = getattr(config, key, None)
        if isinstance(v, int) and v >= layers:
            setattr(config, key, layers - 1)
    return config


def model_from_hf_config(config, *, layers: int = 2, seed: int = 0, overrides: dict | None = None):
    """A causal LM with random weights from a config (path to config.json, dict, ``PretrainedConfig`` or a
    model type name such as ``"llama"``), shrunk to ``layers`` layers, with ``overrides`` set on it."""
    import json

    import transformers as tf

    from ..quantized import quiet_torchao_import

    with quiet_torchao_import():  # transformers' model code imports torchao, whose first import logs on a CPU build
        import transformers.modeling_utils  # noqa: F401
    if isinstance(config, str):
        import os

        if os.path.exists(config):
            path = os.path.join(config, "config.json") if os.path.isdir(config) else config
            with open(path) as f:
                config = json.load(f)
        else:
            try:
                config = tf.AutoConfig.for_model(config)
            except ValueError:
                raise ValueError(f"{config!r} is neither a config.json / folder nor a model type known to "
                                 "transformers (e.g. 'llama', 'qwen3', 'mixtral')") from None
    if isinstance(config, dict):
        d = dict(config)
        mt = d.pop("model_type", None)
        if mt is None:
            raise ValueError("the config has no 'model_type'; is it a Hugging Face config.json?")
        config = tf.AutoConfig.for_model(mt, **d)
    config = shrink_config(config, layers)
    apply_config_overrides(config, overrides)
    config.use_cache = False
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train(), config


def hf_inputs(config, batch: int = 2, seq: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = int(getattr(config, "vocab_size", 256) or 256)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
