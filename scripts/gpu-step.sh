#!/usr/bin/env bash
# The whole training step on the GPU machine, packmoe against the PyTorch peer in the same call:
# for each preset and grad-accum, `packmoe train` in each recipe and bench/torch_train_step.py
# (the shared lean peer, eager and torch.compile), then a table of ms per optimizer step, tokens/s,
# peak memory (nvidia-smi's, sampled every 200 ms, for both; the peer's allocator peak too) and
# the ratios (packmoe tokens/s over the peer's) printed last (step_ratios.txt).
# With --timeline, the first recipe's packmoe run of each preset/grad-accum runs under the CUPTI
# tracer (tools/probes/cuda_timeline.cpp) and its per-kernel time of one step goes to
# timelines.txt, one section per preset and grad-accum (tools/probes/timeline_gaps.py: one file,
# as the device tool returns only a few files per call); its row is marked (traced).
# Needs build-gpu/ (scripts/gpu-run.sh builds it) and the shared peers (PEERS or shared/peers).
# Usage: scripts/gpu-step.sh [--presets "qwen3_30b_a3b_layers small"] [--grad-accum "1 8"]
#                            [--recipes "bf16 mxfp8 nvfp4"] [--peer "eager compile"] [--timeline]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
presets="qwen3_30b_a3b_layers small" gas="1 8" recipes="bf16 mxfp8 nvfp4" peer_modes="eager compile"
timeline=0
while [ $# -gt 0 ]; do
  case "$1" in
    --presets) presets=$2; shift 2 ;;
    --grad-accum) gas=$2; shift 2 ;;
    --recipes) recipes=$2; shift 2 ;;
    --peer) peer_modes=$2; shift 2 ;;
    --timeline) timeline=1; shift ;;
    *) echo "gpu-step: unknown argument $1" >&2; exit 2 ;;
  esac
done
PEERS=${PEERS:-}
for d in shared/peers ../shared/peers; do
  [ -z "$PEERS" ] && [ -f "$d/torch_qwen3_moe_train.py" ] && PEERS=$d
done
corpus=$(mktemp -d)
cat README.md docs/*.md src/*/*.h > "$corpus/text.txt"
if [ $timeline = 1 ]; then
  cupti=/usr/local/cuda/targets/x86_64-linux
  g++ -shared -fPIC -O2 -I$cupti/include -I/usr/local/cuda/include tools/probes/cuda_timeline.cpp \
    -o "$corpus/libcuda_timeline.so" -L$cupti/lib -lcupti -Wl,-rpath,$cupti/lib || timeline=0
fi

shape() {  # preset -> "B S"
  case "$1" in small) echo "16 512" ;; *) echo "4 2048" ;; esac
}
rows=()
row() { rows+=("$1"); echo "$1" >>"$OUT/step_rows.txt"; }  # also as they come, for a cut-off run
for p in $presets; do
  read -r B S <<<"$(shape "$p")"
  for ga in $gas; do
    steps=$(( ga == 1 ? 12 : 6 )) logi=$(( ga == 1 ? 4 : 2 ))
    for r in $recipes; do
      tl=()
      if [ $timeline = 1 ] && [ "$r" = "${recipes%% *}" ]; then
        tl=(env PACKMOE_TIMELINE_OUT="$corpus/tl.txt" CUDA_INJECTION64_PATH="$corpus/libcuda_timeline.so")
      fi
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$corpus/mem.txt" &
      smi=$!
      t0=$(date +%s.%N)
      log=$("${tl[@]}" build-gpu/packmoe train --preset "$p" --device cuda --recipe "$r" \
              --micro-batch "$B" --seq-len "$S" --grad-accum "$ga" --steps $steps --warmup 2 \
              --eval-interval 0 --log-interval $logi --data "text:$corpus/text.txt" \
              --out "$corpus/run_${p}_${ga}_$r" 2>&1 | tee -a "$OUT/step.log")
      line=$(grep -E "iteration +$steps/" <<<"$log" | tail -1)
      ms=$(sed -nE 's/.*per iteration \(ms\): ([0-9.]+).*/\1/p' <<<"$line")
      tps=$(sed -nE 's/.*tokens\/s: ([0-9]+).*/\1/p' <<<"$line")
      wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
      kill $smi 2>/dev/null; wait $smi 2>/dev/null
      pool=$(sed -nE 's/.*peak memory \(GB\): ([0-9.]+).*/\1/p' <<<"$line")
      mem="pool peak ${pool:-?} GB, peak $(sort -n "$corpus/mem.txt" | tail -1) MiB (nvidia-smi), run ${wall} s"
      label=packmoe-$r; [ ${#tl[@]} -gt 0 ] && label="packmoe-$r(traced)"
      row "$p ga$ga $label|${ms:-FAILED}|${tps:-0}|${mem:--}"
      if [ ${#tl[@]} -gt 0 ] && [ -s "$corpus/tl.txt" ]; then
        { echo "==== timeline: $p grad-accum $ga, $r"
          python3 tools/probes/timeline_gaps.py "$corpus/tl.txt" --marker-kernel adamw_kernel --top 30
        } >>"$OUT/timelines.txt" 2>&1
        rm -f "$corpus/tl.txt"
      fi
    done
    for m in $peer_modes; do
      flag=(); [ "$m" = compile ] && flag=(--compile)
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$corpus/mem.txt" &
      smi=$!
      j=$(python3 bench/torch_train_step.py --peers "$PEERS" --preset "$p" --batch "$B" --seq "$S" \
            --grad-accum "$ga" "${flag[@]}" 2>>"$OUT/step.log" | tail -1)
      kill $smi 2>/dev/null; wait $smi 2>/dev/null
      echo "$j" >>"$OUT/step_peers.jsonl"
      ms=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$j" 2>/dev/null)
      tps=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["tokens_per_s"])' "$j" 2>/dev/null)
      mem=$(python3 -c 'import json,sys; print("peak %s GiB allocated" % json.loads(sys.argv[1])["peak_mem_GiB"])' "$j" 2>/dev/null)
      mem="$mem, peak $(sort -n "$corpus/mem.txt" | tail -1) MiB (nvidia-smi)"
      row "$p ga$ga torch-$m|${ms:-FAILED}|${tps:-0}|${mem:--}"
    done
  done
done

{
  echo "train step: preset ga who | ms/step | tokens/s | memory | tokens/s over torch eager, compiled"
  for row in "${rows[@]}"; do
    IFS='|' read -r who ms tps mem <<<"$row"
    key=${who% *}
    eager=0 comp=0
    for o in "${rows[@]}"; do
      IFS='|' read -r w2 _ t2 _ <<<"$o"
      [ "$w2" = "$key torch-eager" ] && eager=$t2
      [ "$w2" = "$key torch-compile" ] && comp=$t2
    done
    ratio() { [ "$2" -gt 0 ] 2>/dev/null && awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", a/b}' || echo -; }
    echo "$who | $ms | $tps | $mem | $(ratio "$tps" "$eager") $(ratio "$tps" "$comp")"
  done
} | tee "$OUT/step_ratios.txt"
