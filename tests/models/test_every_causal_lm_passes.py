"""The hand-written family suite's pass columns over every causal-LM type the shrink rules build (issue 41.6;
tests/_auto_families.py, the types: tests/models/test_every_causal_lm.py). The checks are the hand suite's
(tests/_family_checks.py), each with its numerical and its structural oracle:

* ``apply_autocast`` bf16 and fp16 (its defaults, ``fp32_routers=False``): logits, loss and every gradient
  bit-identical to eager ``torch.autocast``; module capture, matmuls in the low dtype, no fp32 island.
* ``fuse_attention`` + ``apply_autocast`` bf16: against eager autocast with SDPA attention on the same weights,
  bit-identical or within a bound against fp32 (which one is recorded); every site fused or left with its reason,
  fp32 matmuls only where eager autocast has them.
* ``fuse_attention`` (eager attention, as in the hand suite): forward and gradients equal the unfused eager model
  (1e-5); every site left alone has its reason, and so has every site rewritten where SDPA has no fused kernel (e.g.
  head dim 16 in fp32 on a CPU), and a type where the pass finds no attention softmax at all is listed with why
  (``NO_ATTENTION_SOFTMAX``).
* ``quantize_linear`` int8: forward equals the prepared eager model (1e-5); every ``nn.Linear`` quantized or listed
  with its reason, every MoE expert tensor too.

A type a column cannot serve is listed beside it (``*_GAPS``) with the reason; the test checks the gap still holds
(a listed type that starts passing fails). Every column has run on every built type (2026-11-30; the matrix:
docs/families.md and bench/results/family_matrix_cpu.md; the fp16 and fused-under-autocast columns: docs/families.md
"The three cells added last"). Each column is a sweep: CI runs its first type and a
rotating 3% of the others (``SAMPLE``); ``EFFPASS_TEST_SWEEP=full`` runs all.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _auto_families import KNOWN_UNBUILT, build, causal_lm_types
from _family_checks import (autocast_bit_identical, fuse_attention_equals_unfused, fuse_attention_with_autocast,
                            quantize_int8_equals_prepared)
from effpass.testing import ModelCase, loss_of

BUILT = [t for t in causal_lm_types() if t not in KNOWN_UNBUILT]

#: CI's sample of each column: the first type and 3% of the others (of 161 built now: 5, another slice each
#: commit, every type within about 32 commits). Measured 2026-11-30 over the 324 cases run then: 3.4 CPU-s a case on
#: average (median 2.1, the heaviest 25: Qwen3.5-MoE's int8), so about 18 cases and 60 CPU-s a CI run.
SAMPLE = 0.03

#: Gaps, each ``type -> (reason, pattern)``: the column fails on the type for the reason given (upstream behaviour or a
#: quirk of the model), and the test checks it still does: the check raises, and its message matches ``pattern``.
#: type -> why its bf16 step is not bit-identical to eager torch.autocast
_AOT = "plain torch.compile(backend='aot_eager') under torch.autocast differs the same way (AOTAutograd's backward "
AUTOCAST_GAPS: dict[str, tuple[str, str]] = {
    "mamba": (_AOT + "rounds the fp32 A_log gradient differently: 3.6e-12); upstream", r"mixer\.A_log"),
    "falcon_mamba": (_AOT + "rounds the fp32 A_log gradient differently); upstream", r"mixer\.A_log"),
    "big_bird": (_AOT + "rounds the fp32 embedding and LayerNorm gradients differently: 4.5e-8); upstream",
                 r"bert\.embeddings\."),
    "hunyuan_v1_dense": (_AOT + "rounds the fp32 key_layernorm gradient differently: 4.7e-10); upstream",
                         r"self_attn\.key_layernorm\.weight"),
    "hunyuan_v1_moe": (_AOT + "rounds the fp32 key_layernorm gradient differently: 4.7e-10); upstream",
                       r"self_attn\.key_layernorm\.weight"),
    "jetmoe": (_AOT + "rounds the fp32 embedding gradient differently: 6.0e-8, the same bits); upstream",
               r"model\.embed_tokens\.weight"),
    "dory": (_AOT + "rounds the fp32 attention and MLP projection gradients differently: 1.5e-5, the same bits); "
             "upstream", r"self_attn\.q_proj\.weight"),
    "megatron-bert": (_AOT + "rounds the fp32 embedding, LayerNorm and attention gradients differently: 1.9e-6, the "
                      "same bits); upstream", r"bert\.embeddings\.word_embeddings\.weight"),
    "moshi": (_AOT + "rounds the fp32 embedding, v_proj and input_layernorm gradients differently: 4.9e-4, the same "
              "bits); upstream", r"model\.embed_tokens\.weight"),
    "rembert": (_AOT + "rounds the fp32 attention projection gradients differently: 6.0e-8, the same bits); upstream",
                r"rembert\.encoder\.layer\.0\.attention\.self\.query\.weight"),
    "inkling_text": ("plain torch.compile(backend='aot_eager') of the model with torch.autocast inside the compiled "
                     "forward (what the module capture compiles) gives the same gradients bit for bit, 8.0e-6 from "
                     "eager autocast (embedding, norms, k/v projections and short convolutions); with autocast "
                     "around the call 7.8e-6 (the same parameters); fp32 exact, eager deterministic; upstream",
                     r"model\.embed_tokens\.weight"),
    # newly built types (h2-unbuilt)
    "blt": (_AOT + "rounds the local encoder's gradients differently: 9.8e-4 on q_proj); upstream",
            r"model\.local_encoder\."),
    "cohere_compass_text": (_AOT + "rounds the fp32 embedding gradient differently: 3.7e-4); upstream",
                            r"model\.embed_tokens\.weight"),
    "dbrx": ("eager torch.autocast raises the same: its expert loop index_add_s the bf16 expert outputs into an fp32 "
             "buffer; upstream, a loud error", r"index_add_\(\): self \(Float\) and source \(BFloat16\)"),
    "gemma3n_text": (_AOT + "rounds the fp32 AltUp router gradient differently: 2.2e-7); upstream",
                     r"altup\.modality_router\.weight"),
    "gemma4": (_AOT + "rounds the fp32 embedding gradient differently: 1.8e-3); upstream",
               r"language_model\.embed_tokens\.weight"),
    "hrm_text": (_AOT + "rounds the attention gradients differently: 1.5e-8 on q_proj); upstream",
                 r"model\.L_module\.layers\.0\.self_attn\."),
    "jamba": (_AOT + "rounds the fp32 A_log gradient differently: 2.8e-14); upstream", r"mamba\.A_log"),
    "longcat_flash": (_AOT + "rounds the fp32 embedding gradient differently: 5.6e-4); upstream",
                      r"model\.embed_tokens\.weight"),
    "qwen4_exp": ("the embedding's fp32 gradient differs from eager autocast by 1.8e-5; plain aot_eager under autocast "
                  "fails in its backward (an aten.view of a _to_copy output whose strides do not allow it: upstream), "
                  "so there is no upstream oracle; not triaged", r"model\.embed_tokens\.weight"),
    "qwen4_exp_text": ("the embedding's fp32 gradient differs from eager autocast by 1.8e-5; plain aot_eager under "
                       "autocast fails in its backward (an aten.view of a _to_copy output whose strides do not allow "
                       "it: upstream), so there is no upstream oracle; not triaged", r"model\.embed_tokens\.weight"),
    "xmod": ("eager torch.autocast raises the same: its language adapter index-puts bf16 rows into an fp32 tensor "
             "(lang_adapter); upstream, a loud error", r"Index put requires the source and destination dtypes"),
    "zamba": (_AOT + "rounds the fp32 A_log gradient differently: 5.1e-21); upstream", r"mamba\.A_log"),
}
#: type -> why its fp16 step is not bit-identical to eager torch.autocast in fp16: the bf16 gaps less Gemma 3n (its
#: AltUp router gradient is bit-identical in fp16), each triaged 2026-11-30 against plain
#: torch.compile(backend="aot_eager") of the model with fp16 autocast inside its forward (what the module capture
#: compiles): the same gradients bit for bit, differing from eager autocast on the same parameters
_AOT16 = ("plain torch.compile(backend='aot_eager') under fp16 autocast gives these gradients bit for bit (AOTAutograd's "
          "backward rounds fp32 gradients differently from eager); upstream: ")
AUTOCAST_FP16_GAPS: dict[str, tuple[str, str]] = {
    "big_bird": (_AOT16 + "1.2e-07 on 4 fp32 gradient(s)", r"bert\.encoder\.layer\.0\.attention\.self\.query\.weight"),
    "blt": (_AOT16 + "2.4e-04 on 34 fp32 gradient(s)", r"model\.local_encoder\.layers\.0\.self_attn\.q_proj\.weight"),
    "cohere_compass_text": (_AOT16 + "4.6e-05 on 3 fp32 gradient(s)", r"model\.embed_tokens\.weight"),
    "dbrx": ("eager torch.autocast raises the same in fp16 as in bf16: its expert loop index_add_s the fp16 expert "
             "outputs into an fp32 buffer; upstream, a loud error",
             r"index_add_\(\): self \(Float\) and source \(Half\)"),
    "dory": (_AOT16 + "1.9e-06 on 6 fp32 gradient(s)", r"model\.layers\.0\.self_attn\.q_proj\.weight"),
    "falcon_mamba": (_AOT16 + "2.3e-10 on 1 fp32 gradient(s)", r"backbone\.layers\.0\.mixer\.A_log"),
    "gemma4": (_AOT16 + "2.3e-04 on 5 fp32 gradient(s)", r"model\.language_model\.embed_tokens\.weight"),
    "hrm_text": (_AOT16 + "2.4e-07 on 6 fp32 gradient(s)", r"model\.L_module\.layers\.0\.self_attn\.v_proj\.weight"),
    "hunyuan_v1_dense": (_AOT16 + "4.7e-10 on 1 fp32 gradient(s)", r"model\.layers\.0\.self_attn\.key_layernorm\.weight"),
    "hunyuan_v1_moe": (_AOT16 + "3.5e-10 on 1 fp32 gradient(s)", r"model\.layers\.0\.self_attn\.key_layernorm\.weight"),
    "inkling_text": (_AOT16 + "5.3e-05 on 8 fp32 gradient(s)", r"model\.embed_tokens\.weight"),
    "jamba": (_AOT16 + "9.1e-13 on 8 fp32 gradient(s)", r"model\.layers\.0\.mamba\.A_log"),
    "jetmoe": (_AOT16 + "1.5e-08 on 1 fp32 gradient(s)", r"model\.embed_tokens\.weight"),
    "longcat_flash": (_AOT16 + "1.2e-04 on 20 fp32 gradient(s)", r"model\.embed_tokens\.weight"),
    "mamba": (_AOT16 + "7.3e-12 on 1 fp32 gradient(s)", r"backbone\.layers\.0\.mixer\.A_log"),
    "megatron-bert": (_AOT16 + "3.3e-06 on 9 fp32 gradient(s)", r"bert\.embeddings\.word_embeddings\.weight"),
    "moshi": (_AOT16 + "6.1e-05 on 4 fp32 gradient(s)", r"model\.embed_tokens\.weight"),
    "qwen4_exp": ("as in bf16: fp32 gradients differ from eager fp16 autocast (embedding 3.2e-6, linear attention's "
                  "dt_bias and A_log); plain aot_eager under autocast fails in its backward (an aten.view of a "
                  "_to_copy output whose strides do not allow it: upstream), so there is no upstream oracle; not "
                  "triaged", r"model\.embed_tokens\.weight"),
    "qwen4_exp_text": ("as in bf16: fp32 gradients differ from eager fp16 autocast (embedding 3.2e-6, linear attention's "
                  "dt_bias and A_log); plain aot_eager under autocast fails in its backward (an aten.view of a "
                  "_to_copy output whose strides do not allow it: upstream), so there is no upstream oracle; not "
                  "triaged", r"model\.embed_tokens\.weight"),
    "rembert": (_AOT16 + "6.0e-08 on 4 fp32 gradient(s)", r"rembert\.encoder\.layer\.0\.attention\.self\.query\.weight"),
    "xmod": ("eager torch.autocast raises the same in fp16 as in bf16: its language adapter index-puts fp16 rows into "
             "an fp32 tensor (lang_adapter); upstream, a loud error",
             r"Index put requires the source and destination dtypes"),
    "zamba": (_AOT16 + "3.4e-21 on 3 fp32 gradient(s)", r"model\.layers\.0\.mamba\.A_log"),
}
#: type -> why fuse_attention + apply_autocast fails its check (tests/_family_checks.py fuse_attention_with_autocast)
FUSE_AUTOCAST_GAPS: dict[str, tuple[str, str]] = {
    "dbrx": ("eager torch.autocast raises (the reference): its expert loop index_add_s the bf16 expert outputs into an "
             "fp32 buffer; upstream, a loud error (as in the apply_autocast column)",
             r"index_add_\(\): self \(Float\) and source \(BFloat16\)"),
    "dory": ("transformers' Dory eager attention fails before effpass runs (as in the fuse_attention column: a looped "
             "model whose cached keys meet a mask built for its own tokens); upstream",
             r"size of tensor a \(16\) must match the size of tensor b \(8\)"),
    "xmod": ("eager torch.autocast raises (the reference): its language adapter index-puts bf16 rows into an fp32 "
             "tensor; upstream, a loud error (as in the apply_autocast column)",
             r"Index put requires the source and destination dtypes"),
}
#: type -> why fused attention does not equal the unfused model
FUSE_GAPS: dict[str, tuple[str, str]] = {
    "dory": ("transformers' Dory eager attention fails before effpass runs: a looped model, it concatenates the last "
             "loop's cached keys (shared_kv_states) to its own and adds the mask built for its own 8 tokens to "
             "scores over 16 keys; the unprepared eager model raises (its default SDPA path runs: the other "
             "columns); upstream", r"size of tensor a \(16\) must match the size of tensor b \(8\)"),
}
#: types where fuse_attention finds no softmax to look at, with why (the test checks it still finds none)
NO_ATTENTION_SOFTMAX: dict[str, str] = {
    "mamba": "a state-space model: no attention, no softmax",
    "falcon_mamba": "a state-space model: no attention, no softmax",
    "mamba2": "a state-space model: no attention, no softmax",
    "falcon": ("transformers' Falcon keeps SDPA whatever is asked (FalconPreTrainedModel._check_and_enable_sdpa sets "
               "config._attn_implementation = 'sdpa'), so its eager attention never runs: no softmax to fuse (the hand "
               "suite's Falcon rows cover fuse_attention on Falcon's SDPA call)"),
    # newly built types (h2-unbuilt)
    "reformer": "its local and LSH attention normalize by exp(x - logsumexp(x)), not a softmax the pass knows",
    "rwkv": "a recurrent model (time mixing with decayed state): no attention, no softmax",
    "xlstm": "a recurrent model (mLSTM cells): no attention, no softmax",
}
#: type -> why the int8 column fails (Mamba and Falcon-Mamba were here until quantize_linear left a linear whose weight
#: its parent reads directly, dt_proj, unquantized with the reason: tests/core/test_direct_weight_reads.py)
QUANT_GAPS: dict[str, tuple[str, str]] = {
    "prophetnet": ("AOTAutograd refuses its graph with torchao's int8 weight tensors as inputs ('torch.compile is "
                   "currently being used with tensor subclass inputs': two graph outputs alias one intermediate), both "
                   "lowerings: a loud error naming the pass that would be skipped, not a wrong answer; plain "
                   "torch.compile(backend='aot_eager') of the prepared model raises the same (with grad enabled; "
                   "under no_grad it runs, equal); upstream",
                   r"tensor subclass inputs"),
}


def _case(model_type: str, attn: str | None = None) -> ModelCase:
    """The built type as a ModelCase; ``attn``: the attention implementation (None: transformers' default, SDPA
    where the model has it). Parameters the loss does not reach (BigBird's pooler: eager leaves their gradient None,
    AOTAutograd gives zeros, see test_every_causal_lm.py) are frozen first, found by one eager step on a copy."""
    model, inputs = build(model_type)
    if attn is not None:
        model.set_attn_implementation(attn)
    probe = copy.deepcopy(model)
    loss_of(probe(**inputs)).backward()
    for n, p in probe.named_parameters():
        if p.requires_grad and p.grad is None:
            model.get_parameter(n).requires_grad_(False)
    return ModelCase(name=model_type, model=model, inputs=inputs, num_layers=1)


def _gap(gaps: dict[str, tuple[str, str]], model_type: str, check) -> bool:
    """Run ``check``; for a listed type, assert it still fails the way its entry says (strict: a listed type that
    passes fails here). True when the check ran and passed."""
    if model_type not in gaps:
        check()
        return True
    with pytest.raises((AssertionError, NotImplementedError, RuntimeError), match=gaps[model_type][1]):
        check()
    return False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("model_type", BUILT)
@pytest.mark.sweep(fraction=SAMPLE)
def test_apply_autocast_bit_identical_to_eager_autocast(model_type, dtype):
    case = _case(model_type)
    gaps = AUTOCAST_GAPS if dtype == torch.bfloat16 else AUTOCAST_FP16_GAPS
    _gap(gaps, model_type, lambda: autocast_bit_identical(case, dtype))


@pytest.mark.parametrize("model_type", BUILT)
@pytest.mark.sweep(fraction=SAMPLE)
def test_fuse_attention_equals_the_unfused_model(model_type):
    res = []

    def check():  # the case is built inside: a type's eager attention may fail on its own (a gap)
        case = _case(model_type, attn="eager")  # the softmax the pass fuses (as the hand suite; SDPA is fused already)
        res.append(fuse_attention_equals_unfused(case))

    if _gap(FUSE_GAPS, model_type, check):
        r = res[0]
        found = r.stats["fused"] + len(r.unfused) + len(r.skipped)
        assert (found == 0) == (model_type in NO_ATTENTION_SOFTMAX), (r.stats, r.skipped)


def _sdpa_twin(model_type: str):
    """The same type with Hugging Face's SDPA attention (its default where it has one; eager attention where it has
    none), the reference of the fused column under autocast; parameters the loss does not reach stay trainable here
    (eager leaves their gradient None: grads_of drops them, as it drops the case's frozen ones)."""
    model, _ = build(model_type)
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, NotImplementedError, AttributeError):  # no SDPA path: its own (eager) attention
        pass
    return model


