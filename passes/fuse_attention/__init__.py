"""``fuse_attention``: hand-written attention becomes one fused attention call, K/V kept un-repeated.

What it does
    Finds attention written out by hand (``softmax(q @ k^T * scale + mask) @ v``, with the variants
    listed below) in the graph Dynamo hands over and replaces each site with
    ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): ``is_causal=True`` where the mask is
    provably causal, ``attn_mask`` otherwise, ``enable_gqa=True`` with the un-repeated K/V for
    grouped-query and multi-query attention, and the dropout probability in training. SDPA picks its
    kernel itself: FlashAttention on CUDA for fp16/bf16 (GQA included), the fused flash kernel on CPU.

Phase: torch IR (``transform_torch_ir``), and why
    At this level the graph is small and its ops are torch functions, so one structural matcher
    covers ``torch.matmul``/``@``/``bmm``, ``softmax`` in its three spellings, ``masked_fill``,
    ``where``, ``dropout`` and the casts, whatever the model's layout. The replacement is an ordinary
    torch call: AOTAutograd traces it afterwards and derives a correct backward, and the rewrite works
    for both lowerings (Inductor and eager). At the aten level the same sites are split into
    layout-specific ``bmm``/``expand``/``clone`` patterns (Inductor needs ~30 fixed patterns there and
    still misses the Llama causal form); the forward+backward would also have to be rewritten together.

Matching (``passes/fuse_attention/matching.py``): torch's pattern matcher (``torch._inductor.pattern_matcher``) matches
the spine ``softmax(scores) [-> cast | view | dropout] -> weights @ v`` and the score root ``q @ k^T`` (or
``baddbmm``); the pattern's extra check walks the variable-length scale and mask chain between them and
checks what each op is; constant evaluation (``passes/fuse_attention/proofs.py``) proves causality, non-empty
rows and GQA index tensors. The graph is canonical (:mod:`effpass.canonicalize`), so one spelling per op.

Recognised forms:
    * scores ``q @ k^T`` (``k^T`` by ``transpose``/``permute``, or any ``(…, D, S)`` tensor), scaled by
      any chain of ``*``/``/`` by Python numbers (or pre-scaled q, which is simply part of q), in place
      too (``/=``, ``*=``, ``+=``, ``masked_fill_``: Falcon), through same-shape ``view``/``reshape``;
    * multi-query attention by broadcasting (one K/V head against every query head, Falcon);
    * BLOOM's ALiBi: ``alibi.baddbmm(q, k^T, beta=b, alpha=a)`` on (B*H, S, D) tensors, the scores viewed as
      (B, H, Sq, Sk) for the mask and the weights viewed back for ``bmm`` with v: ``a`` joins the scale, the
      bias (``b`` times the later scales) becomes one more additive mask term in the (B, H, ...) layout, and
      q, k, v are viewed as (B, H, S, D) for SDPA (its output viewed back);
    * masks, any combination: additive float tensors (``scores + mask``: BERT padding, Hugging Face
      5.x masks, constant ALiBi-style biases), ``masked_fill(mask, v)`` and ``where(cond, scores, v)`` /
      ``where(cond, v, scores)`` with ``v`` = ``-inf`` or ``<= -1e4`` (Hugging Face uses ``finfo.min``);
    * softmax over the last dim, in the input dtype or upcast (``.float()``, ``dtype=``) and cast back;
    * optional ``dropout`` on the weights (``training=True`` only; ``p`` becomes ``dropout_p``);
    * ``@ v``; K/V repeated for GQA/MQA by ``x[:, :, None].expand(...).reshape(...)`` (HF
      ``repeat_kv``), ``unsqueeze(2).expand().reshape()``, ``repeat_interleave(r, dim=1)`` or indexing
      with ``arange(H) // r``.

Proving causality
    A mask is causal when it is a compile-time constant (no graph input among its ancestors; with
    ``assume_constant_buffers`` registered buffers count as constants, which is how a GPT-2/nanoGPT
    ``bias`` buffer is recognised) that evaluates, at the real shape, to exactly the lower triangle over
    a square ``S x S`` score matrix (masked values ``-inf`` or ``<= -1e4``, kept values exactly 0 for
    additive masks). Evaluation is skipped above ``max_mask_eval_elements``; such masks, and every mask
    that is not provably causal, are passed as ``attn_mask`` (always correct). ``q_len != kv_len``
    (decoding with a cache) never uses ``is_causal`` (SDPA aligns it top-left).

Autocast: a site inside an autocast region (one Dynamo recorded, e.g. ``apply_autocast``'s module capture,
or autocast entered around the compiled call, as accelerate/TRL do for ``bf16=True``) runs both matmuls in
the autocast dtype in eager, whatever the dtypes of q, k, v (Llama's rotated q/k are fp32 while v is bf16);
SDPA gets q, k, v and a float mask cast to that dtype, which is what Hugging Face's SDPA attention computes
under autocast (bit-identical on the tested families, docs/passes/apply_autocast.md).

Left alone, with the reason in ``PassResult.skipped`` (and the dump): softmax over another dim; a scale
that is not a constant positive number; a mask computed from the scores ("mask depends on data"); an
additive bias that requires grad ("bias is not a mask": T5 relative bias, learned ALiBi); attention
weights used elsewhere (``output_attentions``); q/k/v of different dtypes outside autocast (two
precisions, not one SDPA call) or broadcast batch dims.

Runs after: nothing (it is the first graph pass). ``apply_autocast`` and ``checkpoint_activations``
run after it, so autocast sees the fused op (SDPA is on autocast's lower-precision list) and the
checkpointing policy sees the fused op instead of the ``S x S`` intermediates.

Invariants: only nodes of matched sites are replaced; every new node carries the replaced node's
``nn_module_stack`` and a fake ``example_value``; placeholders are never added or removed.

Fully masked rows (a query that may attend to no key: left padding). torch's fused CPU kernel computes
wrong gradients there with a finite fill (HF's ``finfo.min``), and ``-inf`` gives NaN. A site whose mask
may hold such rows (any mask from the inputs; stat ``empty_row_guard``) calls
:func:`effpass.attention.masked_sdpa`: such rows get every key and a query of value 0 carrying q's
gradient, so the fused kernel runs and their output is eager's (uniform weights: the mean of v), and a
zero-valued term adds eager's gradient into k: forward and backward equal eager's, also for a loss that reads
the padded positions.

Statistics: ``rewritten`` (sites replaced), ``fused`` (of those, sites where a fused kernel runs: SDPA's
own dispatcher asked with the site's dtype, device, head dim, mask and dropout, or flash-attn), and
``unfused`` (rewritten, but SDPA runs its math op: e.g. dropout on CPU; listed with the reason among the
skipped sites, flag ``unfused``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

import effpass
from effpass.attention import SDPA_PARAMS, masked_sdpa, sdpa_arguments
from effpass.graph import AutocastRegions, Skip, annotate_new_nodes, erase_dead, is_softmax, shape_of, site_name, val

from .kv import strip_transpose, unrepeat
from .matching import Site, match_site
from .proofs import ConstEval, is_causal, rows_nonempty, sdpa_mask_causal

__all__ = ["FuseAttention"]


# ------------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------------
@effpass.register_pass("fuse_attention")
@dataclass(frozen=True, kw_only=True)
class FuseAttention(effpass.Pass):
    """Fuse hand-written attention into scaled_dot_product_attention (flash kernels), GQA K/V un-repeated.

    Before (Hugging Face eager Llama attention, torch IR)::

        k_rep  = k[:, :, None].expand(B, 2, 2, S, D).reshape(B, 4, S, D)   # and v_rep alike
        scores = torch.matmul(q, k_rep.transpose(2, 3)) * 0.125
        scores = scores + mask                                            # causal, 0 / finfo.min
        probs  = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs  = F.dropout(probs, p=0.0, training=False)
        out    = torch.matmul(probs, v_rep)

    After::

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    """

    gqa: bool = field(default=True, metadata={"doc": "feed SDPA the un-repeated K/V (enable_gqa=True) for GQA/MQA"})
    prove_causal: bool = field(default=True, metadata={
        "doc": "use is_causal=True where the mask is provably causal (else always pass attn_mask)"})
    assume_constant_buffers: bool = field(default=True, metadata={
        "doc": "treat registered buffers (GPT-2's causal 'bias') as constants when proving causality"})
    max_mask_eval_elements: int = field(default=1 << 26, metadata={
        "doc": "largest constant mask subgraph (elements) evaluated at compile time to prove causality"})
    sdpa_masks: bool = field(default=True, metadata={
        "doc": "an existing SDPA call whose attn_mask is a provably causal constant (transformers builds one under "
               "torch.compile) gets is_causal=True and no mask: no (S x S) mask kept for backward, flash kernels"})

    def validate(self) -> None:
        if self.max_mask_eval_elements < 0:
            raise ValueError(f"max_mask_eval_elements must be >= 0, got {self.max_mask_eval_elements}")

    @classmethod
    def enabled_by_default(cls, device=None) -> bool:
        return True

    @classmethod
    def default_note(cls) -> str:
        return "on for every device (the replacement computes the same function)"

    # -- the hook -----------------------------------------------------------------------------------------
    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        graph = gm.graph
        const = ConstEval(gm, ctx, self.assume_constant_buffers, self.max_mask_eval_elements)
        regions = AutocastRegions(graph)
        stats = {"rewritten": 0, "fused": 0, "unfused": 0, "causal": 0, "attn_mask": 0, "gqa": 0, "dropout": 0,
                 "empty_row_guard": 0, "skipped": 0}
        unfused: list[dict] = []
        skipped = []
        model_sdpa = [n for n in graph.nodes if n.op == "call_function" and n.target is F.scaled_dot_product_attention]
        # the scope keeps the softmaxes in targets/exclude (and warns, naming the pass, when it keeps none)
        for sm in ctx.scope.select_nodes(gm, [n for n in graph.nodes if is_softmax(n)], what="attention softmax"):
            where = site_name(sm)
            try:
                site = match_site(sm, const)
                self._rewrite(graph, site, const, stats, unfused, where, regions)
            except Skip as e:
                stats["skipped"] += 1
                skipped.append({"site": where, "reason": str(e)})
        if self.sdpa_masks and self.prove_causal:
            skipped += self._causal_sdpa_masks(gm, ctx, const, stats, model_sdpa)
        changed = stats["rewritten"] > 0 or stats.get("sdpa_mask_causal", 0) > 0
        if changed:
            graph.lint()
        # NOTE: rewritten sites whose SDPA call will not run a fused kernel are listed with the left-alone ones
        # (flag "unfused"), so the dump and report show every site that does not get a fused kernel, and why
        return effpass.PassResult(changed=changed, stats=stats, skipped=skipped + unfused)

    def _causal_sdpa_masks(self, gm: fx.GraphModule, ctx, const: ConstEval, stats: dict, sites: list) -> list:
        """SDPA calls the model made itself (e.g. transformers' ``sdpa`` attention, which under torch.compile
        materialises its causal mask when there is no cache): a mask proven exactly causal becomes
        ``is_causal=True``. Returns the kept masks' reasons (for the report)."""
        stats.update(sdpa_mask_causal=0, sdpa_mask_kept=0)
        kept, proofs = [], {}  # one proof per mask node (transformers passes one mask to every layer)
        for n in ctx.scope.select_nodes(gm, sites, what="SDPA call") if sites else ():
            a = sdpa_arguments(n)
            mask = a.get("attn_mask")
            if not isinstance(mask, fx.Node) or a.get("is_causal", False) is not False:
                continue
            sq, sk = (_length(a.get(x)) for x in ("query", "key"))
            if not (isinstance(sq, int) and isinstance(sk, int)):  # symbolic lengths (packing marks them dynamic)
                why = f"query/key lengths ({sq}, {sk}) are not static"
            else:
                if (mask, sq, sk) not in proofs:
                    proofs[mask, sq, sk] = sdpa_mask_causal(mask, const, sq, sk)
                why = proofs[mask, sq, sk]
            if why is not None:
                stats["sdpa_mask_kept"] += 1
                kept.append({"site": site_name(n), "reason": f"the model's SDPA call keeps its attn_mask: {why}"})
                continue
            n.kwargs = {**dict(zip(SDPA_PARAMS[3:], n.args[3:])), **n.kwargs, "attn_mask": None, "is_causal": True}
            n.args = n.args[:3]
            erase_dead(gm.graph, [mask], producers=True)
            stats["sdpa_mask_causal"] += 1
        return kept

    def _rewrite(self, graph: fx.Graph, site: Site, const: ConstEval, stats: dict, unfused: list,
                 where: str, autocast: AutocastRegions) -> None:
        qv, vv = val(site.q), val(site.v)
        k = strip_transpose(site.k_t)
        kv_ = val(k) if k is not None else None
        if k is not None and (kv_ is None or kv_.dim() != qv.dim()):
            k = None
        if qv is None or vv is None or qv.dim() != vv.dim():
            raise Skip("q and v have different ranks")
        dtypes = (qv.dtype, val(site.k_t).dtype, vv.dtype)
        # NOTE(autocast): under autocast both matmuls run in the autocast dtype whatever q, k, v are (Llama's
        # rotary output is fp32 while v is bf16); SDPA then gets q, k, v (and a float mask) cast to it
        ac = autocast.dtype_at(site.qk, qv.device.type)
        if ac != autocast.dtype_at(site.pv, qv.device.type):
            raise Skip("q @ k^T and weights @ v run under different autocast states")
        if ac is not None and all(d in (torch.float32, torch.float16, torch.bfloat16) for d in dtypes):
            compute = ac
        elif len(set(dtypes)) == 1:
            compute = qv.dtype
        else:
            raise Skip(f"q, k, v dtypes differ ({qv.dtype}, {val(site.k_t).dtype}, {vv.dtype}) outside autocast")
        if val(site.pv).dtype != compute:
            raise Skip(f"attention output dtype ({val(site.pv).dtype}) differs from the matmuls' ({compute})")
        kt_shape = shape_of(site.k_t)
        k_base, v_base, rep = k, site.v, 1
        mqa = (qv.dim() == 4 and k is not None and len(kt_shape) == 4 and kt_shape[1] == 1 and vv.shape[1] == 1
               and qv.shape[1] > 1 and kt_shape[0] == qv.shape[0] == vv.shape[0])
        if mqa:
            # multi-query attention by broadcasting (Falcon): one K/V head matmul'ed against every query head
            rep = int(qv.shape[1])
            if not self.gqa:
                raise Skip("multi-query attention by broadcasting needs gqa=True")
        elif tuple(qv.shape[:-2]) != tuple(kt_shape[:-2]) or tuple(qv.shape[:-2]) != tuple(vv.shape[:-2]):
            raise Skip("q, k, v batch dims differ (broadcast matmul)")
        if self.gqa and k is not None and not mqa:
            ku, vu = unrepeat(k, const), unrepeat(site.v, const)
            if ku and vu and ku[1] == vu[1] and shape_of(ku[0])[1] == shape_of(vu[0])[1] and ku[1] > 1:
                k_base, v_base, rep = ku[0], vu[0], ku[1]
        causal = self.prove_causal and is_causal(site, const)

        with graph.inserting_before(site.pv):
            new_nodes = []

            def call(fn, *args, **kwargs):
                n = graph.call_function(fn, args, kwargs)
                new_nodes.append(n)
                return n

            if k_base is None:
                k_base = call(torch.transpose, site.k_t, -2, -1)
            q_in = site.q
            # autocast casts each matmul operand to its dtype: cast once, before SDPA (none where equal;
            # K/V un-repeated or transposed back keep the dtype of the k^T / v the matmuls read)
            q_in, k_base, v_base = (x if dt == compute else call(torch.Tensor.to, x, compute)
                                    for x, dt in zip((q_in, k_base, v_base), dtypes))
            if site.heads is not None:
                # BLOOM: q, k, v as (B*H, S, D) become (B, H, S, D) views, SDPA's layout
                B, H = site.heads
                # shapes from the matmuls' operands: a cast or transpose made above has no example value yet
                k_shape = (*kt_shape[:-2], kt_shape[-1], kt_shape[-2])
                q_in = call(torch.reshape, q_in, (B, H, *qv.shape[1:]))
                k_base = call(torch.reshape, k_base, (B, H, *k_shape[1:]))
                v_base = call(torch.reshape, v_base, (B, H, *vv.shape[1:]))

            def term(m):
                if site.heads is None or m not in site.split_terms or val(m).dim() < 3:
                    return m
                B, H = site.heads
                return call(torch.reshape, m, (B, H, *val(m).shape[1:]) if val(m).shape[0] == B * H
                            else (1, *val(m).shape))

            attn_mask = None
            if not causal:
                allowed = None
                for m, negate in site.allowed:
                    m = term(m)
                    a = call(torch.logical_not, m) if negate else m
                    allowed = a if allowed is None else call(torch.logical_and, allowed, a)
                additive = None
                for m, f in site.additive:
                    m = term(m)
                    t = m if f == 1.0 else call(torch.mul, m, f)
                    additive = t if additive is None else call(torch.add, additive, t)
                if additive is not None:
                    if val(site.additive[0][0]).dtype != compute or len(site.additive) > 1:
                        # NOTE: SDPA wants a float mask in the query dtype
                        additive = call(torch.Tensor.to, additive, compute)
                    attn_mask = additive if allowed is None else call(
                        torch.masked_fill, additive, call(torch.logical_not, allowed), float("-inf"))
                else:
                    attn_mask = allowed
            mask_dim = max((val(m).dim() for m, _ in site.additive + site.allowed), default=2)
            if attn_mask is not None and mask_dim < 2:
                # NOTE: SDPA needs at least a (q_len, kv_len) mask; a broadcast view costs nothing
                attn_mask = call(torch.broadcast_to, attn_mask, tuple(shape_of(site.qk)[-2:]))
            # NOTE(audit): torch's fused CPU SDPA kernel computes WRONG GRADIENTS for a query row whose keys are
            # all masked with a finite fill (HF's finfo.min; left-padded batches), and -inf fills give NaN. Where
            # such rows cannot be ruled out at compile time (a mask from the inputs), masked_sdpa gives them every
            # key and a zero-valued query (uniform weights: eager's result, eager's gradients) so the fused kernel never
            # sees an empty row.
            rows_safe = attn_mask is None or rows_nonempty(site, const)
            kwargs = dict(attn_mask=attn_mask, dropout_p=site.dropout_p, is_causal=causal, scale=site.scale)
            if rep > 1:
                kwargs["enable_gqa"] = True
            fn = F.scaled_dot_product_attention if rows_safe else masked_sdpa
            fused = call(fn, q_in, k_base, v_base, **kwargs)
            if site.heads is not None:
                fused = call(torch.reshape, fused, shape_of(site.pv))
        annotate_new_nodes(new_nodes, site.pv)
        site.pv.replace_all_uses_with(fused)
        dead = [site.pv, *site.chain]
        if k is not None:
            dead.append(site.k_t)
        erase_dead(graph, dead, producers=True)
        stats["rewritten"] += 1
        stats["causal"] += int(causal)
        stats["attn_mask"] += int(attn_mask is not None)
        stats["gqa"] += int(rep > 1)
        stats["dropout"] += int(site.dropout_p > 0)
        stats["empty_row_guard"] += int(not rows_safe)
        q4, v4 = val(q_in), val(v_base)
        why = _why_unfused(q4, val(k_base) if isinstance(k_base, fx.Node) else None, v4, attn_mask, site, rep > 1)
        if why is None:
            stats["fused"] += 1
        else:
            stats["unfused"] += 1
            unfused.append({"site": where, "unfused": True,
                            "reason": f"rewritten to SDPA, but SDPA runs its unfused math op: {why}"})


