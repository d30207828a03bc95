#!/usr/bin/env bash
# Session 6's parts (scripts/gpu_s6_NAME.sh) through scripts/gpu_call.sh:
#   OUT=gpu_s6 bash scripts/gpu_s6_call.sh NAME[:SECONDS] ...
OUT=${OUT:-gpu_s6} PREFIX=s6_ exec bash "$(dirname "$0")/gpu_call.sh" "$@"
