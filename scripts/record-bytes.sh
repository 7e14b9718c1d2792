#!/usr/bin/env bash
# record-bytes.sh: the bytes a set of small CPU training runs produce, as one "sha256  artifact"
# line per artifact (metrics without timing fields, every checkpoint file), so two builds can be
# compared for byte identity: run it on each and diff the outputs.
# Usage: scripts/record-bytes.sh [PACKMOE_BINARY] [WORK_DIR]  (defaults: build/packmoe, a temp dir)
# Single-threaded BLAS/OpenMP, so the numbers do not depend on the thread count.
set -euo pipefail

bin=$(realpath "${1:-build/packmoe}")
work=${2:-$(mktemp -d)}
mkdir -p "$work"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=passive
small=(--preset tiny --device cpu --eval-interval 10)
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2)

# One run: NAME then the command's arguments; its stdout/stderr go to WORK/NAME.log.
run() {
  local name=$1
  shift
  rm -rf "${work:?}/$name"
  mkdir -p "$work/$name"
  if ! "$@" --out "$work/$name/out" --save-dir "$work/$name/ckpt" >"$work/$name.log" 2>&1; then
    echo "record-bytes: run $name failed (log: $work/$name.log)" >&2
    exit 1
  fi
}

# Hash lines of a run: metrics.jsonl without timing fields, then every checkpoint file.
hashes() {
  local name=$1
  jq -c 'del(.tokens_per_s, .elapsed_s, .tflops, .mfu)' "$work/$name/out/metrics.jsonl" |
    sha256sum | sed "s|-\$|$name/metrics.jsonl (no timing)|"
  (cd "$work/$name/ckpt" && find . -type f | LC_ALL=C sort | xargs sha256sum |
    sed "s|  \./|  $name/ckpt/|")
}

names=()
for recipe in bf16 mxfp8 nvfp4; do
  for primary in low high; do
    run "$recipe-$primary" "$bin" train "${small[@]}" --steps 30 --recipe "$recipe" --primary "$primary"
    names+=("$recipe-$primary")
  done
done
run nvfp4-low-discrete "$bin" train "${small[@]}" --steps 30 --recipe nvfp4 --layout discrete
names+=(nvfp4-low-discrete)

# Resume: 20 steps saved every 10, then --resume auto to 30 (same out and save dirs).
run mxfp8-resume "$bin" train "${small[@]}" --recipe mxfp8 --steps 20 --save-interval 10
"$bin" train "${small[@]}" --steps 30 --recipe mxfp8 --save-interval 10 --resume auto \
  --out "$work/mxfp8-resume/out" --save-dir "$work/mxfp8-resume/ckpt" >>"$work/mxfp8-resume.log" 2>&1
names+=(mxfp8-resume)

for mode in bf16 lowp reuse-grad-buffer; do
  run "np2-nvfp4-$mode" "${mpi[@]}" "$bin" train "${small[@]}" --steps 30 --recipe nvfp4 --gather-mode "$mode"
  names+=("np2-nvfp4-$mode")
done
run np2-mxfp8-lowp "${mpi[@]}" "$bin" train "${small[@]}" --steps 30 --recipe mxfp8 --gather-mode lowp
names+=(np2-mxfp8-lowp)
run np2-bf16-bf16 "${mpi[@]}" "$bin" train "${small[@]}" --steps 30 --recipe bf16 --gather-mode bf16
names+=(np2-bf16-bf16)

for name in "${names[@]}"; do hashes "$name"; done
