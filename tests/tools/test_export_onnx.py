"""ONNX export of what effpass made (``effpass.export_onnx``, ``effpass export``), checked in onnxruntime on
the CPU against the eager model, and the ``lowering="tensorrt"`` option.

Numerical oracles: fp32 logits within 1e-4 relative (max abs error / max abs logit) of the eager model;
int8 logits SQNR >= 30 dB against the fp32 eager model. Structural oracles: the ONNX ops (one
DequantizeLinear per int8 linear, one Softmax per attention layer), the stored weight bytes by data type
(not the file size, which adds per-node metadata), the passes' own statistics.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

import effpass
from effpass.export import OnnxExportError, export_onnx, quantized_linear_parts
from effpass.testing import model_case

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _ort(path: str, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return [torch.from_numpy(o) for o in sess.run(None, {k: v.numpy() for k, v in feeds.items()})]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(ref.float().pow(2).sum().item() / (ref.float() - approx.float()).pow(2).sum().item())


def _ops(path: str) -> dict[str, int]:
    m = onnx.load(path)
    out: dict[str, int] = {}
    for n in m.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def test_fp32_llama_with_fused_attention_matches_eager(tmp_path):
    case = model_case("llama", layers=1)
    model = case.model.eval()
    feeds = {"input_ids": case.inputs["input_ids"]}
    with torch.no_grad():
        ref = model(**feeds, use_cache=False).logits
    path = str(tmp_path / "llama.onnx")
    res = export_onnx(model, feeds, path, passes=["fuse_attention"], opset=23)
    assert res.input_names == ["input_ids"] and res.output_names == ["logits"]
    got = _ort(path, feeds)[0]
    assert _rel(got, ref) <= 1e-4
    assert res.max_rel_error["logits"] <= 1e-4
    # structural: the pass fused every layer, and at opset 23 each fused attention is one ONNX Attention op
    # (the CLI test below checks the default opset's decomposition: one Softmax per layer)
    assert res.report.stats("fuse_attention")["fused"] == case.num_layers
    ops = _ops(path)
    assert ops.get("Attention", 0) == case.num_layers and ops.get("Softmax", 0) == 0
    # the caller's model was left alone (export works on a copy)
    assert all(type(m).__name__ != "QuantizedLinear" for m in model.modules())
    # fp32 weights: every stored weight byte is a float of the model's state (no int8)
    b = res.initializer_bytes
    state = sum(t.numel() * t.element_size() for t in {id(t): t for t in
                                                      [*model.parameters(), *model.buffers()]}.values())
    assert "INT8" not in b and state - 1024 <= b["FLOAT"] <= state + 1024  # + exporter scalar constants


def test_int8_llama_keeps_int8_weights(tmp_path):
    """int8 weights stay int8: one DequantizeLinear of an INT8 initializer per quantized linear.

    The arithmetic: a quantized linear [N, K] stores N*K int8 bytes plus N fp32 scales (4N bytes); the
    rest of the model (embeddings, lm_head kept fp32 by ``exclude``, norms, rotary buffers) stores 4 bytes
    per element. The file's stored initializer bytes must not exceed that sum (plus at most 1 KiB of
    exporter constants such as shapes)."""
    case = model_case("llama", layers=1)
    model = case.model.eval()
    feeds = {"input_ids": case.inputs["input_ids"]}
    with torch.no_grad():
        ref = model(**feeds, use_cache=False).logits
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    int8_bytes = sum(m.weight.numel() for m in linears.values())
    scale_bytes = sum(4 * m.out_features for m in linears.values())
    quantized = {id(m.weight) for m in linears.values()}
    rest = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in quantized}
    fp32_rest = sum(t.numel() * 4 for t in rest.values())

    path = str(tmp_path / "llama_int8.onnx")
    from effpass.passes import FuseAttention, QuantizeLinear

    res = export_onnx(model, feeds, path, passes=[QuantizeLinear(scheme="int8", exclude=["lm_head"]), FuseAttention()])
    assert sorted(res.int8_linears) == sorted(linears)
    b = res.initializer_bytes
    assert b["INT8"] == int8_bytes
    assert b["FLOAT"] <= fp32_rest + scale_bytes + 1024
    assert sum(b.values()) <= int8_bytes + scale_bytes + fp32_rest + 1024
    ops = _ops(path)
    assert ops["DequantizeLinear"] == len(linears)
    got = _ort(path, feeds)[0]
    assert _sqnr(ref, got) >= 30.0
    assert res.max_rel_error["logits"] <= 1e-4  # the file computes what the transformed graph computes


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_adapter_recognises_effpass_and_torchao_int8_and_exports_torchao(tmp_path):
    torch.manual_seed(0)
    from effpass.passes import QuantizeLinear

    lin = nn.Linear(64, 32)
    q = effpass.prepare(nn.Sequential(lin), passes=[QuantizeLinear(scheme="int8")])[0]
    parts = quantized_linear_parts(q)   # effpass's int8 weight is a torchao Int8Tensor subclass
    assert parts.qweight.dtype == torch.int8 and parts.scales.shape == (32,) and parts.source == "torchao.Int8Tensor"
    assert torch.equal(parts.qweight.float() * parts.scales[:, None], q.weight.dequantize().float())
    q4 = effpass.prepare(nn.Sequential(nn.Linear(64, 32)), passes=[QuantizeLinear(scheme="int4", group_size=32)])[0]
    assert quantized_linear_parts(q4) is None
    assert quantized_linear_parts(nn.Linear(64, 32)) is None

    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = _MLP()
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(model, Int8WeightOnlyConfig())
    parts = quantized_linear_parts(model.up)
    assert parts is not None and parts.source == "torchao.Int8Tensor" and parts.qweight.shape == (128, 64)
    assert torch.allclose(parts.qweight.float() * parts.scales[:, None], model.up.weight.dequantize().float(), atol=0)
    path = str(tmp_path / "mlp.onnx")
    res = export_onnx(model, (x,), path, passes=[])
    assert sorted(res.int8_linears) == ["down", "up"]
    assert res.initializer_bytes["INT8"] == 64 * 128 + 128 * 32
    assert _ops(path)["DequantizeLinear"] == 2
    got = _ort(path, {"input_0": x})[0]
    assert _sqnr(ref, got) >= 30.0


def test_constant_folding_trap_is_caught(tmp_path, monkeypatch):
    """The exporter's optimiser (optimize=True, torch's default) constant-folds a Cast/Mul dequantisation
    of an int8 initializer back into an fp32 initializer (SQNR would not tell: the numbers are the same).
    export_onnx writes DequantizeLinear, which it leaves alone, and checks the saved file: with a
    Cast/Mul translation planted and the optimiser on, the check fires."""
    import effpass.export as ex
    from onnxscript import opset18 as op

    def cast_mul(qweight, scales):
        return op.Mul(op.Cast(qweight, to=onnx.TensorProto.FLOAT), op.Unsqueeze(scales, op.Constant(value_ints=[1])))

    monkeypatch.setattr(ex, "_onnx_translations",
                        lambda: {torch.ops.effpass_export.dequantize_int8.default: cast_mul})
    with pytest.raises(OnnxExportError, match="back into floats"):
        export_onnx(_MLP(), (torch.randn(4, 64),), str(tmp_path / "m.onnx"), passes=["quantize_linear"], check=False,
                    optimize=True)


def test_op_onnx_cannot_express_names_op_and_pass(tmp_path):
    """A pass that leaves an op without an ONNX translation: the error names the op and the pass."""

    @torch.library.custom_op("effpass_test_export::mystery_relu", mutates_args=())
    def mystery_relu(x: torch.Tensor) -> torch.Tensor:
        return x.clamp_min(0)

    @mystery_relu.register_fake
    def _(x):
        return torch.empty_like(x)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class UseMysteryRelu(effpass.Pass):
        def transform_torch_ir(self, gm, ctx):
            n = 0
            for node in list(gm.graph.nodes):
                if node.op == "call_function" and node.target in (torch.relu, torch.nn.functional.relu):
                    with gm.graph.inserting_after(node):
                        new = gm.graph.call_function(torch.ops.effpass_test_export.mystery_relu.default, (node.args[0],))
                    node.replace_all_uses_with(new)
                    gm.graph.erase_node(node)
                    n += 1
            return effpass.PassResult(changed=n > 0, stats={"replaced": n})

    from effpass.pass_api import _REGISTRY

    saved = dict(_REGISTRY)
    try:
        effpass.register_pass("use_mystery_relu")(UseMysteryRelu)
        with pytest.raises(OnnxExportError) as info:
            export_onnx(_MLP(), (torch.randn(4, 64),), str(tmp_path / "m.onnx"), passes=["use_mystery_relu"])
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)
    msg = str(info.value)
    assert "mystery_relu" in msg and "use_mystery_relu" in msg, msg


def test_cli_export_of_a_hf_config(tmp_path, capsys):
    """``effpass export CONFIG OUT`` on a GPT-2 config (random weights, seed 0): ORT matches eager."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=4, n_embd=64, vocab_size=256, n_positions=64)
    cfg_dir = tmp_path / "gpt2"
    cfg.save_pretrained(cfg_dir)
    out = str(tmp_path / "gpt2.onnx")
    from effpass.cli import main

    assert main(["export", str(cfg_dir / "config.json"), out, "--passes", "fuse_attention", "--seq", "12"]) == 0
    text = capsys.readouterr().out
    assert "wrote" in text and "fuse_attention" in text and "KV cache off" in text
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(cfg_dir)).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    assert _rel(_ort(out, {"input_ids": ids})[0], ref) <= 1e-4
    assert _ops(out).get("Softmax", 0) == 1


