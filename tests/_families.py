"""Tiny random-weight Hugging Face models of many families, built from configs (no downloads).

``family_case(name)`` returns an :class:`effpass.testing.ModelCase` with inputs that produce a loss
(labels; a padding mask where the family takes one). Shared by tests/models/test_families.py and
tests/passes/apply_autocast/test_apply_autocast.py.
"""
from __future__ import annotations

import torch

from effpass.testing import ModelCase

VOCAB = 128
#: name -> (config class, model class, config kwargs, block glob, attention glob, kind)
_COMMON_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _specs():
    d = dict(_COMMON_DEC)
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", d, "model.layers.*", "model.layers.*.self_attn"),
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(d, sliding_window=4), "model.layers.*",
                    "model.layers.*.self_attn"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(d, head_dim=8), "model.layers.*", "model.layers.*.self_attn"),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", d, "model.layers.*", "model.layers.*.self_attn"),
        "cohere": ("CohereConfig", "CohereForCausalLM", d, "model.layers.*", "model.layers.*.self_attn"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
                   dict(d, num_hidden_layers=2, head_dim=8, sliding_window=4, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, query_pre_attn_scalar=8),
                   "model.layers.*", "model.layers.*.self_attn"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(d, num_key_value_heads=4), "model.layers.*",
                 "model.layers.*.self_attn"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(d, num_local_experts=4, num_experts_per_tok=2),
                    "model.layers.*", "model.layers.*.self_attn"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(d, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           decoder_sparse_step=1), "model.layers.*", "model.layers.*.self_attn"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                    dict(d, head_dim=8, num_local_experts=4, num_experts_per_tok=2, layer_types=["full_attention"],
                         sliding_window=8), "model.layers.*", "model.layers.*.self_attn"),
        "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
                   dict(d, head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64,
                        moe_layers=[0], no_rope_layers=[1], attention_chunk_size=16),
                   "model.layers.*", "model.layers.*.self_attn"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(d, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, decoder_sparse_step=1),
                      "model.layers.*", "model.layers.*.self_attn"),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(d, num_experts=4, num_experts_per_tok=2),
                  "model.layers.*", "model.layers.*.self_attn"),
        # an expert loop with nonzero/.item() in eager code (no use_experts_implementation), identity "zero experts"
        # and MLA; num_layers=1 is two sub-layers (num_hidden_layers = 2 * num_layers)
        "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM",
                          dict(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_attention_heads=4,
                               num_key_value_heads=4, ffn_hidden_size=64, expert_ffn_hidden_size=32,
                               n_routed_experts=4, moe_topk=2, zero_expert_num=2, kv_lora_rank=16, q_lora_rank=16,
                               qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                               max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0),
                          "model.layers.*", "model.layers.*.self_attn.*"),
        "falcon_new": ("FalconConfig", "FalconForCausalLM",
                       dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_kv_heads=2, new_decoder_architecture=True, bos_token_id=0, eos_token_id=0),
                       "transformer.h.*", "transformer.h.*.self_attention"),
        "falcon_old": ("FalconConfig", "FalconForCausalLM",
                       dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            multi_query=True, new_decoder_architecture=False, parallel_attn=True, alibi=False,
                            bos_token_id=0, eos_token_id=0),
                       "transformer.h.*", "transformer.h.*.self_attention"),
        "bloom": ("BloomConfig", "BloomForCausalLM",
                  dict(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0),
                  "transformer.h.*", "transformer.h.*.self_attention"),
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                     dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0),
                     "gpt_neox.layers.*", "gpt_neox.layers.*.attention"),
        "opt": ("OPTConfig", "OPTForCausalLM",
                dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=4,
                     max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0,
                     pad_token_id=1, dropout=0.0, attention_dropout=0.0),
                "model.decoder.layers.*", "model.decoder.layers.*.self_attn"),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel",
                 dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64, bos_token_id=0,
                      eos_token_id=0), "transformer.h.*", "transformer.h.*.attn"),
        "bert": ("BertConfig", "BertForMaskedLM",
                 dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, pad_token_id=0),
                 "bert.encoder.layer.*", "bert.encoder.layer.*.attention.self"),
        "t5": ("T5Config", "T5ForConditionalGeneration",
               dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0),
               "*.block.*", "*.block.*.layer.0.SelfAttention"),
        "bart": ("BartConfig", "BartForConditionalGeneration",
                 dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0),
                 "model.*.layers.*", "model.*.layers.*.self_attn"),
    }


#: MoE families kept out of FAMILIES (test_families' cross-family sweep): tests/passes/inject_lora/test_inject_lora_moe.py
MOE_ONLY = ("gpt_oss", "llama4", "qwen2_moe", "olmoe", "longcat_flash")
FAMILIES = tuple(n for n in _specs() if n not in MOE_ONLY)
#: families whose attention takes the padding mask we pass (encoder or encoder-decoder models)
_PADDED = {"bert", "t5", "bart"}


def family_case(name: str, *, batch: int = 2, seq: int = 8, seed: int = 0, attn: str = "eager") -> ModelCase:
    import transformers as tf

    specs = _specs()
    if name not in specs:
        raise ValueError(f"unknown family {name!r}; choose one of {list(specs)}")
    cfg_name, model_name, kwargs, block, attn_glob = specs[name]
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(3, VOCAB, (batch, seq), generator=g)

    def make():
        torch.manual_seed(seed)
        cfg = getattr(tf, cfg_name)(**kwargs)
        cfg._attn_implementation = attn
        model = getattr(tf, model_name)(cfg)
        try:
            model.set_attn_implementation(attn)
        except Exception:  # pragma: no cover - models without the switch
            pass
        return model.train(False)

    model = make()
    inputs = {"input_ids": tokens, "labels": tokens}
    if name in _PADDED:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1, seq // 2:] = 0
        inputs["attention_mask"] = mask
    layers = getattr(model.config, "num_hidden_layers", None) or getattr(model.config, "num_layers", 1)
    return ModelCase(name=name, model=model, inputs=inputs, num_layers=layers, block_glob=block, attn_glob=attn_glob,
                     make=make)
