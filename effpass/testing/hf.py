"""Offline Hugging Face fixtures for tests and examples: a word-level tokenizer built in memory (no
download) and small synthetic datasets for ``Trainer`` and TRL's ``SFTTrainer``."""
from __future__ import annotations

import torch

__all__ = ["tiny_tokenizer", "lm_dataset", "text_dataset", "sft_padding_free", "examples_alone_losses", "VOCAB"]

#: the vocabulary size of :func:`tiny_tokenizer` (matches ``model_case``'s models: 256)
VOCAB = 256


def tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` over the words ``<eos> <unk> w0 .. w253`` (ids 0..255), built in memory.
    ``<eos>`` (id 0, the test models' eos/bos id) is also the padding token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")


def lm_dataset(n: int = 16, seq: int = 16, *, seed: int = 0, masked_tail: bool = True):
    """``datasets.Dataset`` of ``input_ids``/``attention_mask``/``labels`` rows of length ``seq``. With
    ``masked_tail`` each row's labels end in a random number of ``-100`` (so microbatches hold different
    numbers of label tokens, which is what ``num_items_in_batch`` loss scaling is about)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, seq), generator=g)
    labels = ids.clone()
    if masked_tail:
        for i, keep in enumerate(torch.randint(seq // 4, seq + 1, (n,), generator=g).tolist()):
            labels[i, keep:] = -100
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq] * n,
                                       "labels": labels.tolist()})


def text_dataset(n: int = 16, words: int = 12, *, seed: int = 0):
    """``datasets.Dataset`` with a ``text`` column of ``words`` random words each (TRL's language-modeling
    format; equal lengths keep one compiled graph)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, VOCAB - 2, (n, words), generator=g).tolist()
    return datasets.Dataset.from_dict({"text": [" ".join(f"w{i}" for i in r) for r in rows]})


def sft_padding_free(model, out_dir, lengths, *, steps: int, batch: int = 4, seed: int = 0):
    """Train ``model`` with TRL's ``SFTTrainer(padding_free=True)`` on texts of ``lengths`` words (fp32, learning
    rate 0, no gradient checkpointing, one logged loss per step). Returns ``(losses, batches, trainer)``:
    ``batches`` are the packed batches as TRL built them (``input_ids``, ``labels``, ``position_ids``),
    captured before any other forward pre-hook."""
    import datasets
    import trl

    g = torch.Generator().manual_seed(seed)
    text = [" ".join(f"w{j}" for j in torch.randint(0, VOCAB - 6, (n,), generator=g).tolist()) for n in lengths]
    batches: list[dict] = []

    @torch._dynamo.disable
    def capture(module, args, kwargs):
        batches.append({k: kwargs[k].clone() for k in ("input_ids", "labels", "position_ids") if k in kwargs})

    handle = model.register_forward_pre_hook(capture, with_kwargs=True, prepend=True)
    config = trl.SFTConfig(str(out_dir), padding_free=True, max_length=None, max_steps=steps,
                           per_device_train_batch_size=batch, learning_rate=0.0, logging_steps=1, report_to=[],
                           seed=seed, save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False,
                           gradient_checkpointing=False)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": text}),
                             processing_class=tiny_tokenizer())
    try:
        trainer.train()
    finally:
        handle.remove()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, batches, trainer


def examples_alone_losses(reference, batches) -> list[float]:
    """For each packed batch (one row, ``position_ids`` restarting at 0 per example): the token-weighted mean of
    the loss of each example run alone through ``reference`` (per-example separation by construction)."""
    out = []
    for b in batches:
        starts = (b["position_ids"][0] == 0).nonzero().flatten().tolist() + [b["position_ids"].shape[1]]
        total, count = 0.0, 0
        for s, e in zip(starts[:-1], starts[1:]):
            t = b["input_ids"][:, s:e]
            with torch.no_grad():
                total += reference(input_ids=t, labels=t, use_cache=False).loss.item() * (e - s - 1)
            count += e - s - 1
        out.append(total / count)
    return out
