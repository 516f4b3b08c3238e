#!/usr/bin/env bash
# Issue 20 target: the suite 5 times in a row on a fresh clone (run 1 = CI's own script, set-up included).
set -u
rm -rf /tmp/x5; git clone -q MAIN_CHECKOUT /tmp/x5; cd /tmp/x5
echo "commit $(git rev-parse HEAD)" > OUT_DIR/summary.txt
for i in 1 2 3 4 5; do
  start=$(date +%s)
  if [ $i -eq 1 ]; then CI=true bash .ci/run > OUT_DIR/run$i.log 2>&1 < /dev/null; rc=$?
  else CI=true .venv/bin/python -m pytest -q > OUT_DIR/run$i.log 2>&1 < /dev/null; rc=$?; fi
  end=$(date +%s)
  echo "run $i rc=$rc wall_s=$((end-start)) $(grep -E '^[0-9]+ (passed|failed)|passed|failed' OUT_DIR/run$i.log | tail -1)" >> OUT_DIR/summary.txt
done
echo done >> OUT_DIR/summary.txt
