"""Every causal-LM type of the installed transformers as a tiny random-weight model (issue 41.6), built from its own
default config shrunk by one set of rules (no hand-written spec per family, no downloads).

``causal_lm_types()``: the keys of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (196 in transformers 5.24).
``build(model_type)``: the model (train mode, every dropout off, so the compiled step computes eager's function) and
its inputs; raises for a type in ``KNOWN_UNBUILT`` (the shrink rules do not give a runnable model: the reason, and
where the family is covered by a hand-written config instead). The rules: every size attribute the config (or its
text config) has and sets is made small (``SMALL``), a few it leaves None where the model needs a value get what None
means at the small sizes (``NONE_MEANS``; in an MoE config the routing sizes, ``MOE_NONE``), MLA models get one latent
per head, a layer-type pattern (``layer_types``, ``block_types``) is cut after its first attention layer (a hybrid's
cache needs one; a pattern derived from the layer count is cut before shrinking, Zamba's ``hybrid`` layers count as
attention), per-layer size lists and per-layer overrides (``per_layer_config``) are shrunk (the cut layers' dropped),
and the model must come out under 3M parameters (counted on the meta device first; over it, the vision and audio
sub-configs are shrunk by the same rules). Where no rule reaches, a per-type table sets config attributes, each with
its reason (``OVERRIDES``). 190 of the 196 types of transformers 5.24 are built.
"""
from __future__ import annotations

import torch

#: the size attributes set where a config has them (and they are not None, lists or dicts)
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, head_dim=8, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, moe_topk=2, expert_ffn_hidden_size=32, ffn_hidden_size=64, n_embd=32, n_layer=1,
             n_head=4, n_positions=64, d_model=32, num_layers=1, num_heads=4, kv_lora_rank=16, q_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=0, n_group=1, topk_group=1,
             n_shared_experts=1, hidden_dim=32, dim=32, n_heads=4, n_layers=1, d_ff=64, ffn_dim=64, num_kv_heads=2,
             n_kv_heads=2, multi_query_group_num=2, kv_channels=8, seq_length=64, sliding_window=16,
             attention_chunk_size=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, bos_token_id=0, eos_token_id=0, pad_token_id=0, zero_expert_num=2,
             moe_num_experts=4, moe_k=2, decoder_layers=1, encoder_layers=1, decoder_ffn_dim=64, encoder_ffn_dim=64,
             decoder_attention_heads=4, encoder_attention_heads=4, num_decoder_layers=1, num_encoder_layers=1,
             decoder_start_token_id=0, rotary_dim=8, decoder_vocab_size=128, lru_width=32, attention_hidden_size=32,
             pronunciation_embed_dim=32, pronunciation_vocab_size=32, shape_embed_dim=32, shape_vocab_size=32,
             unpadded_vocab_size=128, linear_head_dim=8, linear_num_heads=4, state_size=16, time_step_rank=8,
             n_groups=1, expand=1, vocab_size_per_layer_input=128,
             hidden_size_per_layer_input=8)
#: attributes a default config leaves None where the model needs a value, set to what None would mean at the small
#: sizes (hidden 32 / 4 heads: head_dim 8, one key/value head per query head) or, in an MoE config (one that sets
#: ``moe_intermediate_size``), to the small routing sizes
NONE_MEANS = dict(head_dim=8, num_key_value_heads=SMALL["num_attention_heads"])
MOE_NONE = dict(num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1)
MAX_PARAMS = 3_000_000

