"""AdamW with its states and its step on the host: :class:`HostOffloadAdamW` (``effpass.HostOffloadAdamW``).

Full fine-tuning keeps, besides the parameters, AdamW's two states per parameter on the device (twice the
parameters' bytes in their dtype) and every gradient until ``opt.step()``. This optimizer keeps, per trainable
parameter of at least ``minimal_size`` elements, a host copy of the parameter (the one the update runs on), a host
gradient buffer and AdamW's states on the host; smaller parameters (norms' biases, ...) keep an ordinary AdamW on the
device, as torchao's ``CPUOffloadOptimizer`` does. On CUDA the host copy and the gradient buffer are pinned and
every copy between device and host runs non-blocking on one side stream.

Two ways to hand it a gradient:

* ``opt.step()`` (used on its own, like any optimizer): every offloaded parameter's ``.grad`` is copied to its host
  buffer (the device gradient stays in ``.grad``, freed by ``zero_grad``), then the host step;
* :meth:`HostOffloadAdamW.take_gradient` ``(param, grad)``: a finished gradient handed over as soon as it exists
  (``step_in_backward`` does this from inside the compiled backward graph). An offloaded parameter's gradient is
  copied to the host: on CUDA the copy is queued on the side stream after the work that made the gradient and the
  gradient's block is recorded on that stream (``record_stream``), so the caller drops it at once and the
  allocator reuses its memory once the copy is done; no host synchronisation. A small parameter is stepped on
  the device there and then (its own AdamW arithmetic). The caller keeps no reference: no parameter holds a
  ``.grad`` afterwards. ``step()`` then waits for the copies (``stream.synchronize()``), runs torch's AdamW
  (``fused`` by default: the fused CPU kernel) on the host copies of the parameters whose gradients it took, and
  copies those parameters back (non-blocking on the side stream, synchronised before it returns).

Exactness: the update is torch's own AdamW arithmetic (``torch.optim.adam.adam`` with decoupled weight decay, what
``torch.optim.AdamW.step`` calls) on the same values: the parameters are bit-identical to
``torch.optim.AdamW(..., fused=fused)`` stepping them in place (tested on CPU). The host copy is the master copy:
it is taken when the optimizer is built, so load the model's weights before building the optimizer.

The contract other code relies on (``step_in_backward`` checks it with :func:`takes_gradients`): an optimizer with
``takes_gradients = True`` and a ``take_gradient(param, grad)`` method; :meth:`HostOffloadAdamW.host_buffers` lists
the host tensors it holds (the memory planner sizes them; they are not device memory).
"""
from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["HostOffloadAdamW", "takes_gradients", "MINIMAL_SIZE"]

#: parameters with fewer elements keep an on-device AdamW (torchao CPUOffloadOptimizer's default)
MINIMAL_SIZE = 4096


def takes_gradients(opt) -> bool:
    """``opt`` takes a parameter's finished gradient through ``take_gradient(param, grad)`` (and steps in
    ``step()``) instead of being stepped one parameter at a time."""
    return bool(getattr(opt, "takes_gradients", False)) and callable(getattr(opt, "take_gradient", None))


