#!/usr/bin/env bash
# GPU workflow, one call on the GPU machine: configure with CUDA, build, run every test (the
# `cuda` label included) and the demo, run the PyTorch peers (shared/peers and bench/*.py) and
# packmoe's benchmarks in the same call, and print a short table last. Logs go to $OUT (default
# ./gpu-out): build.log tests.log peers.log bench.log summary.txt and the peers' JSON.
# scripts/gpu-step.sh: `packmoe train` against the PyTorch peer per preset, grad-accum and recipe.
# With build-hfcheck carried, the transformers check of hf_export_check.py runs too.
# On 2+ GPUs, data parallelism: the small preset on 1 GPU and on 2 (mpirun -np 2), each gather mode,
# and expert parallelism (EP 2); the NCCL tests (EP MoE block included) run their 2-4 rank cases.
# Usage: scripts/gpu-run.sh [--no-peer] [--no-bench] [--no-tests] [--no-train] [--no-dp]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
run_peer=1 run_bench=1 run_tests=1 run_train=1 run_dp=1
for a in "$@"; do
  case "$a" in
    --no-peer) run_peer=0 ;;
    --no-bench) run_bench=0 ;;
    --no-tests) run_tests=0 ;;
    --no-train) run_train=0 ;;
    --no-dp) run_dp=0 ;;
    *) echo "gpu-run: unknown flag $a" >&2; exit 2 ;;
  esac
done
PEERS=""
for d in shared/peers ../shared/peers; do [ -f "$d/torch_grouped_gemm_and_quant.py" ] && PEERS=$d && break; done

summary=()
note() { summary+=("$1"); echo "== $1"; }
# The commit, and whether the tree differs from it (a copy of a working tree may carry an older
# .git than its files: then the label says so instead of naming a commit the files are not).
tree_label() {
  local head
  head=$(git rev-parse --short HEAD 2>/dev/null) || { echo "commit ?"; return; }
  if git diff --quiet HEAD -- 2>/dev/null; then echo "commit $head"; else echo "commit $head + uncommitted changes"; fi
}
note "$(nvidia-smi -L | head -1); $(tree_label); $(date -u +%F)"

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
  if build-gpu/packmoe demo --device cuda --experts 16 --rows 512 --cols 1024 >>"$OUT/bench.log" 2>&1; then
    note "demo: ok (packed == discrete and gpu == cpu in every recipe)"
  else
    note "demo: FAILED (see bench.log)"
  fi
fi

# Hugging Face: the export that `scripts/hf_export_check.py prepare` made on the CPU machine (carry
# build-hfcheck) loads in transformers and gives packmoe's loss.
if [ -d build-hfcheck ]; then
  note "$(python3 scripts/hf_export_check.py check build-hfcheck 2>&1 | tail -1)"
fi

# Peers: the shared quantization/GEMM and MoE-layer peers, and our torch grouped-GEMM peer
# (fprop/dgrad/wgrad).
declare -A peer_json
if [ $run_peer = 1 ]; then
  if [ -n "$PEERS" ] && OUT="$OUT" python3 "$PEERS/torch_grouped_gemm_and_quant.py" >>"$OUT/peers.log" 2>&1; then
    peer_json[bench_quantize]="$OUT/torch_peers.json"; note "peer torch_grouped_gemm_and_quant: ok"
  else
    note "peer torch_grouped_gemm_and_quant: FAILED or missing (copy ../shared/peers to ./shared/peers)"
  fi
  if [ -n "$PEERS" ] && OUT="$OUT" python3 "$PEERS/torch_moe_layer.py" >>"$OUT/peers.log" 2>&1; then
    peer_json[bench_moe_block]="$OUT/torch_moe_layer.json"; note "peer torch_moe_layer: ok"
  else
    note "peer torch_moe_layer: FAILED or missing"
  fi
  if [ -n "$PEERS" ] && python3 "$PEERS/torch_attention.py" >"$OUT/torch_attention.jsonl" 2>>"$OUT/peers.log"; then
    note "peer torch_attention: ok"
  else
    note "peer torch_attention: FAILED or missing"
  fi
  if [ -f bench/torch_grouped_gemm.py ]; then
    if python3 bench/torch_grouped_gemm.py --out "$OUT/torch_gemm_peers.json" >>"$OUT/peers.log" 2>&1; then
      peer_json[bench_grouped_gemm]="$OUT/torch_gemm_peers.json"; note "peer torch_grouped_gemm: ok"
    else
      note "peer torch_grouped_gemm: FAILED (see peers.log)"
    fi
  fi
fi

if [ $run_bench = 1 ]; then
  for b in build-gpu/bench_*; do
    name=$(basename "$b")
    args=()
    [ -n "${peer_json[$name]:-}" ] && args+=(--peer-json "${peer_json[$name]}")
    { echo "## $name ${args[*]}"; "$b" "${args[@]}"; } >>"$OUT/bench.log" 2>&1 || note "$name: FAILED"
  done
fi

# Attention against the SDPA peer of the same call: ours / cuDNN and ours / FlashAttention-2 in
# TFLOP/s (both count 4 D forward and 10 D backward FLOPs per causal pair).
if [ $run_bench = 1 ] && [ -s "$OUT/torch_attention.jsonl" ]; then
  python3 - "$OUT/bench.log" "$OUT/torch_attention.jsonl" >"$OUT/attention_ratios.txt" <<'PY'