#: types the rules do not build, with why (transformers 5.24); a reason starts with its group: ``size`` (the shrunk
#: model is still too large), ``config`` (the shrunk config is inconsistent, or the model is not a tokens-in,
#: one-vocabulary LM), ``per_layer`` (per-layer attributes the rules cannot set), ``hybrid`` (the cut layer pattern
#: leaves a hybrid's cache without an attention layer); since the rules for towers, per-layer configs and derived
#: patterns and the override table, only ``config`` reasons are left
KNOWN_UNBUILT = {
    "gemma3n": "config: its vision tower is a TimmWrapperModel, which needs timm and PIL (neither installed here); "
               "its text decoder is gemma3n_text",
    "gemma4_assistant": "config: a drafter: its forward raises without inputs_embeds and shared_kv_states (a target "
                        "model's key/value states, reused by every layer), which a tokens-only step does not have",
    "gemma4_unified_assistant": "config: a drafter: its forward raises without inputs_embeds and shared_kv_states (a "
                                "target model's key/value states, reused by every layer), which a tokens-only step "
                                "does not have",
    "git": "config: its loss drops the first image_patch_tokens logits (the image prefix, (image_size / patch_size)^2 "
           "+ 1 of them) whatever the input: with tokens only, no logits are left (batch size 0 against 14 targets)",
    "musicgen": "config: one head and one embedding per codebook (ModuleLists), input_ids of batch x num_codebooks "
                "rows and labels of shape (batch, seq, num_codebooks): not a one-vocabulary token LM",
    "musicgen_melody": "config: one head and one embedding per codebook (ModuleLists), input_ids of batch x "
                       "num_codebooks rows and labels of shape (batch, seq, num_codebooks): not a one-vocabulary "
                       "token LM",
}

#: per-type fixes where no rule reaches, each ``type -> (attributes, why)``, set after the rules (a key is an attribute
#: of the text config or a dotted path from the top config); random weights, no downloads, the size limit holds
_PURE_MAMBA = ("its default layer pattern is all Mamba, which transformers' hybrid cache cannot serve (get_seq_length): "
               "a Mamba and an attention layer; its Mamba heads must tile mamba_expand x hidden_size (2 x 32)")
