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
