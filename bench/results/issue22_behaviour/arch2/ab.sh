#!/usr/bin/env bash
# A/B/A/B: the hook timing in the before and after trees, alternating, one process each
for r in 1 2; do
  for t in before after; do
    cd /tmp/arch2_$t
    echo "$t round$r load=$(cut -d' ' -f1 /proc/loadavg) $(OMP_WAIT_POLICY=PASSIVE timeout 1200 .venv/bin/python /work/wt/arch2/bench/results/issue22_behaviour/pass_ms_arch2.py 3 2>/dev/null | tail -1)" >> /tmp/arch2_rec/ab.txt
  done
done
