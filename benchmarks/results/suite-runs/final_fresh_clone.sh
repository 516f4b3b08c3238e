#!/usr/bin/env bash
# Before stopping: README's two commands from a fresh clone of main, as a new user (CI runs .ci/run = make test).
set -u
rm -rf /tmp/final; git clone -q MAIN_CHECKOUT /tmp/final; cd /tmp/final
echo "commit $(git rev-parse HEAD)" > OUT_DIR/final.txt
start=$(date +%s); CI=true bash .ci/run > OUT_DIR/final_test.log 2>&1 < /dev/null; rc=$?
echo "make test (via .ci/run) rc=$rc wall_s=$(( $(date +%s) - start )) $(grep -E 'passed|failed' OUT_DIR/final_test.log | tail -1)" >> OUT_DIR/final.txt
start=$(date +%s); make demo ARGS="trainer.enable_progress_bar=false" > OUT_DIR/final_demo.log 2>&1 < /dev/null; rc=$?
echo "make demo rc=$rc wall_s=$(( $(date +%s) - start ))" >> OUT_DIR/final.txt
echo done >> OUT_DIR/final.txt