_MAMBA_HEADS = dict(mamba_n_heads=4, mamba_d_head=16)
OVERRIDES: dict[str, tuple[dict, str]] = {
    "bamba": (dict(num_hidden_layers=2, attn_layer_indices=[1], **_MAMBA_HEADS), _PURE_MAMBA),
    "granitemoehybrid": (dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                              **_MAMBA_HEADS), _PURE_MAMBA),
    "cohere_compass_text": (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
                            "its default config has no RoPE parameters for its 'full_attention' layers (KeyError)"),
    "blt": ({"encoder_hash_byte_group_vocab": 64, "use_cache": False, "global_config.hidden_size": 64,
             "global_config.head_dim": 16, "encoder_config.hidden_size_global": 64,
             "decoder_config.hidden_size_global": 64},
            "its hash embedding's vocabulary (500002 rows per byte-group size, 3.1G parameters in all); its global "
            "transformer's width is cross_attn_k (2) x the local one; its forward builds a cache from the top "
            "config, which has no num_hidden_layers (AttributeError)"),
    "dbrx": ({"attn_config.rope_theta": 1e4, "attn_config.clip_qkv": 8.0},
             "its attention reads attn_config.rope_theta, absent from the default sub-config, and clamps q/k/v by "
             "clip_qkv, whose default None torch.clamp rejects (min and max both None)"),
    "gemma3n_text": (dict(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, num_kv_shared_layers=1),
                     "its KV-sharing layers need a producing layer of their type: two layers, the second reuses"),
    "hrm_text": (dict(num_layers_per_stack=1, num_hidden_layers=8),
                 "num_hidden_layers is derived: num_layers_per_stack x H_cycles (2) x (L_cycles (3) + 1)"),
    "lfm2_moe": (dict(num_hidden_layers=2, layer_types=["conv", "full_attention"], num_dense_layers=1),
                 "its default layer_types is None (the model indexes it): one conv layer, one attention + MoE layer"),
    "longcat_flash": (dict(qk_head_dim=16), "qk_head_dim is derived (qk_nope_head_dim + qk_rope_head_dim)"),
    "phi4_multimodal": ({"audio_config.num_blocks": 1, "audio_config.nemo_conv_channels": 32,
                         "audio_config.ext_pw_out_channel": 32, "audio_config.depthwise_separable_out_channel": 32},
                        "its audio encoder's block count and convolution widths have names of their own"),
    "qwen4_exp_text": (dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                            indexer_compress_ratio=2),
                       "its indexed-attention layers need the indexer sizes, None in the default config"),
    "reformer": (dict(is_decoder=True, axial_pos_shape=(2, 4), axial_pos_embds_dim=(8, 24), attention_head_size=8,
                      feed_forward_size=64, local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2,
                      attn_layers=("local", "lsh"), hash_seed=0),
                 "its LM head needs is_decoder; in training the axial position shape must multiply to the sequence "
                 "length (8) and its widths sum to hidden_size; chunks divide 8; a local and an LSH layer, the LSH "
                 "hash seeded (compiled and eager hash alike)"),
    "rwkv": (dict(num_hidden_layers=2), "its weight init divides by num_hidden_layers - 1"),
    "zamba": (dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                   attention_hidden_size=64, attention_head_dim=16),
              "its shared attention block is tied across its hybrid layers, which needs two of them; its attention "
              "sizes are derived from hidden_size when the config is made (2 x 32, / 4 heads)"),
    "zamba2": (dict(mamba_headdim=8, attention_hidden_size=64, attention_head_dim=16),
               "its Mamba and attention sizes are derived from hidden_size when the config is made (2 x 32 / heads)"),
    "xlstm": (dict(hidden_size=128, embedding_dim=128, num_blocks=1),
              "embedding_dim and num_blocks are hidden_size and the layer count under other names; the config rounds "
              "the q/k and v widths up to multiples of 64, its cell state does not (matC shape error below 128)"),
    "xmod": (dict(default_language="en_XX"), "its adapters need a language (set_default_language)"),
}
OVERRIDES["qwen4_exp"] = OVERRIDES["qwen4_exp_text"]


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class(model_type: str):
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return getattr(tf, name[0] if isinstance(name, (list, tuple)) else name)


def _set(c, k, v) -> None:
    try:
        setattr(c, k, v)
    except Exception:  # a derived or validated attribute: the rules leave it
        pass


def _attention_layers(types) -> list[bool]:
    """Which layers of a pattern have softmax attention (a hybrid's cache needs one): not a linear or state-space
    mixer; Zamba's ``hybrid`` (a shared attention block beside a Mamba layer) among ``linear_attention`` ones too."""
    zamba = "linear_attention" in types
    return [("attention" in str(t) and "linear" not in str(t)) or (zamba and t == "hybrid") for t in types]


def _pattern(text, attr):
    try:
        types = getattr(text, attr, None)
    except Exception:  # a derived pattern the unshrunk config cannot compute
        return None
    return list(types) if isinstance(types, (list, tuple)) and types else None


def _set_path(cfg, text, key, v) -> None:
    """``key``: an attribute of the text config, or a dotted path from the top config (``vision_config.x``)."""
    *path, attr = key.split(".")
    obj = text if not path else cfg
    for a in path:
        obj = getattr(obj, a)
    setattr(obj, attr, v)


def _sub_configs(cfg, text):
    """The configs below ``cfg`` other than the text config (vision and audio towers), depth first."""
    seen, out = {id(cfg), id(text)}, []

    def walk(c):
        for k in list(vars(c)):
            v = getattr(c, k, None) if not k.startswith("_") else None
            if hasattr(v, "to_dict") and hasattr(v, "model_type") and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
                walk(v)
    walk(cfg)
    return out


def _shrink(c) -> None:
    for k, v in SMALL.items():
        try:
            cur = getattr(c, k, None)
        except Exception:  # a per-layer attribute read globally
            continue
        if cur is not None and not isinstance(cur, (list, dict)):
            _set(c, k, v)
        elif isinstance(cur, list) and cur and all(type(x) is int for x in cur) and "token" not in k:  # per layer
            _set(c, k, [v] * len(cur))


