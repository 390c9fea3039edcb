#!/usr/bin/env bash
# One short session on a lent GPU machine (issue 28): the GPU-marked tests, benchmarks/
# bench_gpu.py, the quick start on the GPU, and the whole suite, each bounded, with their
# logs under $OUT. Two lanes so that the timed figures do not share the machine: lane A
# (CPU cores 0-3) times the GPU first; lane B (cores 4-15) starts the suite 130 s later.
# Lane A takes up to 550 s: give the device call a limit of about 570 s.
# Run from the repository root: `bash benchmarks/gpu_session.sh` (OUT defaults to ./gpu-out).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1 PARATRAIN_DATA=$PWD/.gpu/data
if [ -d .gpu/data ] && [ ! -d ../shared/data ]; then mkdir -p ../shared && cp -r .gpu/data ../shared/; fi
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; nproc; } >"$OUT/machine.txt" 2>&1

pin() {  # pin() CORES command...: taskset where the machine has it
  local cores=$1; shift
  if command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi
}

lane_a() {
  pin 0-3 timeout 150 python3 benchmarks/bench_gpu.py --part mfu --part overhead \
    --json "$OUT/bench_speed.json" >"$OUT/bench_speed.log" 2>&1
  pin 0-3 timeout 110 python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests \
    >"$OUT/gpu_tests.log" 2>&1
  # gloo before memory: on an H100 the memory part's nine configurations outran 150 s
  # and took the gloo part with them (2026-11-27)
  pin 0-3 timeout 60 python3 benchmarks/bench_gpu.py --part gloo \
    --json "$OUT/bench_gloo.json" >"$OUT/bench_gloo.log" 2>&1
  pin 0-3 timeout 170 python3 benchmarks/bench_gpu.py --part memory \
    --json "$OUT/bench_memory.json" >"$OUT/bench_memory.log" 2>&1
  pin 0-3 timeout 60 python3 -m paratrain train --model gpt --dataset shakespeare \
    --strategy dp --steps 300 --global-batch 32 --eval-every 100 --no-progress \
    --run-dir /tmp/quickstart >"$OUT/quickstart.log" 2>&1
  echo "quickstart rc $?" >>"$OUT/quickstart.log"
}

lane_b() {
  sleep 130
  pin 4-15 timeout "${SUITE_S:-360}" python3 -m pytest -v -p no:cacheprovider -n 12 \
    --dist loadfile -m "not gpu" tests >"$OUT/suite.log" 2>&1
  echo "suite rc $?" >>"$OUT/suite.log"
}

lane_a & lane_b & wait
grep -E "FAILED|ERROR" "$OUT/suite.log" | sort | uniq | head -80 >"$OUT/suite_failures.txt"
tail -3 "$OUT/suite.log"; cat "$OUT/machine.txt" "$OUT"/bench_*.log "$OUT/gpu_tests.log" | tail -80
tail -8 "$OUT/quickstart.log"; wc -l "$OUT/suite_failures.txt"
