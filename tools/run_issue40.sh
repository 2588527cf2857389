#!/usr/bin/env bash
# Issue 40's pre-registered runs (results/preregistration.md), one grid after another, two runs at a
# time at the lowest priority. Every tools.compare call resumes where the last one stopped, so this
# script can be started again after a stop; each grid's output goes to $LOGS/seeds_<grid>.log.
#   setsid nohup bash tools/run_issue40.sh > /work/seeds_queue.log 2>&1 &
cd "$(dirname "$0")/.."
LOGS=${LOGS:-/work}
# the GPT-2 BPE ranks, offline (only a fresh data/shakespeare_gpt2 needs them)
if [ -z "${TIKTOKEN_CACHE_DIR:-}" ] && [ -d ../shared/data/tiktoken ]; then export TIKTOKEN_CACHE_DIR="$(cd ../shared/data/tiktoken && pwd)"; fi
# (bpe_1600, the registration's part E, ran on a GPU: results/README.md)
for grid in jostling_prereg jostling_swap lowres; do
    echo "$(date -u '+%F %T') start $grid"
    nice -n 19 python -m tools.compare "$grid" --workers 2 > "$LOGS/seeds_$grid.log" 2>&1
    echo "$(date -u '+%F %T') $grid exit $?"
done