def tiny_config(model_type: str, towers: bool = False):
    """The class's default config, shrunk by the rules of the module doc (``towers``: the vision and audio
    sub-configs too, for a model over the size limit otherwise)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = model_class(model_type)
    cfg = (getattr(cls, "config_class", None) or CONFIG_MAPPING[model_type])()
    try:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    except ValueError:  # several text configs (an encoder and a decoder)
        text = cfg
    per_layer = {}
    if getattr(text, "is_heterogeneous", False):  # per-layer overrides: dropped now, kept layers' re-applied shrunk
        per_layer = {int(i): dict(o) for i, o in text.to_dict().get("per_layer_config", {}).items()}
        text.per_layer_config = None
    full = {a: _pattern(text, a) for a in ("layer_types", "block_types", "layers_block_type")}
    _shrink(text)
    for k, v in {**NONE_MEANS, **(MOE_NONE if getattr(text, "moe_intermediate_size", None) else {})}.items():
        if k in text.to_dict() and getattr(text, k, 0) is None:
            _set(text, k, v)
    for c in {id(cfg): cfg, id(text): text}.values():  # no dropout: the compiled step computes eager's function
        for k, v in list(c.to_dict().items()):
            if "drop" in k and isinstance(v, float) and v > 0:
                _set(c, k, 0.0)
    if getattr(text, "kv_lora_rank", None) is not None and hasattr(text, "num_key_value_heads"):
        _set(text, "num_key_value_heads", text.num_attention_heads)  # MLA: one latent per head
    for attr in ("layer_types", "block_types", "layers_block_type"):
        types = _pattern(text, attr)
        if types is None:
            continue
        if not any(_attention_layers(types)) and full[attr] and any(_attention_layers(full[attr])):
            types = full[attr]  # a pattern derived from the layer count: cut the unshrunk one
        if attr != "layers_block_type" or types is full[attr]:  # cut the pattern after its first attention layer
            first = next((i for i, a in enumerate(_attention_layers(types)) if a), 0)
            _set(text, "num_hidden_layers", first + 1)
            _set(text, attr, types[:first + 1])
    for attr in ("hybrid_layer_ids",):  # layer-index lists: the kept layers only
        if isinstance(getattr(text, attr, None), list):
            _set(text, attr, [i for i in getattr(text, attr) if i < text.num_hidden_layers])
    kept = {i: o for i, o in per_layer.items() if i < text.num_hidden_layers}
    if kept:
        text.per_layer_config = {i: {k: SMALL.get(k, v) for k, v in o.items()} for i, o in kept.items()}
    if towers:
        for c in _sub_configs(cfg, text):
            _shrink(c)
    for k, v in OVERRIDES.get(model_type, ({},))[0].items():
        _set_path(cfg, text, k, v)
    return cfg


def build(model_type: str, seed: int = 0):
    """``(model, inputs)``: the tiny model in train mode (dropout off) and 2 x 8 tokens with labels."""
    if model_type in KNOWN_UNBUILT:
        raise ValueError(f"{model_type}: not built by the rules ({KNOWN_UNBUILT[model_type]})")
    import transformers as tf

    tf.logging.set_verbosity_error()
    cls, cfg = model_class(model_type), tiny_config(model_type)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > MAX_PARAMS:  # a vision or audio tower at full size: shrink it by the same rules
        cfg = tiny_config(model_type, towers=True)
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{model_type}: {n} parameters after shrinking (at most {MAX_PARAMS})")
    torch.manual_seed(seed)
    model = cls(cfg).train()
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, min(vocab, 128), (2, 8), generator=torch.Generator().manual_seed(seed + 1))
    return model, {"input_ids": ids, "labels": ids}
