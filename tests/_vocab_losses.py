"""Preference / RL losses written as TRL writes them (logits -> log_softmax -> gather -> masked sum per sequence), for
the packing and FSDP tests of fuse_cross_entropy's vocabulary losses (issue 27): shared by
tests/passes/fuse_cross_entropy/test_fused_losses_packing.py and the 2-rank scenario in tests/passes/wrap_fsdp/test_wrap_fsdp.py.

:class:`SeqLoss` holds a trained policy and a frozen reference (run under ``torch.no_grad``) and computes per-token
log-probs of the labels, then per-*example* sums: on padded rows (one example per row) the masked row sum; on packed
rows (``position_ids`` restarting at 0 per example, as ``DataCollatorWithFlattening`` gives) a segment sum over the
example index ``cumsum(position_ids == 0) - 1`` read from the ``position_ids`` the loss is called with. The loss on
the per-example sums is then the same code: sigmoid DPO over (chosen, rejected) examples, or GRPO (ratio to the
detached policy times a per-example advantage, k3-KL to the reference, per-example token mean).

:class:`SelfLM` is a self-written causal LM (no Hugging Face code): embeddings and a ``ModuleList`` of blocks with
``F.scaled_dot_product_attention(is_causal=True)`` inside ``body``, a head with a bias and final-logit soft-capping.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

BETA_DPO, BETA_KL = 0.1, 0.04


def segments(position_ids: torch.Tensor) -> torch.Tensor:
    """The example index of every token of packed rows (restarts of ``position_ids`` at 0), counted over all rows."""
    return (position_ids == 0).reshape(-1).long().cumsum(0).reshape(position_ids.shape) - 1


class SeqLoss(nn.Module):
    """``forward(ids, labels, n_examples, position_ids=None, advantages=None) -> (loss, per-example policy log-prob
    sums)``; GRPO's advantages default to ``linspace(0.25, 1, n_examples)`` (not zero-mean: a loss near 0 would make
    a relative comparison meaningless)."""

    def __init__(self, policy: nn.Module, ref: nn.Module, kind: str):
        super().__init__()
        if kind not in ("dpo", "grpo"):
            raise ValueError(f"kind must be 'dpo' or 'grpo', got {kind!r}")
        self.policy, self.ref, self.kind = policy, ref, kind

    @staticmethod
    def _logits(model, ids, position_ids):
        kw = {} if position_ids is None else {"position_ids": position_ids}
        out = model(input_ids=ids, use_cache=False, **kw) if not isinstance(model, SelfLM) else model(ids, **kw)
        return out if isinstance(out, torch.Tensor) else out.logits

    def logps(self, model, ids, labels, position_ids):
        """TRL's form: per-token log-probs of the next tokens (labels clamped; masked afterwards)."""
        logits = self._logits(model, ids, position_ids)[:, :-1]
        t = labels[:, 1:]
        return logits.float().log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1), t != -100

    def forward(self, ids, labels, n_examples: int, position_ids=None, advantages=None):
        lp, mask = self.logps(self.policy, ids, labels, position_ids)
        with torch.no_grad():
            rp, _ = self.logps(self.ref, ids, labels, position_ids)
        adv = torch.linspace(0.25, 1.0, n_examples) if advantages is None else advantages
        if position_ids is None:   # padded: one example per row
            def per_example(v):
                return (v * mask).sum(-1)
            adv_tok = adv[:, None]
        else:                      # packed: the example of each predicted token (the label's position)
            seg = segments(position_ids)[:, 1:]

            def per_example(v):
                return torch.zeros(n_examples, dtype=v.dtype).index_add(0, seg.reshape(-1), (v * mask).reshape(-1))
            adv_tok = adv[seg]
        if self.kind == "dpo":
            pol, ref = per_example(lp), per_example(rp)
            margin = (pol - ref).reshape(2, -1)   # chosen examples, then rejected ones
            return -F.logsigmoid(BETA_DPO * (margin[0] - margin[1])).mean(), pol
        kl = torch.exp(rp - lp) - (rp - lp) - 1
        per_tok = -(torch.exp(lp - lp.detach()) * adv_tok - BETA_KL * kl)
        return (per_example(per_tok) / per_example(torch.ones_like(lp))).mean(), per_example(lp)


