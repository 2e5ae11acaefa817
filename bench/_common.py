"""Measurement helpers shared by the bench/ scripts: models, batches, timing one step the same way on every
device. The process, deadline and results-file plumbing is ``bench/driver.py``."""
from __future__ import annotations

import time
from typing import Callable

import torch


def timed(step: Callable[[], object], cuda: bool) -> float:
    """Seconds one call of ``step`` takes: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def llama(cfg: dict, device: str, *, tie: bool | None = None, train: bool = True):
    """A Llama-shaped Hugging Face model with random weights (seed 0, SDPA attention) from a bench shape
    (``vocab``, ``hidden``, ``ffn``, ``layers``, ``heads``, ``kv_heads``, ``seq``, ``dtype``)."""
    import transformers as tf

    torch.manual_seed(0)
    extra = {} if tie is None else {"tie_word_embeddings": tie}
    conf = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                          num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                          num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seq"],
                          bos_token_id=0, eos_token_id=0, use_cache=False, **extra)
    conf._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(conf).to(device=device, dtype=getattr(torch, cfg["dtype"]))
    return model.train(train)


def token_batches(cfg: dict, device: str, n: int = 1) -> list:
    """``n`` random ``[batch, seq]`` token batches (generator seed 1)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(device) for _ in range(n)]


def time_steps(step: Callable[[], object], cfg: dict, cuda: bool) -> dict:
    """The first call's seconds, then ``cfg["warmup"]`` calls, then the median wall and CPU seconds of
    ``cfg["steps"]`` calls (and each call's, ``steps_s`` / ``steps_cpu_s``)."""
    import statistics

    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(cfg["warmup"]):
        step()
    times, cpu = [], []
    for _ in range(cfg["steps"]):
        c0 = time.process_time()
        times.append(timed(step, cuda))
        cpu.append(time.process_time() - c0)
    return {"first_call_s": first, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "steps_s": times, "steps_cpu_s": cpu}


#: H100/H200 SXM bf16 dense peak (the spec sheet): the MFU convention of the GPU proof (anchors.md)
PEAK_BF16_FLOPS = 989e12


def extrapolate_layers(step_s: float, tokens: int, fpt_rest: float, fpt_layer: float, layers: int, *,
                       to: int = 32, peak: float = PEAK_BF16_FLOPS) -> dict:
    """A step measured with ``layers`` decoder layers, extrapolated to ``to`` layers (the GPU proof's convention):
    the step's time is split between the layers and the rest (embedding, head, loss) in proportion to their
    training FLOPs per token (``fpt_layer`` per layer, ``fpt_rest``); the layers' part is scaled by
    ``to / layers``, the rest kept. tokens/s at ``to`` layers is ``tokens`` over that time; MFU is the
    ``to``-layer model's FLOPs per token times those tokens/s over ``peak``. (Where layers and head run at the
    same FLOP rate this MFU equals the measured one; ``rest_share`` says how much of the measured step's FLOPs
    were not layers, the part whose rate differs.)"""
    f_meas = fpt_rest + layers * fpt_layer
    t_layers = step_s * layers * fpt_layer / f_meas
    t_to = step_s - t_layers + t_layers * to / layers
    tps = tokens / t_to
    return {f"step_s_{to}": t_to, f"tokens_per_s_{to}": tps, f"mfu_{to}": tps * (fpt_rest + to * fpt_layer) / peak,
            "rest_share": fpt_rest / f_meas, f"rest_share_{to}": fpt_rest / (fpt_rest + to * fpt_layer),
            "mfu_convention": f"time split layers/rest by FLOPs, layers scaled to {to}; {peak / 1e12:.0f} TFLOP/s peak"}


def llama_flops(cfg: dict, *, trained: str = "all", adapter_params_per_layer: int = 0) -> tuple[float, float]:
    """Training FLOPs per token of a Llama shape (``hidden``, ``ffn``, ``vocab``, ``heads``, ``kv_heads``,
    ``seq``), as (rest, per layer), anchors.md's convention: 6 N over the matmul weights when all are trained,
    4 N when frozen (forward 2 N, input gradients 2 N) plus 6 per adapter parameter; attention 12 H Q T per
    layer; the embedding lookup counts nothing, the head (untied or tied) counts as a matmul."""
    h, f, heads, kv = cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["kv_heads"]
    q = h // heads
    k = 6 if trained == "all" else 4
    per_layer = k * (2 * h * h + 2 * h * kv * q + 3 * h * f) + 12 * heads * q * cfg["seq"] \
        + 6 * adapter_params_per_layer
    return k * cfg["vocab"] * h, per_layer
