"""Test helpers: real tiny models, compile-and-compare against the eager reference, op counts, stats.

Every model is built from a config with random weights (no downloads). ``transformers`` is imported
only when a Hugging Face model is asked for.

    case = effpass.testing.model_case("llama")
    result = effpass.testing.compile_and_compare(case, passes=[FuseAttention()])
    assert result.report.stats("fuse_attention")["fused"] == case.num_layers
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ..graph import op_histogram
from ..verification import loss_of

__all__ = ["ModelCase", "model_case", "MODEL_NAMES", "compile_and_compare", "CompareResult", "dynamo_counters",
           "loss_of", "op_histogram", "ops_before_after", "assert_close_tree", "grads_of", "train_steps"]

MODEL_NAMES = ("llama", "gpt2", "bert", "demo")


@dataclass
class ModelCase:
    """A real model with inputs: ``case.model(**case.inputs)`` runs it; ``case.loss(out)`` reduces it."""

    name: str
    model: torch.nn.Module
    inputs: dict[str, Any]
    num_layers: int
    #: module-name globs of the repeated blocks (``"model.layers.*"``) and of the attention modules
    block_glob: str = ""
    attn_glob: str = ""
    make: Callable[[], torch.nn.Module] | None = None

    def loss(self, out) -> torch.Tensor:
        return loss_of(out)

    def fresh(self) -> "ModelCase":
        """The same case with a new model holding identical weights."""
        return dataclasses.replace(self, model=copy.deepcopy(self.model))


def _hf_model(name: str, attn: str, layers: int, dropout: float, **overrides):
    import transformers as tf

    from ..quantized import quiet_torchao_import

    with quiet_torchao_import():  # transformers' model code imports torchao, whose first import logs on a CPU build
        if name == "llama":
            cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 attention_dropout=dropout, bos_token_id=0, eos_token_id=0, **overrides)
            model = tf.LlamaForCausalLM(cfg)
        elif name == "gpt2":
            cfg = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=layers, n_head=4, n_positions=128,
                                resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                                eos_token_id=0, **overrides)
            model = tf.GPT2LMHeadModel(cfg)
        elif name == "bert":
            cfg = tf.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=dropout,
                                attention_probs_dropout_prob=dropout, pad_token_id=0, **overrides)
            model = tf.BertForMaskedLM(cfg)
        else:  # pragma: no cover
            raise ValueError(name)
    model.config._attn_implementation = attn
    try:
        model.set_attn_implementation(attn)
    except Exception:  # older transformers
        pass
    return model


def model_case(name: str, *, attn: str = "eager", layers: int = 2, batch: int = 2, seq: int = 16,
               dropout: float = 0.0, seed: int = 0, train: bool | None = None, padding: bool = True,
               **overrides) -> ModelCase:
    """A tiny random-weight real model: ``"llama"`` (GQA), ``"gpt2"``, ``"bert"`` (with a padding mask)
    or ``"demo"`` (effpass's own Llama-style model), with inputs that produce a loss."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown test model {name!r}; choose one of {list(MODEL_NAMES)}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    vocab = 256
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    if name == "demo":
        from .models import DemoConfig, DemoLM

        cfg = DemoConfig(vocab_size=vocab, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128,
                         max_seq_len=max(128, seq), dropout=dropout, **overrides)
        make = lambda: DemoLM(cfg)  # noqa: E731
        model = make()
        inputs = {"tokens": tokens, "labels": tokens}
        block, attn_glob = "layers.*", "layers.*.self_attn"
    else:
        make = lambda: _hf_model(name, attn, layers, dropout, **overrides)  # noqa: E731
        model = make()
        inputs = {"input_ids": tokens, "labels": tokens}
        if name == "bert":
            mask = torch.ones(batch, seq, dtype=torch.long)
            if padding and batch > 1:
                mask[1, seq // 2:] = 0  # a padded sequence: BERT's additive padding mask is not all zero
            inputs["attention_mask"] = mask
            block, attn_glob = "bert.encoder.layer.*", "bert.encoder.layer.*.attention.self"
        elif name == "gpt2":
            block, attn_glob = "transformer.h.*", "transformer.h.*.attn"
        else:
            block, attn_glob = "model.layers.*", "model.layers.*.self_attn"
    if train is None:
        train = dropout > 0
    model.train(train)
    return ModelCase(name=name, model=model, inputs=inputs, num_layers=layers, block_glob=block,
                     attn_glob=attn_glob, make=make)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_tree(actual, expected, *, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{what}: keys differ: {set(actual) ^ set(expected)}"
        for k in expected:
            assert_close_tree(actual[k], expected[k], atol=atol, rtol=rtol, what=f"{what}[{k}]")
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), (
            f"{what}: {len(actual) if isinstance(actual, (tuple, list)) else type(actual).__name__} items, "
            f"expected {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close_tree(a, e, atol=atol, rtol=rtol, what=f"{what}[{i}]")
    elif isinstance(expected, torch.Tensor) and hasattr(type(expected), "__tensor_flatten__"):
        # A tensor subclass (a quantized weight): the same type, and its inner tensors close.
        assert type(actual) is type(expected), f"{what}: {type(actual).__name__} != {type(expected).__name__}"
        names, _ = expected.__tensor_flatten__()
        for n in names:
            assert_close_tree(getattr(actual, n), getattr(expected, n), atol=atol, rtol=rtol, what=f"{what}.{n}")
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def _outputs(out):
    if hasattr(out, "to_tuple"):
        return tuple(t for t in out.to_tuple() if isinstance(t, torch.Tensor))
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(t for t in out if isinstance(t, torch.Tensor))


@dataclass
class CompareResult:
    eager_out: tuple
    compiled_out: tuple
    eager_grads: dict[str, torch.Tensor]
    compiled_grads: dict[str, torch.Tensor]
    eager_params_after_step: dict[str, torch.Tensor] | None
    compiled_params_after_step: dict[str, torch.Tensor] | None
    compiled: torch.nn.Module
    eager_model: torch.nn.Module
    model: torch.nn.Module
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def report(self):
        from ..api import report

        return report(self.compiled)


def compile_and_compare(case: ModelCase, passes: Sequence[Any] | None = (), *, lowering: str = "eager",
                        atol: float = 1e-5, rtol: float = 1e-5, backward: bool = True, step: bool = True,
                        check: bool = True, reference: Callable[[torch.nn.Module], Any] | None = None,
                        seed: int = 0, **compile_kwargs) -> CompareResult:
    """Compile ``case.model`` with ``passes`` and compare forward, gradients and one SGD step with eager.

    The eager reference runs on a deep copy taken *after* effpass prepared the model (reference
    semantics: the prepared eager model computes the same function). ``reference(model)`` may replace
    the eager forward (e.g. to run it under ``torch.autocast``).
    """
    from ..api import compile as effpass_compile

    torch._dynamo.reset()
    model = case.model
    with dynamo_counters() as counters:
        compiled = effpass_compile(model, passes=list(passes) if passes is not None else None, lowering=lowering,
                                   **compile_kwargs)
        eager_model = copy.deepcopy(model)

        def run(m, fwd):
            torch.manual_seed(seed)
            out = fwd(m) if fwd is not None else m(**case.inputs)
            return out

        e_out = run(eager_model, reference)
        c_out = run(compiled, None)
        e_grads = c_grads = {}
        e_after = c_after = None
        if backward:
            case.loss(e_out).backward()
            case.loss(c_out).backward()
            e_grads, c_grads = grads_of(eager_model), grads_of(model)
            if step:
                for m in (eager_model, model):
                    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                e_after = {n: p.detach().clone() for n, p in eager_model.named_parameters()}
                c_after = {n: p.detach().clone() for n, p in model.named_parameters()}
                torch.manual_seed(seed)
                out2 = compiled(**case.inputs)  # a second call: must not recompile
                e2 = run(eager_model, reference)
                if check:
                    assert_close_tree(_outputs(out2), _outputs(e2), atol=atol, rtol=rtol, what="output after step")
    res = CompareResult(_outputs(e_out), _outputs(c_out), e_grads, c_grads, e_after, c_after, compiled, eager_model,
                        model, dict(counters))
    if check:
        assert_close_tree(res.compiled_out, res.eager_out, atol=atol, rtol=rtol, what="output")
        assert_close_tree(res.compiled_grads, res.eager_grads, atol=atol, rtol=rtol, what="grad")
        if e_after is not None:
            assert_close_tree(c_after, e_after, atol=atol, rtol=rtol, what="param after step")
    return res


@contextlib.contextmanager
def dynamo_counters() -> Iterator[dict[str, int]]:
    """Counts graph breaks, graphs compiled and recompiles inside the block (filled in on exit)."""
    from torch._dynamo import utils

    utils.counters.clear()
    utils.clear_compilation_metrics()
    out: dict[str, int] = {}
    try:
        yield out
    finally:
        counters = utils.counters
        out["graph_breaks"] = sum(counters["graph_break"].values())
        out["unique_graphs"] = counters["stats"]["unique_graphs"]
        # Dynamo's counters have no recompile count; each compile's metrics carry the reason of a recompile.
        out["recompiles"] = sum(1 for m in utils.get_compilation_metrics() if getattr(m, "recompile_reason", None))
        out["frames"] = counters["frames"]["ok"]


def ops_before_after(report, pass_name: str, graph: str | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Op histograms before and after ``pass_name`` (first matching record) from a compile report."""
    for r in report.records(pass_name):
        if graph is None or r.graph == graph:
            return r.ops_before, r.ops_after
    raise KeyError(f"no record of pass {pass_name!r}{' on ' + graph if graph else ''}")


def train_steps(model: torch.nn.Module, case: ModelCase, steps: int, *, lr: float = 1e-2, seed: int = 0,
                optimizer: Callable | None = None, forward: Callable | None = None) -> list[float]:
    """Train ``steps`` AdamW steps on the case's batch and return the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if optimizer else torch.optim.AdamW(params, lr=lr)
    losses = []
    torch.manual_seed(seed)
    for _ in range(steps):
        out = forward(model) if forward else model(**case.inputs)
        loss = loss_of(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
