#!/usr/bin/env bash
tree=$1; tag=$2; plug=/work/wt/arch2/bench/results/issue22_behaviour
cd "$tree"
EFFPASS_REC=/tmp/arch2_rec/${tag}_checkpoint.json PYTHONPATH=$plug OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_CACHE_DIR=/work/main/.cache/inductor \
  .venv/bin/python -m pytest -q -p no:cacheprovider -p recplug tests/test_checkpoint_activations.py > /tmp/arch2_rec/${tag}_checkpoint.log 2>&1