@pytest.mark.parametrize("model_type", BUILT)
@pytest.mark.sweep(fraction=SAMPLE)
def test_fuse_attention_with_apply_autocast(model_type, record_property):
    """``fuse_attention`` + ``apply_autocast`` bf16 on eager attention against eager ``torch.autocast`` with SDPA
    attention on the same weights: bit-identical, or within the bound against fp32 (tests/_family_checks.py; which of
    the two is recorded in the test's properties: ``--junitxml``), every site fused or left with its reason."""
    res = []

    def check():
        case = _case(model_type, attn="eager")
        res.append(fuse_attention_with_autocast(case, _sdpa_twin(model_type)))

    if _gap(FUSE_AUTOCAST_GAPS, model_type, check):
        r = res[0]
        record_property("equal", r.equal)
        record_property("errors", r.errors)
        found = r.fuse["fused"] + r.fuse["unfused"] + len(r.skipped)
        assert (found == 0) == (model_type in NO_ATTENTION_SOFTMAX), (r.fuse, r.skipped)


@pytest.mark.parametrize("model_type", BUILT)
@pytest.mark.sweep(fraction=SAMPLE)
def test_quantize_linear_int8_equals_the_prepared_model(model_type):
    case = _case(model_type)
    res = []
    if _gap(QUANT_GAPS, model_type, lambda: res.append(quantize_int8_equals_prepared(case))):
        assert res[0].stats["quantized"] >= 1, res[0].skipped


def test_the_gap_lists_name_built_types_with_reasons():
    for gaps in (AUTOCAST_GAPS, AUTOCAST_FP16_GAPS, FUSE_GAPS, FUSE_AUTOCAST_GAPS, NO_ATTENTION_SOFTMAX,
                 QUANT_GAPS):
        assert set(gaps) <= set(BUILT), sorted(set(gaps) - set(BUILT))
        assert all(len(r if isinstance(r, str) else r[0]) > 20 for r in gaps.values())
