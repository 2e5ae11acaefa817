"""Packing matrix: for each Hugging Face decoder family built from a config (random weights, 2 layers, eager
attention, training mode, fp32), one packed row of three examples (5, 9, 7 tokens) through
``FuseAttention`` + ``PackSequences`` (lowering="eager"): each example's logits, the loss and every gradient
against the examples run alone; or the error the pass raised. Each family is an arm, in a fresh process under
bench/driver.py; rows appended to ``bench/results/pack_matrix_<device>.{json,md}``.

    python bench/bench_pack_matrix.py                      # every family
    python bench/bench_pack_matrix.py --arms llama,gpt2    # some (--quick: llama only)
"""
from __future__ import annotations

import os
import re
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

V = 128
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def families() -> dict[str, tuple[str, str, dict]]:
    b = BASE
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", b),
        "mistral (sliding window 4)": ("MistralConfig", "MistralForCausalLM", dict(b, sliding_window=4)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", b),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(b, head_dim=8)),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(b, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(b, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(b, **MOE)),
        "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(b, head_dim=8)),
        "gemma2 (soft-capping, sliding)": ("Gemma2Config", "Gemma2ForCausalLM",
                                           dict(b, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)),
        "gemma3_text (sliding)": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                                  dict(b, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                                       layer_types=["sliding_attention", "full_attention"])),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(b, num_key_value_heads=4)),
        "phi": ("PhiConfig", "PhiForCausalLM", dict(b, num_key_value_heads=4)),
        "olmo": ("OlmoConfig", "OlmoForCausalLM", b),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", b),
        "cohere": ("CohereConfig", "CohereForCausalLM", b),
        "granite": ("GraniteConfig", "GraniteForCausalLM", b),
        "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(b, residual_dropout=0.0)),
        "stablelm": ("StableLmConfig", "StableLmForCausalLM", b),
        "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", b),
        "helium": ("HeliumConfig", "HeliumForCausalLM", dict(b, head_dim=8)),
        "glm": ("GlmConfig", "GlmForCausalLM", dict(b, head_dim=8)),
        "gpt_oss (attention sinks)": ("GptOssConfig", "GptOssForCausalLM",
                                      dict(b, head_dim=8, sliding_window=4, **MOE,
                                           layer_types=["sliding_attention", "full_attention"])),
        "llama4_text (chunked, temperature)": ("Llama4TextConfig", "Llama4ForCausalLM",
                                               dict(b, head_dim=8, intermediate_size_mlp=64, num_local_experts=2,
                                                    num_experts_per_tok=1, attention_chunk_size=4,
                                                    no_rope_layers=[1, 0], interleave_moe_layer_step=1,
                                                    attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
                                                    layer_types=["chunked_attention", "full_attention"])),
        "falcon (new arch, rotary)": ("FalconConfig", "FalconForCausalLM",
                                      dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           num_kv_heads=2, new_decoder_architecture=True, bos_token_id=0,
                                           eos_token_id=0)),
        "falcon (ALiBi)": ("FalconConfig", "FalconForCausalLM",
                           dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                                multi_query=False, new_decoder_architecture=False)),
        "bloom (ALiBi)": ("BloomConfig", "BloomForCausalLM",
                          dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)),
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                     dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel",
                 dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                        dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                             eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "gptj": ("GPTJConfig", "GPTJForCausalLM",
                 dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "codegen": ("CodeGenConfig", "CodeGenForCausalLM",
                    dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "opt (layerdrop: graph break per layer)": (
            "OPTConfig", "OPTForCausalLM",
            dict(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0, pad_token_id=1,
                 dropout=0.0, attention_dropout=0.0, layerdrop=1e-9)),
        "persimmon": ("PersimmonConfig", "PersimmonForCausalLM",
                      dict(b, num_key_value_heads=4, hidden_dropout=0.0, attention_dropout=0.0)),
    }


def make_fn(cfg_name: str, cls_name: str, kwargs: dict, attn: str = "eager"):
    import transformers as tf

    def make():
        torch.manual_seed(0)
        cfg = getattr(tf, cfg_name)(**kwargs)
        for k in ("attention_dropout", "attn_pdrop", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
            if hasattr(cfg, k) and isinstance(getattr(cfg, k), float):
                setattr(cfg, k, 0.0)
        cfg._attn_implementation = attn
        m = getattr(tf, cls_name)(cfg)
        m.set_attn_implementation(attn)
        return m
    return make


def run(names=None) -> list[dict]:
    import effpass
    from effpass.passes import FuseAttention, PackSequences
    from effpass.testing.packing import packed_vs_alone

    rows = []
    for name, (cfg, cls, kw) in families().items():
        if names and name not in names:
            continue
        t0 = time.time()
        row = {"family": name}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = packed_vs_alone(make_fn(cfg, cls, kw), [FuseAttention(), PackSequences()], lens=(5, 9, 7))
            s = r.stats
            row.update(result="isolated" if r.worst <= 1e-4 else "LEAK", worst=r.worst, plain=r.plain_err,
                       how=", ".join(f"{k} {s[k]}" for k in ("sdpa_rewritten", "softmax_masked", "sink_columns_kept",
                                                             "positions_per_example", "boundary_from_context")
                                     if s.get(k)))
        except Exception as e:  # noqa: BLE001 - the matrix records every outcome
            inner = getattr(e, "inner_exception", e)
            if isinstance(inner, effpass.WrongResultError):
                row.update(result="raised", reason=str(inner).split("would attend to each other: ")[-1][:400])
                rows.append(row)
                print(row, flush=True)
                continue
            row.update(result="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
        row["seconds"] = round(time.time() - t0, 1)
        print(row, flush=True)
        rows.append(row)
    return rows


def arm_key(family: str) -> str:
    """The arm name of a family (``"falcon (ALiBi)"`` -> ``falcon_alibi``)."""
    return re.sub(r"[^a-z0-9]+", "_", family.lower()).strip("_")


ARMS = {arm_key(name): name for name in families()}


def worker(arm: str, cfg: dict, device: str) -> dict:
    rows = [r for r in run([ARMS[arm]]) if r["family"] == ARMS[arm]]
    return {"arm": arm, **rows[0]}


def markdown(run_: dict) -> str:
    m = run_["meta"]
    rows = [r if r.get("status") == "ok" else {"family": ARMS.get(r["arm"], r["arm"]), "result": r.get("status"),
                                                "reason": (str(r.get("error", "")).strip().splitlines() or ["?"])[-1][:200]}
            for r in run_["results"]]
    lines = [f"# Packing matrix ({m['date'][:16].replace('T', ' ')} UTC)", "",
             f"torch {m['torch']}, transformers {m['transformers']}, {m['device']}, "
             f"load average {m['load_average'][0]:.1f}. `bench/bench_pack_matrix.py`: 2 layers, eager attention, "
             "training mode (dropout 0), fp32, `FuseAttention` + `PackSequences`, lowering eager, one packed row of "
             "5 + 9 + 7 tokens. worst = max relative error over each example's logits, the loss and every gradient "
             "against the examples run alone; plain HF = relative error of plain HF's logits on the same packed row "
             "(examples 2-3) against the packed effpass ones.", "",
             "| family | result | worst rel. error | plain HF | how (pass statistics) |", "|---|---|---|---|---|"]
    for r in rows:
        if r["result"] in ("isolated", "LEAK"):
            lines.append(f"| {r['family']} | {r['result']} | {r['worst']:.1e} | {r['plain']:.2f} | {r['how']} |")
        else:
            lines.append(f"| {r['family']} | {r['result']} | - | - | {r.get('reason', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    driver.main(__file__, workload="pack_matrix", arms=tuple(ARMS), worker=worker, markdown=markdown,
                cpu_shape=dict(quick=False), quick=dict(quick=True), overrides=(), deadline_s=900,
                jobs=lambda chosen, cfg: [(a, {}) for a in (chosen[:1] if cfg["quick"] else chosen)])
