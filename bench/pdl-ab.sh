#!/usr/bin/env bash
# pdl-ab.sh: the A/B of programmatic dependent launch (docs/DESIGN.md §9) on an sm_90 GPU machine, in
# one command; about 10 minutes on an H200 host (16 cores).
#
#   OUT=/some/dir bench/pdl-ab.sh          (OUT defaults to ./pdl-out; ROUNDS=2 rounds of runs)
#
# bench/engine-ab.sh (builds, kernel_check, interleaved timing rounds, the table) over three builds:
#   default         ordinary launches (the current code)
#   pdl             -DUSE_PDL=1: programmatic launches; every kernel waits for its predecessor first
#                   thing, then lets its successor launch
#   pdl_notrigger   -DUSE_PDL=1 -DPDL_TRIGGER=0: the same without the early trigger (the successor
#                   launches when every block of this kernel has exited)
# Refused (exit 1) below compute capability 9.0, where the builds would launch alike.
set -u -o pipefail
# shellcheck source=scripts/check-lib.sh
. "$(dirname "$0")/../scripts/check-lib.sh"

arch=$(gpu_arch)
if [ -z "$arch" ] || [ "$arch" -lt 90 ]; then
    echo "error: compute capability ${arch:-unknown}: programmatic dependent launch needs 9.0 (the builds would launch alike)" >&2
    exit 1
fi
OUT=${OUT:-./pdl-out} exec bash "$(dirname "$0")/engine-ab.sh" "pdl=-DUSE_PDL=1" "pdl_notrigger=-DUSE_PDL=1 -DPDL_TRIGGER=0"
