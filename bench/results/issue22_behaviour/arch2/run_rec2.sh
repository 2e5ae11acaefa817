#!/usr/bin/env bash
# usage: run_rec2.sh TREE TAG  -> fuse_ce and families only
tree=$1; tag=$2; plug=/work/wt/arch2/bench/results/issue22_behaviour
cd "$tree"
run() {
  local n=$1; shift
  local c0=$(cut -d' ' -f1 /proc/loadavg)
  EFFPASS_REC=/tmp/arch2_rec/${tag}_$n.json PYTHONPATH=$plug OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_CACHE_DIR=/work/main/.cache/inductor \
    /usr/bin/time -f "%e wall %U user %S sys" -o /tmp/arch2_rec/${tag}_$n.time .venv/bin/python -m pytest -q -p no:cacheprovider -p recplug "$@" > /tmp/arch2_rec/${tag}_$n.log 2>&1
  echo "$n rc=$? load_start=$c0 load_end=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/arch2_rec/${tag}_$n.time)" >> /tmp/arch2_rec/${tag}_times.txt
}
run fuse_ce tests/test_fuse_cross_entropy.py
run families tests/test_families.py -k "lora or checkpoint or cross_entropy"
