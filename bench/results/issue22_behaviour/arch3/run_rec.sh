#!/usr/bin/env bash
# Issue 22 behaviour check, part 3 (helper arch, 2026-11-27): the rest of test_checkpoint_activations.py and
# test_families.py, before (003d67b) and after (dc5bd1d), alternating file by file, one pytest at a time.
# Trees: `git archive <commit> | tar -x -C /tmp/wt-<tag>`, venv copied, effpass installed editable from the tree.
# usage: run_rec.sh -> /tmp/beh/<tag>_<name>.json, .log, .time; /tmp/beh/times.txt
plug=$(cd "$(dirname "$0")/.." && pwd)
run() { # tag, name, pytest args...
  local tag=$1 n=$2; shift 2
  cd /tmp/wt-$tag
  local c0=$(cut -d' ' -f1 /proc/loadavg)
  EFFPASS_REC=/tmp/beh/${tag}_$n.json PYTHONPATH=$plug OMP_WAIT_POLICY=PASSIVE PYTHONWARNINGS=ignore::DeprecationWarning \
    TORCHINDUCTOR_CACHE_DIR=/tmp/beh/inductor-$tag \
    /usr/bin/time -f "%e wall %U user %S sys" -o /tmp/beh/${tag}_$n.time \
    nice -n 10 .venv/bin/python -m pytest -q -p no:cacheprovider -p recplug "$@" > /tmp/beh/${tag}_$n.log 2>&1
  echo "$tag $n rc=$? load_start=$c0 load_end=$(cut -d' ' -f1 /proc/loadavg) $(tail -1 /tmp/beh/${tag}_$n.time)" >> /tmp/beh/times.txt
}
for tag in before after; do run $tag checkpoint tests/test_checkpoint_activations.py; done
for tag in before after; do run $tag families tests/test_families.py -k "not (fuse_attention or pack)"; done
