#!/bin/bash
# Prints "epoch busy%" every 5 s (all CPUs, from /proc/stat); run beside a test suite, stop it with kill.
prev=($(head -1 /proc/stat)); 
while :; do sleep 5; cur=($(head -1 /proc/stat));
 tot=0; for i in 1 2 3 4 5 6 7 8; do tot=$((tot + cur[i] - prev[i])); done
 idle=$(( (cur[4]-prev[4]) + (cur[5]-prev[5]) ));
 echo "$(date +%s) $(( 100*(tot-idle)/tot ))"; prev=("${cur[@]}"); done
