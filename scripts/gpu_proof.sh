#!/usr/bin/env bash
# The GPU proof (issue 37; docs/gpu_proof.md): on one H100/H200 with torch + Triton preinstalled and no network,
# install the carried wheels, then run every section of bench/gpu_proof.py under its deadline.
#
#   bash scripts/gpu_wheels.sh                          # here, with a network: peers' wheels into .gpu_wheels/
#   bash scripts/gpu_proof.sh OUTDIR                    # there (carry .gpu_wheels): ~9 minutes
#   bash scripts/gpu_proof.sh OUTDIR --dry-run          # anywhere: the CPU rehearsal (the suite runs it)
#   bash scripts/gpu_proof.sh OUTDIR --only a,b --budget 200
#
# Wheels come from $EFFPASS_PROOF_WHEELS (default .gpu_wheels/) and are installed with no index and no
# dependencies into OUTDIR/site (put first on PYTHONPATH), so the machine's own torch is never replaced.
# Compile caches live under OUTDIR (inductor-cache, triton-cache): a second command with the same OUTDIR in the
# same window starts warm.
set -u
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash scripts/gpu_proof.sh OUTDIR [--dry-run] [--only a,b,...] [--budget SECONDS]" >&2; exit 2
fi
OUT=$1; shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${EFFPASS_PROOF_PYTHON:-python3}
WHEELS=${EFFPASS_PROOF_WHEELS:-$ROOT/.gpu_wheels}
t0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::DeprecationWarning}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$OUT/triton-cache}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" \
    "$WHEELS"/*.whl >"$OUT/install.log" 2>&1 || { echo "gpu_proof: wheel install failed:" >&2; tail -5 "$OUT/install.log" >&2; }
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# effpass itself: the checkout on the path (an editable install needs no network; keep an existing one)
if ! "$PY" -c "import effpass.passes" >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/install.log" 2>&1 \
    || echo "gpu_proof: effpass did not install (see $OUT/install.log)" >&2
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/device.txt" 2>&1
fi
echo "gpu_proof: set-up took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/install.log"
exec "$PY" bench/gpu_proof.py "$OUT" "$@"