class _Slot:
    """One offloaded parameter: its host copy, its host gradient buffer, whether a gradient was taken since the
    last ``step()``."""

    __slots__ = ("host", "grad", "taken", "group")

    def __init__(self, host: torch.Tensor, grad: torch.Tensor, group: int):
        self.host, self.grad, self.taken, self.group = host, grad, False, group


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose states and step live on the host (module docstring). Arguments as ``torch.optim.AdamW``'s
    (``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``); ``fused``: torch's fused AdamW
    kernel (default True; False: the single-tensor implementation); ``minimal_size``: parameters with fewer
    elements keep their states and step on the device.

    ``counters``: gradients taken (through :meth:`take_gradient` or ``step()``), bytes copied to the host and back,
    host and device updates, since the optimizer was built."""

    takes_gradients = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False, fused: bool = True,
                 minimal_size: int = MINIMAL_SIZE):
        if isinstance(minimal_size, bool) or not isinstance(minimal_size, int) or minimal_size < 0:
            raise ValueError(f"effpass HostOffloadAdamW: minimal_size must be an int >= 0, got {minimal_size!r}")
        if not isinstance(fused, bool):
            raise ValueError(f"effpass HostOffloadAdamW: fused must be True or False, got {fused!r}")
        if not 0.0 <= lr:
            raise ValueError(f"effpass HostOffloadAdamW: lr must be >= 0, got {lr!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"effpass HostOffloadAdamW: betas must be in [0, 1), got {betas!r}")
        # set before Optimizer.__init__, which calls add_param_group for every group
        self.minimal_size = minimal_size
        self._slots: dict[torch.Tensor, _Slot] = {}
        self._group_of: dict[torch.Tensor, int] = {}
        self._stream = None
        self.counters = {"gradients_taken": 0, "d2h_bytes": 0, "h2d_bytes": 0, "host_updates": 0,
                         "device_updates": 0}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, fused=fused)
        super().__init__(params, defaults)
        self.register_load_state_dict_post_hook(HostOffloadAdamW._states_to_host)

    # -- parameters -------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for p in self.param_groups[gi]["params"]:
            self._group_of[p] = gi
            if p.numel() >= self.minimal_size:
                self._slots[p] = self._new_slot(p, gi)

    def _new_slot(self, p: torch.Tensor, gi: int) -> _Slot:
        pin = p.is_cuda and not _is_fake(p)
        if pin and self._stream is None:
            self._stream = torch.cuda.Stream(device=p.device)
        with torch.no_grad():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.detach())
            grad = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
        return _Slot(host, grad, gi)

    def offloaded(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s states and step live on the host."""
        return p in self._slots

    def host_buffers(self) -> list[tuple[torch.Tensor, bool]]:
        """Every host tensor this optimizer holds, each with whether it is pinned on a CUDA device (the parameters'
        host copies and gradient buffers; AdamW's states of the offloaded parameters are plain host memory)."""
        out = []
        for p, slot in self._slots.items():
            out += [(slot.host, True), (slot.grad, True)]
            out += [(v, False) for v in self.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return out

    # -- gradients ------------------------------------------------------------------------------------------
    def take_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``param``'s finished gradient: copied to the host (offloaded parameters; non-blocking on the side stream
        on CUDA, the device gradient freed by the allocator once copied) or, for a small parameter, its device
        update applied now. The caller may drop ``grad`` at once; no host synchronisation."""
        slot = self._slots.get(param)
        if slot is None:
            gi = self._group_of.get(param)
            if gi is None:
                raise ValueError(f"effpass HostOffloadAdamW.take_gradient: a parameter of shape {tuple(param.shape)} "
                                 f"that this optimizer does not hold (it holds {len(self._group_of)} parameters)")
            with torch.no_grad():
                self._update(self.param_groups[gi], [param], [grad])
            self.counters["device_updates"] += 1
            return
        if slot.taken:
            raise RuntimeError("effpass HostOffloadAdamW.take_gradient: a second gradient for a parameter of shape "
                               f"{tuple(param.shape)} before step(): gradients are not accumulated on the host "
                               "(call step() after every backward)")
        self._to_host(slot, grad)

    def _to_host(self, slot: _Slot, grad: torch.Tensor) -> None:
        with torch.no_grad():
            if self._stream is not None and grad.is_cuda:
                self._stream.wait_stream(torch.cuda.current_stream(grad.device))
                with torch.cuda.stream(self._stream):
                    slot.grad.copy_(grad, non_blocking=True)
                grad.record_stream(self._stream)
            else:
                slot.grad.copy_(grad)
        slot.taken = True
        self.counters["gradients_taken"] += 1
        self.counters["d2h_bytes"] += slot.grad.numel() * slot.grad.element_size()

    # -- the step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Gradients left in ``.grad`` copied to the host, the host AdamW step on every parameter whose gradient
        was taken, those parameters copied back; small parameters with a ``.grad`` stepped on the device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, slot in self._slots.items():
            if not slot.taken and p.grad is not None:
                self._to_host(slot, p.grad)
        if self._stream is not None:
            self._stream.synchronize()
        back = []
        for gi, group in enumerate(self.param_groups):
            hosts, hgrads, small, sgrads = [], [], [], []
            for p in group["params"]:
                slot = self._slots.get(p)
                if slot is not None and slot.taken:
                    hosts.append((p, slot.host))
                    hgrads.append(slot.grad)
                    back.append((p, slot))
                elif slot is None and p.grad is not None:
                    small.append(p)
                    sgrads.append(p.grad)
            if hosts:
                self._update(group, hosts, hgrads)
                self.counters["host_updates"] += len(hosts)
            if small:
                self._update(group, small, sgrads)
                self.counters["device_updates"] += len(small)
        for p, slot in back:
            if self._stream is not None and p.is_cuda:
                with torch.cuda.stream(self._stream):
                    p.copy_(slot.host, non_blocking=True)
            else:
                p.copy_(slot.host)
            slot.taken = False
            self.counters["h2d_bytes"] += slot.host.numel() * slot.host.element_size()
        if self._stream is not None and back:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._stream.synchronize()  # the host copies may change again at the next step
        return loss

    def _update(self, group: dict, params: list, grads: list) -> None:
        """torch's AdamW update (``torch.optim.adam.adam``, decoupled weight decay) of ``params``: device
        parameters, or ``(device parameter, host copy)`` pairs (the state is keyed by the device parameter and
        lives beside the tensor updated)."""
        from torch.optim.adam import adam
        from torch.optim.optimizer import _get_scalar_dtype

        fused = group["fused"]
        targets, states = [], []
        for p in params:
            key, t = p if isinstance(p, tuple) else (p, p)
            st = self.state[key]
            if not st:
                st["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=t.device) if fused
                              else torch.tensor(0.0, dtype=_get_scalar_dtype()))
                st["exp_avg"] = torch.zeros_like(t, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    st["max_exp_avg_sq"] = torch.zeros_like(t, memory_format=torch.preserve_format)
            targets.append(t)
            states.append(st)
        beta1, beta2 = group["betas"]
        adam(targets, list(grads), [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
             [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [], [s["step"] for s in states],
             foreach=False, capturable=False, differentiable=False, fused=fused, grad_scale=None, found_inf=None,
             has_complex=any(torch.is_complex(t) for t in targets), decoupled_weight_decay=True,
             amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"])

    def _states_to_host(self) -> None:
        """After ``load_state_dict`` (which moves every state to its parameter's device): the offloaded
        parameters' states back on the host."""
        for p in self._slots:
            st = self.state.get(p)
            for k, v in list((st or {}).items()):
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    st[k] = v.to("cpu")
