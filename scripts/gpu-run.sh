#!/usr/bin/env bash
# GPU workflow, one call on the GPU machine: configure with CUDA, build, run every test (the
# `cuda` label included), run the PyTorch peer of ../shared/peers and packmoe's benchmarks in the
# same call, and print a short table last. Full logs go to $OUT (default ./gpu-out).
# Usage: scripts/gpu-run.sh [--no-peer] [--no-bench] [--no-tests]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
run_peer=1 run_bench=1 run_tests=1
for a in "$@"; do
  case "$a" in
    --no-peer) run_peer=0 ;;
    --no-bench) run_bench=0 ;;
    --no-tests) run_tests=0 ;;
    *) echo "gpu-run: unknown flag $a" >&2; exit 2 ;;
  esac
done
PEERS=""
for d in shared/peers ../shared/peers; do [ -f "$d/torch_grouped_gemm_and_quant.py" ] && PEERS=$d && break; done

summary=()
note() { summary+=("$1"); echo "== $1"; }

nvidia-smi -L | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"

t0=$(date +%s)
if cmake -S . -B build-gpu -G Ninja -DPACKMOE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
     >"$OUT/build.log" 2>&1 && cmake --build build-gpu -j "$(nproc)" >>"$OUT/build.log" 2>&1; then
  note "build: ok ($(( $(date +%s) - t0 )) s)"
else
  note "build: FAILED (see build.log)"; tail -40 "$OUT/build.log"; printf '%s\n' "${summary[@]}"; exit 1
fi

if [ $run_tests = 1 ]; then
  ctest --test-dir build-gpu -V -j 8 >"$OUT/tests.log" 2>&1
  note "tests: $(grep -E 'tests passed|tests failed' "$OUT/tests.log" | tail -1)"
  grep -oE '\[cuda==cpu\].*' "$OUT/tests.log" > "$OUT/cuda_cases.txt" || true
  if build-gpu/packmoe demo --device cuda --experts 16 --rows 512 --cols 1024 >"$OUT/demo.log" 2>&1; then
    note "demo: ok (packed == discrete, gpu == cpu, every recipe)"
  else
    note "demo: FAILED (see demo.log)"
  fi
fi

peer_json=""
if [ $run_peer = 1 ] && [ -n "$PEERS" ]; then
  if OUT="$OUT" PYTHONUNBUFFERED=1 python3 "$PEERS/torch_grouped_gemm_and_quant.py" >"$OUT/peer.log" 2>&1; then
    peer_json="$OUT/torch_peers.json"; note "peer: ok (torch_peers.json)"
  else
    note "peer: FAILED (see peer.log)"
  fi
elif [ $run_peer = 1 ]; then
  note "peer: not found (copy ../shared/peers into ./shared/peers)"
fi

if [ $run_bench = 1 ]; then
  for b in build-gpu/bench_*; do
    name=$(basename "$b")
    args=()
    [ -n "$peer_json" ] && args+=(--peer-json "$peer_json")
    "$b" "${args[@]}" >"$OUT/$name.log" 2>&1 || note "$name: FAILED"
  done
fi

echo
echo "==================== summary ===================="
printf '%s\n' "${summary[@]}"
[ -s "$OUT/cuda_cases.txt" ] && { echo "-- cuda vs cpu (bitwise)"; cat "$OUT/cuda_cases.txt"; }
for f in "$OUT"/bench_*.log; do [ -f "$f" ] && { echo "-- $(basename "$f" .log)"; cat "$f"; }; done
grep -E 'tests failed|Failed|\*\*\*' "$OUT/tests.log" 2>/dev/null | head -20