def frozen_copy(model: nn.Module, seed: int = 0) -> nn.Module:
    """A perturbed, frozen copy of ``model`` in eval mode: a reference or a teacher."""
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ref


def pair(policy: nn.Module, kind: str, seed: int = 0) -> SeqLoss:
    """``SeqLoss`` of ``policy`` (training mode) and a perturbed frozen copy as the reference."""
    policy = policy.train()
    return SeqLoss(policy, frozen_copy(policy, seed), kind)


def examples(lens, vocab: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lens]


def labels_of(ex: torch.Tensor, prompt: int = 2) -> torch.Tensor:
    """Labels of one example: its tokens, the first ``prompt`` (the prompt, as TRL masks it) ignored."""
    lab = ex.clone()
    lab[:prompt] = -100
    return lab


def packed(exs: list[torch.Tensor]):
    """``(ids, labels, position_ids)`` of one packed row (labels -100 on each example's prompt, so no prediction
    crosses an example boundary)."""
    ids = torch.cat(exs)[None]
    labels = torch.cat([labels_of(e) for e in exs])[None]
    pos = torch.cat([torch.arange(len(e)) for e in exs])[None]
    return ids, labels, pos


def padded(exs: list[torch.Tensor]):
    """``(ids, labels)``: one example per row, right-padded (padding ignored in the labels; causal attention never
    reads it from the real tokens)."""
    width = max(len(e) for e in exs)
    ids = torch.zeros(len(exs), width, dtype=torch.long)
    labels = torch.full((len(exs), width), -100, dtype=torch.long)
    for i, e in enumerate(exs):
        ids[i, :len(e)] = e
        labels[i, :len(e)] = labels_of(e)
    return ids, labels


# ------------------------------------------------------------------------------------------------------
# a self-written causal LM
# ------------------------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Body(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, max_len: int):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.emb(input_ids) + self.pos(position_ids)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class SelfLM(nn.Module):
    """``SelfLM(vocab)(input_ids, position_ids=None) -> logits``: learned positions (restart per packed example),
    causal SDPA blocks in ``body.blocks``, a biased head soft-capped at ``cap``."""

    def __init__(self, vocab: int = 128, d: int = 32, heads: int = 4, layers: int = 2, max_len: int = 64,
                 cap: float = 20.0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.cap = cap
        self.body = _Body(vocab, d, heads, layers, max_len)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, position_ids=None):
        z = self.head(self.body(input_ids, position_ids))
        return torch.tanh(z / self.cap) * self.cap


class Distill(nn.Module):
    """Forward KL(teacher || student) at temperature 2, token mean: a student and a frozen teacher (under
    ``torch.no_grad``); ``teacher_first`` runs the teacher's forward before the student's."""

    def __init__(self, student: nn.Module, teacher: nn.Module, teacher_first: bool):
        super().__init__()
        self.student, self.teacher, self.teacher_first = student, teacher, teacher_first

    def forward(self, ids):
        if self.teacher_first:
            with torch.no_grad():
                zt = self.teacher(input_ids=ids, use_cache=False).logits
            zs = self.student(input_ids=ids, use_cache=False).logits
        else:
            zs = self.student(input_ids=ids, use_cache=False).logits
            with torch.no_grad():
                zt = self.teacher(input_ids=ids, use_cache=False).logits
        ls, lt = (zs.float() / 2.0).log_softmax(-1), (zt.float() / 2.0).log_softmax(-1)
        return (lt.exp() * (lt - ls)).sum(-1).mean() * 4.0
