"""Packed rows against the examples run alone: the oracle of ``pack_sequences`` (tests and the family matrix).

``packed_vs_alone(make, passes, lens)`` builds two models with identical weights from ``make()``, compiles one
with ``passes`` (e.g. ``FuseAttention`` + ``PackSequences``), runs one packed row of ``len(lens)`` examples (``position_ids``
restarting at 0, labels as ``DataCollatorWithFlattening`` makes them) forward and backward, and runs each
example alone on the eager copy. It returns the worst relative error of each example's logits, of the loss
(against the token-weighted loss of the examples alone) and of every gradient (against the sum of the
examples' gradients), plus the pass's statistics."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

__all__ = ["PackedResult", "packed_vs_alone", "rel_err"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


@dataclass
class PackedResult:
    logits_err: list[float]
    loss_err: float
    grad_err: float
    stats: dict[str, Any]
    records: list[Any] = field(default_factory=list)
    plain_err: float = 0.0  #: the same packed row on the eager model without the pass (the leak it fixes)

    @property
    def worst(self) -> float:
        return max([*self.logits_err, self.loss_err, self.grad_err])


def packed_vs_alone(make: Callable[[], torch.nn.Module], passes: Sequence[Any], lens: Sequence[int] = (5, 9, 3), *,
                    vocab: int = 128, seed: int = 1, train: bool = True,
                    grads: bool = True, kwargs: dict | None = None) -> PackedResult:
    import effpass

    model = make()
    ref = copy.deepcopy(model)
    model.train(train)
    ref.train(train)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lens)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    labels = ids.clone()
    labels[pos == 0] = -100
    extra = dict(kwargs or {})
    torch._dynamo.reset()
    compiled = effpass.compile(model, passes=list(passes),
                               lowering="eager", strict=True)
    out = compiled(input_ids=ids, position_ids=pos, labels=labels, **extra)
    if grads:
        out.loss.backward()
    logits_err, s = [], 0
    alone_loss = 0.0
    tokens = 0
    plain = None
    for n in lens:
        o = ref(input_ids=ids[:, s:s + n], labels=ids[:, s:s + n], **extra)
        logits_err.append(rel_err(out.logits[:, s:s + n].detach(), o.logits.detach()))
        if grads:
            (o.loss * (n - 1)).backward()
        alone_loss = alone_loss + o.loss.detach() * (n - 1)
        tokens += n - 1
        s += n
    loss_err = rel_err(out.loss.detach(), alone_loss / tokens)
    grad_err = 0.0
    if grads:
        for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
            if r.grad is None or p.grad is None:
                continue
            want = r.grad / tokens
            if want.abs().max() > 1e-8:
                grad_err = max(grad_err, rel_err(p.grad, want))
    with torch.no_grad():
        plain_logits = ref(input_ids=ids, position_ids=pos, **extra).logits
        s = lens[0]
        plain = rel_err(plain_logits[:, s:], out.logits[:, s:].detach()) if len(lens) > 1 else 0.0
    rep = effpass.report(compiled)
    return PackedResult(logits_err, loss_err, grad_err, rep.stats("pack_sequences"),
                        list(rep.records("pack_sequences")), plain)
