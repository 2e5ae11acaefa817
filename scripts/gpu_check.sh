#!/usr/bin/env bash
# The GPU checks of a session that is lent a CUDA machine (device tool): `pytest -m gpu`, then the bench scripts'
# GPU arms, each under its own time limit. Wheels the image lacks travel in .whl/ (torchao, the peers' kernels).
# Usage there: bash scripts/gpu_check.sh OUTDIR [SECONDS_PER_BENCH]
set -u
OUTDIR=${1:-/tmp/gpu_check}; PER=${2:-75}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONWARNINGS=ignore::DeprecationWarning
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUTDIR/install.log" 2>&1 || tail -5 "$OUTDIR/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUTDIR/device.txt"
timeout 170 python3 -m pytest -q -rs -m gpu -p no:cacheprovider --junitxml="$OUTDIR/gpu_junit.xml" \
  tests/tools/test_export_onnx.py tests/planning/test_memory_planner.py tests/passes/offload_activations/test_offload_activations.py tests/passes/pack_sequences/test_pack_sequences.py \
  tests/passes/quantize_linear/test_quantize_linear.py tests/passes/shard_sequence/test_shard_sequence.py 2>&1 | tee "$OUTDIR/pytest_gpu.log" | tail -25
for b in "bench_cross_entropy.py --vocab 128256 --steps 5" "bench_attention.py --quick" \
         "bench_lora.py --steps 10 --repeats 1" "bench_mixed_precision.py --repeats 1 --steps 10" "bench_checkpoint.py"; do
  name=${b%%.py*}
  echo "=== $b"
  timeout "$PER" python3 bench/$b >"$OUTDIR/$name.log" 2>&1; echo "rc=$? $name" | tee -a "$OUTDIR/bench_rc.txt"
  tail -4 "$OUTDIR/$name.log"
done
tar czf "$OUTDIR/results.tgz" bench/results/*cuda* "$OUTDIR"/*.log 2>/dev/null
