#!/bin/bash
# Reproduce every result of the spike (about 1-2 min on 2 CPU cores). Output: results.txt
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1
PY="$(git rev-parse --show-toplevel)/.venv/bin/python"
for s in check.py logits_check.py controls.py variants.py codec_check.py sample_check.py eos_probe.py cache_layout.py; do
  echo "=== $s"; $PY $s 2>&1 | grep -v "Warning\|seem to have been set"
done
