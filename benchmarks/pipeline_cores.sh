#!/usr/bin/env bash
# bench_pipeline.py with a core to each stage, on a machine with cores to spare (the lent
# GPU machine's 16): the setting issue 26's bubble goals assume, which two shared cores
# cannot give. Four lanes run at once, each pinned to its own quarter of the cores with
# one intra-op thread a stage (--threads 1), each bounded so that one device call of about
# 570 s holds the part; rows print as they come, so a lane stopped by its bound keeps
# those it finished. Logs and JSON under $OUT (8 files: what one device call brings back).
#
#   bash benchmarks/pipeline_cores.sh 2    # 2 stages: mlp, gpt, mlp-first-loaded (+ mlp ZB again)
#   bash benchmarks/pipeline_cores.sh 4    # 4 stages: mlp and gpt, two lanes of half the cores
#
# A launch took 20 s (mlp) to 33 s (gpt) on the H200 machine's Xeon (2026-11-28), which
# sized the lanes below; with workers forked from launch's server (2026-11-29) part 2's mlp,
# gpt and mlp-first-loaded lanes ended within 290 s there and part 4's within 220 s.
# ALLOW_SHARED=1 runs the lanes on every core (a smoke test on a small machine: the
# figures are then contended). Run from the repository root.
set -u
PART=${1:-2}
OUT=${OUT:-pipeline-out}
LANE_S=${LANE_S:-540}
REPEATS=${REPEATS:-2}
SHARED=${ALLOW_SHARED:-0}
case "$PART" in  # lanes, and the cores a lane needs: its stages, the launcher, gloo's threads
  2) LANES=4 NEEDED=3 ;;
  4) LANES=2 NEEDED=6 ;;
  *)
    echo "pipeline_cores.sh: the part is 2 or 4 (stages), not '$PART'." >&2
    exit 2
    ;;
esac
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
CORES=$(nproc --all)
WIDTH=$((CORES / LANES))
if [ "$SHARED" != 1 ] && [ "$WIDTH" -lt "$NEEDED" ]; then
  echo "pipeline_cores.sh: $CORES cores give $LANES lanes of $WIDTH; part $PART needs" \
    "$NEEDED a lane ($((LANES * NEEDED)) cores): run it on a larger machine, or set" \
    "ALLOW_SHARED=1 for a contended smoke test." >&2
  exit 2
fi
mkdir -p "$OUT"

lane() {  # lane INDEX NAME bench-arguments...: one pinned, bounded bench run
  local index=$1 name=$2 cores
  shift 2
  cores="$((index * WIDTH))-$((index * WIDTH + WIDTH - 1))"
  [ "$SHARED" = 1 ] && cores="0-$((CORES - 1))"
  {
    # the bench's "contended" label sees its own affinity, not the other lanes
    [ "$SHARED" = 1 ] && echo "ALLOW_SHARED=1: every lane on cores $cores, contended"
    timeout "$LANE_S" taskset -c "$cores" python3 benchmarks/bench_pipeline.py --threads 1 \
      --json "$OUT/$name.json" "$@" 2>&1
    echo "lane $name (cores $cores) rc $?"
  } >"$OUT/$name.txt"
}

{ nproc --all; python3 -c "import torch; print(torch.__version__)"; } >&2
case "$PART" in
  2)
    lane 0 mlp2 --models mlp --stages 2 --repeats "$REPEATS" "${@:2}" &
    lane 1 gpt2 --models gpt --stages 2 --repeats "$REPEATS" "${@:2}" &
    lane 2 loaded2 --models mlp-first-loaded --stages 2 --repeats "$REPEATS" "${@:2}" &
    lane 3 mlp2zb --models mlp --stages 2 --schedules 1f1b zb-h1 zb-h2 \
      --repeats "$REPEATS" "${@:2}" &
    ;;
  4)
    lane 0 mlp4 --models mlp --stages 4 --repeats "$REPEATS" "${@:2}" &
    lane 1 gpt4 --models gpt --stages 4 --repeats "$REPEATS" "${@:2}" &
    ;;
esac
wait
for log in "$OUT"/*.txt; do
  echo "== $log"
  grep -A12 "^Goals per row" "$log" || tail -3 "$log"
done
