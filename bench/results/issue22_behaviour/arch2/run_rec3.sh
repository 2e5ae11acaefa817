#!/usr/bin/env bash
tree=$1; tag=$2; plug=/work/wt/arch2/bench/results/issue22_behaviour
cd "$tree"
c0=$(cut -d' ' -f1 /proc/loadavg)
EFFPASS_REC=/tmp/arch2_rec/${tag}_fuse_ce.json PYTHONPATH=$plug OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_CACHE_DIR=/work/main/.cache/inductor \
  /usr/bin/time -f "%e wall %U user %S sys" -o /tmp/arch2_rec/${tag}_fuse_ce.time .venv/bin/python -m pytest -q -p no:cacheprovider -p recplug tests/test_fuse_cross_entropy.py > /tmp/arch2_rec/${tag}_fuse_ce.log 2>&1
echo "fuse_ce rc=$? load_start=$c0 load_end=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/arch2_rec/${tag}_fuse_ce.time)" >> /tmp/arch2_rec/${tag}_times.txt
