#!/usr/bin/env bash
# effpass's Axolotl plugin inside the real Axolotl: builds a virtual environment with Axolotl 0.19.0 (the last
# release that allows Python 3.11; 0.20+ need Python >= 3.12) and runs tests/integrations/test_axolotl_real.py in it.
#
#   bash scripts/axolotl_check.sh [pytest options]   (AXOLOTL_VENV: the environment, default .axolotl-venv here)
#
# Axolotl's declared dependencies are many and pinned (gradio, modal, lm_eval, xformers, bitsandbytes, fla-core, ...);
# most are not imported on the path `axolotl train` takes for a LoRA run. Axolotl is installed without them and only
# what that path imports is added, at the versions Axolotl 0.19.0 pins where it pins one. torch is the CPU build.
# Not installed (not imported on this path): xformers, flash-attn, liger-kernel, fla-core, gradio, modal, lm_eval,
# trackio, mistral-common, optimum, the cloud file systems; torchao is effpass's version (>= 0.18), not Axolotl's 0.17.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${AXOLOTL_VENV:-.axolotl-venv}
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip="$venv/bin/python -m pip install -q"
if ! "$venv/bin/python" -c "import axolotl.cli.train, effpass" >/dev/null 2>&1; then
  $pip --upgrade pip >/dev/null
  # torch first, pinned (as scripts/dev.sh does): a range would pull the newest build and several GB with it
  $pip "torch==${EFFPASS_TORCH_VERSION:-2.13.0}"
  $pip --no-deps "axolotl==0.19.0" "axolotl-contribs-lgpl==0.0.7" "axolotl-contribs-mit==0.0.6" "evaluate==0.4.1"
  # what `axolotl train` imports for a LoRA run, at Axolotl 0.19.0's pins where it pins (wandb and evaluate are
  # imported unconditionally by axolotl.utils.callbacks; numba by the multipack sampler; posthog by telemetry;
  # bitsandbytes by axolotl.loaders.adapter; triton by Axolotl's kernels)
  $pip "transformers==5.16.1" "peft==0.20.0" "accelerate==1.13.0" "trl==1.9.0" "datasets==4.8.4" \
       "huggingface_hub==1.17.0" "tokenizers==0.23.1" "typer==0.25.1" "posthog==6.7.11" "python-dotenv==1.0.1" \
       "numba>=0.63.1,<1.0" "fsspec[http]<=2026.2.0" colorama addict fire einops fastcore art pillow wandb \
       requests httpx pyyaml pydantic pytest "bitsandbytes==0.50.2" "triton>=3.4.0"
  $pip -e .
fi
# no telemetry, no wandb, no hub: everything the test uses is made locally
export AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$venv/bin/python" - <<'EOF'
import importlib.metadata as m
print("versions:", {p: m.version(p) for p in ("axolotl", "torch", "transformers", "peft", "accelerate", "trl",
                                               "datasets", "effpass")})
EOF
"$venv/bin/python" -m pytest -q -p no:cacheprovider -rs tests/integrations/test_axolotl_real.py "$@"
