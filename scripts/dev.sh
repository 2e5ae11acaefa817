#!/usr/bin/env bash
# One entry point for a fresh machine (Python 3.11): sets up .venv on first use, then
#   bash scripts/dev.sh demo [effpass demo options]   # train the demo model eagerly and with effpass
#   bash scripts/dev.sh test [pytest options]         # the test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${EFFPASS_VENV:-$ROOT/.venv}
# The interpreter for a new .venv (an existing one keeps its own): $PYTHON when set; otherwise python3, or the
# system's own build of the same Python version when there is one with venv (Debian's /usr/bin/python3.11 beside
# pyenv's 3.11 on CI's machines). torch.compile's tracing is pure Python and most of the suite's time: pyenv's
# default build (a shared libpython, no profile-guided optimisation) ran the same tests with ~20% more CPU than
# Debian's (bench/results/suite_cuts_cpu.md, thirteenth session). Only the same major.minor is ever swapped in: the
# torch file on disk matches that version.
pick_python() {
  local py=python3 ver me sys_py
  ver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || { echo "$py"; return; }
  me=$("$py" -c 'import os, sys; print(os.path.realpath(sys.executable))')
  sys_py=/usr/bin/python$ver
  if [ -x "$sys_py" ] && [ "$(readlink -f "$sys_py")" != "$me" ] && "$sys_py" -c 'import ensurepip, venv' 2>/dev/null; then
    echo "$sys_py"
  else
    echo "$py"
  fi
}

cmd=${1:-test}
shift || true

# The HTML report's test opens the page in a real headless Chromium (Debian's package). CI is a fresh root
# machine: install it when missing (apt-get, ~2 min), in the background while the set-up below installs the
# Python packages and the suite starts; only the tests that open a page wait for it (tests/_browser.py).
# Elsewhere say how (the test skips without it).
if [ "$cmd" = test ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "effpass: installing chromium for the HTML report test (apt-get, ~2 min, beside the set-up and the tests)" >&2
    mkdir -p "$ROOT/.cache"
    export EFFPASS_CHROMIUM_PENDING=$ROOT/.cache/chromium-install-pending   # tests/_browser.py waits while it exists
    : > "$EFFPASS_CHROMIUM_PENDING"
    ( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
        || echo "effpass: could not install chromium; tests/tools/test_html_report.py will skip its browser checks" >&2
      rm -f "$EFFPASS_CHROMIUM_PENDING" ) &
  else
    echo "effpass: chromium not found (apt-get install chromium); the HTML report's browser checks will skip" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.effpass-ready" ] || [ pyproject.toml -nt "$VENV/.effpass-ready" ]; then
  if [ ! -x "$VENV/bin/python" ]; then   # an existing .venv keeps its interpreter
    PY=${PYTHON:-$(pick_python)}
    echo "effpass: setting up $VENV with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])')), first run only" >&2
    "$PY" -m venv "$VENV"
  else
    echo "effpass: updating $VENV (pyproject.toml changed or its set-up did not finish)" >&2
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # torch pinned (a range would pull the newest CUDA build and several GB with it), in the same pip call as
  # effpass and its dev extra: one pip start and one resolution instead of two. An existing torch is kept.
  torch_req=()
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    torch_req=("torch==${EFFPASS_TORCH_VERSION:-2.13.0}")
  fi
  "$VENV/bin/python" -m pip install -q ${torch_req[@]+"${torch_req[@]}"} -e ".[dev]"
  touch "$VENV/.effpass-ready"
fi

export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/inductor}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::DeprecationWarning}
# Two test workers on two cores: OpenMP threads that spin at barriers while their partner is descheduled waste
# most of a compiled step on a shared CPU (docs/huggingface.md); waiting threads sleep instead.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
case "$cmd" in
  demo) exec "$VENV/bin/effpass" demo "$@" ;;
  test)
    # One intra-op thread per process: the two workers already fill the two cores, and the processes tests
    # start (CLI commands, examples, README blocks, ranks) work on tiny tensors, where a second thread costs
    # more than it gives (the workers themselves set it in tests/conftest.py).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # --dist loadgroup: tests marked xdist_group(NAME) share one worker (and its module fixtures: one launch of
    # ranks or one preloaded process serves several tests); the rest go one at a time to whichever worker is
    # free, the longest first (tests/conftest.py LONG_FIRST).
    exec "$VENV/bin/python" -m pytest -q -rs -n "${EFFPASS_TEST_WORKERS:-2}" --dist loadgroup -p no:cacheprovider "$@" tests ;;
  *) echo "usage: bash scripts/dev.sh demo|test [args]" >&2; exit 2 ;;
esac
