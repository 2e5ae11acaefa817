#!/usr/bin/env bash
# As run_rec.sh, on /tmp/wt-head: a git archive of h-arch at 2994016 (after the quantize_linear/shard_sequence splits)
plug=$(cd "$(dirname "$0")/.." && pwd)  # the recorder plugin (recplug.py)
run() { local tag=$1 n=$2; shift 2; cd /tmp/wt-$tag; local c0=$(cut -d' ' -f1 /proc/loadavg)
  EFFPASS_REC=/tmp/beh/${tag}_$n.json PYTHONPATH=$plug OMP_WAIT_POLICY=PASSIVE PYTHONWARNINGS=ignore::DeprecationWarning \
    TORCHINDUCTOR_CACHE_DIR=/tmp/beh/inductor-$tag /usr/bin/time -f "%e wall %U user %S sys" -o /tmp/beh/${tag}_$n.time \
    nice -n 10 .venv/bin/python -m pytest -q -p no:cacheprovider -p recplug "$@" > /tmp/beh/${tag}_$n.log 2>&1
  echo "$tag $n rc=$? load_start=$c0 load_end=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/beh/${tag}_$n.time)" >> /tmp/beh/times.txt; }
run head checkpoint tests/test_checkpoint_activations.py
run head families tests/test_families.py -k "not (fuse_attention or pack)"
