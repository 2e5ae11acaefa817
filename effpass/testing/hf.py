"""Offline Hugging Face fixtures for tests and examples: a word-level tokenizer built in memory (no
download) and small synthetic datasets for ``Trainer`` and TRL's ``SFTTrainer``."""
from __future__ import annotations

import torch

__all__ = ["tiny_tokenizer", "lm_dataset", "text_dataset", "VOCAB"]

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
