"""Tiny causal LMs of the families TRL's trainers are tested on (tests/integrations/test_trl_*.py): a plain head
(Llama), tied heads (Qwen2; Gemma 2, also soft-capped), and an MoE whose router's load-balancing loss the trainers
add (Mixtral)."""
import torch

FAMILIES = ("llama", "qwen2", "gemma2", "mixtral")


def tiny_model(family: str, seed: int = 0):
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":  # tied head
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    elif family == "mixtral":  # MoE: the trainers add the router's load-balancing loss (aux_loss_enabled)
        m = tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                   output_router_logits=True, router_aux_loss_coef=0.01))
    elif family == "gemma2":  # tied head, soft-capped logits
        m = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=5.0,
                                                 attn_logit_softcapping=None, query_pre_attn_scalar=8))
    else:
        raise ValueError(f"unknown test family {family!r}; choose one of {list(FAMILIES)}")
    m.config._attn_implementation = "eager"
    return m.train()