import json, re, sys
ours = {}
for line in open(sys.argv[1]):
    m = re.match(r"B(\d+)\s+S(\d+)\s+Hq(\d+)\s+Hkv(\d+)\s+D(\d+)\s+docs (\d+)\s+\S+\s+\S+\s+(\S+)\s+(\S+)", line)
    if m and m.group(6) in ("0", "1"):
        ours[tuple(int(m.group(i)) for i in range(1, 6))] = (float(m.group(7)), float(m.group(8)))
peer = {}
for line in open(sys.argv[2]):
    r = json.loads(line)
    if "fwd_TFLOPs" in r:
        peer[(r["B"], r["S"], r["Hq"], r["Hkv"], r["D"], r["backend"])] = (r["fwd_TFLOPs"], r["bwd_TFLOPs"])
print("attention (TFLOP/s): shape | ours fwd bwd | cudnn fwd bwd | flash fwd bwd | ours/cudnn | ours/flash")
for k, (f, b) in sorted(ours.items()):
    c, fl = peer.get(k + ("cudnn",)), peer.get(k + ("flash",))
    rat = lambda p: "%.2f / %.2f" % (f / p[0], b / p[1]) if p else "-"
    fmt = lambda p: "%.0f %.0f" % p if p else "-"
    print("B%d S%d Hq%d Hkv%d D%d | %.0f %.0f | %s | %s | %s | %s" % (k + (f, b, fmt(c), fmt(fl), rat(c), rat(fl))))
PY
  note "attention vs SDPA: see attention_ratios.txt (also below)"
fi

# The whole training step against the PyTorch peer (eager and compiled) on both presets at
# grad-accum 1 and 8, each recipe (scripts/gpu-step.sh; its table is printed last).
if [ $run_train = 1 ]; then
  OUT="$OUT" PEERS="$PEERS" scripts/gpu-step.sh >"$OUT/step_run.log" 2>&1
  note "train step vs peer: see step_ratios.txt (also below)"
fi

# Data parallelism: the small preset, 10 steps of 16 x 512 tokens per GPU, on 1 GPU (plain) and on
# 2 (mpirun -np 2, NCCL) in each gather mode and with --expert-parallel 2; the log line of steps 6-10 (ms/step, tokens/s of the
# job) and the bytes all-gathered per step from the startup summary (dp.log). Each run: at most 2
# minutes (measured: 5-10 s each, the whole section under 2 minutes).
if [ $run_dp = 1 ]; then
  if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    note "dp: skipped (needs 2 GPUs)"
  else
    corpus=$(mktemp -d)
    cat README.md docs/*.md src/*/*.h > "$corpus/text.txt"
    mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 -x NCCL_NVLS_ENABLE=0)
    dp_note() {  # label, log text
      local it bytes
      it=$(grep -E "iteration +10/" <<<"$2" | sed -E 's/.*per iteration \(ms\): ([0-9.]+).*tokens\/s: ([0-9]+).*/\1 ms\/step, \2 tokens\/s/')
      bytes=$(grep -oE "[0-9.]+ MB all-gathered \([0-9.]+ B/param\)" <<<"$2")
      note "dp small $1: ${it:-FAILED (see dp.log)}${bytes:+, $bytes per step}"
    }
    for r in bf16 mxfp8 nvfp4; do
      args=(train --preset small --device cuda --recipe "$r" --steps 10 --micro-batch 16 --seq-len 512
            --warmup 2 --eval-interval 0 --log-interval 5 --data "text:$corpus/text.txt")
      log=$(timeout 120 build-gpu/packmoe "${args[@]}" --out "$corpus/dp1_$r" 2>&1 | tee -a "$OUT/dp.log")
      dp_note "$r 1 GPU" "$log"
      for m in bf16 lowp reuse-grad-buffer; do
        log=$(timeout 120 "${mpi[@]}" build-gpu/packmoe "${args[@]}" --gather-mode "$m" \
                --out "$corpus/dp2_${r}_$m" 2>&1 | tee -a "$OUT/dp.log")
        dp_note "$r 2 GPUs $m" "$log"
      done
      # Expert parallelism: the 16 experts over the 2 GPUs (all-to-all dispatch and combine).
      log=$(timeout 120 "${mpi[@]}" build-gpu/packmoe "${args[@]}" --expert-parallel 2 \
              --out "$corpus/ep2_$r" 2>&1 | tee -a "$OUT/dp.log")
      dp_note "$r 2 GPUs EP 2" "$log"
    done
  fi
fi

{
  echo "==================== summary ===================="
  printf '%s\n' "${summary[@]}"
  echo "-- cuda vs cpu"
  echo "$(grep -cE '\[cuda==cpu\].*mismatches=0$' "$OUT/tests.log") [cuda==cpu] lines with mismatches=0," \
       "$(grep -cE 'mismatches=[1-9]' "$OUT/tests.log") with mismatches; $(grep -c '\[gemm cuda\]' "$OUT/tests.log") [gemm cuda] lines"
  grep -E 'mismatches=[1-9]' "$OUT/tests.log" | head -10
  grep -ohE '\[moe cuda[^]]*\].*' "$OUT/tests.log" | head -40
  grep -E '\*\*\*Failed|FAILED' "$OUT/tests.log" 2>/dev/null | head -20
  echo "-- benchmarks"
  cat "$OUT/bench.log" 2>/dev/null
  cat "$OUT/attention_ratios.txt" 2>/dev/null
  cat "$OUT/step_ratios.txt" 2>/dev/null
} | tee "$OUT/summary.txt"
