#!/usr/bin/env bash
# usage: run_rec.sh TREE TAG  -> /tmp/arch2_rec/TAG_<file>.json, TAG_times.txt
tree=$1; tag=$2; plug=/work/wt/arch2/bench/results/issue22_behaviour
cd "$tree"
run() { # name, args...
  local n=$1; shift
  local t0=$(date +%s.%N); local c0=$(cat /proc/loadavg | cut -d' ' -f1)
  EFFPASS_REC=/tmp/arch2_rec/${tag}_$n.json PYTHONPATH=$plug OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_CACHE_DIR=/work/main/.cache/inductor \
    /usr/bin/time -f "%e wall %U user %S sys" -o /tmp/arch2_rec/${tag}_$n.time .venv/bin/python -m pytest -q -p no:cacheprovider -p recplug "$@" > /tmp/arch2_rec/${tag}_$n.log 2>&1
  echo "$n rc=$? load_start=$c0 load_end=$(cut -d' ' -f1 /proc/loadavg) $(cat /tmp/arch2_rec/${tag}_$n.time | tail -1)" >> /tmp/arch2_rec/${tag}_times.txt
}
run inject_lora tests/test_inject_lora.py
run inject_lora_moe tests/test_inject_lora_moe.py
run checkpoint tests/test_checkpoint_activations.py
run fuse_ce tests/test_fuse_cross_entropy.py
run families tests/test_families.py -k "lora or checkpoint or cross_entropy"