def _length(x):
    shape = shape_of(x) if isinstance(x, fx.Node) else None
    return shape[-2] if shape is not None and len(shape) >= 2 else None


def _why_unfused(qv, kv, vv, attn_mask, site: Site, gqa: bool) -> str | None:
    """None when SDPA will pick a fused kernel for this call, else the reason it runs its math op.

    Asks SDPA's own dispatcher (``torch._fused_sdp_choice``) on tiny real tensors with the site's dtype,
    device, head dims, mask dtype, dropout and GQA (the choice does not depend on the lengths)."""
    mv = val(attn_mask) if isinstance(attn_mask, fx.Node) else None
    if site.dropout_p > 0 and qv.device.type == "cpu":
        return "dropout on CPU (torch's fused CPU kernel has no dropout)"
    try:
        hk = kv.shape[1] if isinstance(kv, torch.Tensor) and kv.dim() == 4 else qv.shape[1]
        dev, dt = qv.device, qv.dtype
        q = torch.zeros(1, qv.shape[1], 2, qv.shape[-1], device=dev, dtype=dt)
        k = torch.zeros(1, hk, 2, qv.shape[-1], device=dev, dtype=dt)
        v = torch.zeros(1, hk, 2, vv.shape[-1], device=dev, dtype=dt)
        m = None
        if attn_mask is not None:
            mdt = mv.dtype if isinstance(mv, torch.Tensor) else dt
            m = torch.zeros(1, 1, 2, 2, device=dev, dtype=mdt) if mdt != torch.bool else torch.ones(
                1, 1, 2, 2, device=dev, dtype=torch.bool)
        kw = {"enable_gqa": True} if gqa else {}
        choice = torch._fused_sdp_choice(q, k, v, m, site.dropout_p, False, scale=site.scale, **kw)
    except Exception as e:  # the fake device or an unusual layout: say so rather than guess
        return f"the kernel choice could not be checked ({type(e).__name__})"
    if int(choice) == int(torch.nn.attention.SDPBackend.MATH):
        return (f"SDPA has no fused kernel for {qv.dtype}, head dim {qv.shape[-1]}, "
                f"{'a ' + str(mv.dtype if isinstance(mv, torch.Tensor) else 'mask') + ' mask' if attn_mask is not None else 'no mask'}"
                f"{', GQA' if gqa else ''}{f', dropout {site.dropout_p}' if site.dropout_p else ''} on {qv.device.type}")
    return None
