"""Import and install hygiene (issue 22.6): ``import effpass`` writes nothing, loads neither torchao nor
Dynamo/Inductor, and its public names still resolve (lazily); the project metadata is SPDX."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from _paths import ROOT  # noqa: E402  (the repository's root)


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="default")  # deprecation warnings would be shown, not hidden
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_import_effpass_is_silent_and_loads_no_torchao():
    r = _run("import sys, effpass\n"
             "heavy = [m for m in ('torchao', 'torch._dynamo', 'torch._inductor', 'transformers') if m in sys.modules]\n"
             "sys.exit(f'loaded at import: {heavy}' if heavy else 0)")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""


def test_import_of_the_passes_is_silent_and_loads_no_torchao_or_trainer_stack():
    """The built-in passes import torchao (quietly) and the Trainer stack only when a pass or the Trainer
    callback needs them; the callback still subclasses ``transformers.TrainerCallback``; the public names
    resolve (lazily) and ``effpass.report`` stays the function after ``import effpass.report``. One process
    for the three (each was its own process launch)."""
    r = _run("import sys, effpass, effpass.report\n"  # the submodule first (as the public-names test had it)
             "import effpass.passes\n"
             "assert callable(effpass.report) and effpass.report.__module__ == 'effpass.api', effpass.report\n"
             "from effpass.passes import QuantizeLinear, InjectLoRA, StepInBackward, FuseCrossEntropy\n"
             "heavy = [m for m in ('torchao', 'transformers', 'peft', 'trl') if m in sys.modules]\n"
             "assert not heavy, f'loaded at import: {heavy}'\n"
             "import effpass.integrations.huggingface as hf\n"
             "assert 'transformers' not in sys.modules\n"
             "from effpass.passes.step_in_backward import SUPPORTED\n"
             "assert 'torchao' in sys.modules and any(c.__name__ == '_AdamBase' for c in SUPPORTED), SUPPORTED\n"
             "import torch\n"
             "assert effpass.quantized.storage_bytes([torch.zeros(2)]) == 8\n"
             f"print({MARK!r}, file=sys.stderr, flush=True)\n"  # silent up to here; what follows need not be
             "import transformers\n"
             "assert issubclass(hf.EffpassCallback, transformers.TrainerCallback)\n"
             # the public names resolve (was test_public_names_resolve_lazily_and_report_stays_the_function)
             "for n in effpass.__all__: getattr(effpass, n)\n"
             "assert effpass.CompileReport.__module__ == 'effpass.report'\n"
             "assert len(effpass._source_digest()) == 64\n")
    assert r.returncode == 0, r.stderr
    silent = r.stderr.partition(MARK)[0]
    assert r.stdout == "" and silent == "" and MARK in r.stderr, r.stderr  # torchao's CPU-build noise is filtered


MARK = "-- end of the silent part --"


def test_first_compile_and_quantized_prepare_are_silent():
    """Compiling a plain module with a quantizing pass, preparing fp8 linears and reading ``Fp8Linear`` import
    torchao quietly, and do not load ``transformers.modeling_utils`` (whose import logs torchao's CPU-build noise)
    when ``transformers`` itself was imported: the Hugging Face attach check reads the loaded module only. The
    planner's model builder loads that module with the noise filtered."""
    r = _run("import sys, torch, transformers, effpass\n"
             "from effpass.passes.quantize_linear import QuantizeLinear\n"
             "m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))\n"
             "c = effpass.compile(m, passes=[QuantizeLinear(scheme='nf4')], lowering='eager')\n"
             "x = torch.randn(4, 64, requires_grad=True)\n"
             "c(x).sum().backward()\n"
             "assert x.grad is not None and effpass.report(c).stats('quantize_linear')['quantized'] == 2\n"
             "f = torch.nn.Sequential(torch.nn.Linear(64, 64))\n"
             "effpass.prepare(f, passes=[QuantizeLinear(scheme='fp8', fp8_emulate=True)])\n"
             "from effpass.passes.quantize_linear import Fp8Linear\n"
             "assert isinstance(f[0], Fp8Linear), type(f[0])\n"
             "assert 'transformers.modeling_utils' not in sys.modules\n"
             # the planner's model builder (effpass plan) loads transformers' model code quietly and takes a
             # config.json's deprecated torch_dtype as dtype (transformers would print its deprecation)
             "from effpass.planning.cli import model_from_config\n"
             "lm = model_from_config(dict(model_type='llama', vocab_size=128, hidden_size=32, intermediate_size=64,\n"
             "    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, torch_dtype='bfloat16'))\n"
             "assert next(lm.parameters()).dtype == torch.bfloat16\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == "", r.stderr


def test_pyproject_license_is_an_spdx_string():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)["project"]
    assert meta["license"] == "Apache-2.0"  # PEP 639: a string, not the deprecated {text = ...} table
    assert not any(c.startswith("License ::") for c in meta.get("classifiers", []))