def test_cli_export_bad_source(tmp_path):
    from effpass.cli import main

    with pytest.raises(SystemExit, match="does not exist"):
        main(["export", str(tmp_path / "nope"), str(tmp_path / "x.onnx")])


# ------------------------------------------------------------------------------------------------------
# lowering="tensorrt"
# ------------------------------------------------------------------------------------------------------
def test_tensorrt_lowering_is_a_valid_option_and_says_what_is_missing(monkeypatch):
    from effpass import config

    assert "tensorrt" in config.LOWERINGS
    monkeypatch.setattr(config, "_tensorrt_missing", lambda: ["torch_tensorrt (pip install 'effpass[tensorrt]')",
                                                               "a CUDA device"])
    with pytest.raises(RuntimeError, match=r"torch_tensorrt.*CUDA device"):
        effpass.compile(nn.Linear(4, 4), passes=[], lowering="tensorrt")
    with pytest.raises(ValueError, match="'tensorrt'"):
        effpass.parse_options({"lowering": "tensorrtt"})


def test_tensorrt_missing_reflects_this_machine():
    from effpass.config import _tensorrt_missing
    import importlib.util

    missing = _tensorrt_missing()
    assert any("torch_tensorrt" in m for m in missing) == (importlib.util.find_spec("torch_tensorrt") is None)
    assert any("CUDA" in m for m in missing) == (not torch.cuda.is_available())


@pytest.mark.gpu
def test_tensorrt_lowering_runs_on_gpu():
    from effpass.config import _tensorrt_missing

    if _tensorrt_missing():
        pytest.skip(f"optional extra: torch-tensorrt (needs {_tensorrt_missing()})")
    case = model_case("llama")
    model = case.model.cuda().eval()
    ids = case.inputs["input_ids"].cuda()
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        compiled = effpass.compile(model, passes=["fuse_attention"], lowering="tensorrt")
        got = compiled(input_ids=ids, use_cache=False).logits
    assert _rel(got, ref) <= 1e-2
    assert effpass.report(compiled).stats("fuse_attention")["fused"] == case.num_layers
