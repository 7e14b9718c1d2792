#!/usr/bin/env python3
"""PyTorch peer of bench/grouped_gemm.cpp: the grouped expert GEMMs a PyTorch user gets today.

For four MoE shapes (E experts, weight W stored (E, N, K) = (E, 2F, H), M routed token rows split
unevenly over the experts, each split rounded UP to 32 tokens, packmoe's MXFP8 alignment) it times
with CUDA events the way bench_grouped_gemm times packmoe (after at least --warmup-ms, default 1500, of
warm-up calls, the median of 20 back-to-back calls, an event pair each, read after one
synchronisation):
  torch._grouped_mm BF16    fprop Y = X W^T, dgrad dX = dY W, wgrad dW = dY^T X
  per-expert torch.matmul   fprop
  torch._scaled_grouped_mm  fprop, FP8 E4M3 with rowwise scales
and writes {shape: {splits, E, N, K, M, *_ms, ...}} as JSON. bench_grouped_gemm --peer-json reads
the splits from it, so both sides multiply exactly the same problems.
"""
import argparse
import json
import os
import sys
import time

import torch

SHAPES = {
    # name: (E, H, F, M routed rows); N = 2F (FC1, gate + up), K = H
    "qwen3_30b_a3b": (128, 2048, 768, 131072),
    "deepseek_v3_ep8": (32, 7168, 2048, 65536),
    "mixtral_8x7b": (8, 4096, 14336, 16384),
    "small_64e": (64, 1024, 512, 65536),
}
ALIGN = 32
# Warm-up before each measurement, ms of wall time (--warmup-ms). 200 ms left a power-capped H200 in
# the state the previous measurement left it (docs/gemm-sm90.md, "Conversion rate, half-empty tiles,
# power").
WARMUP_MS = 1500.0


def log(*a):
    print(*a, flush=True)


def time_ms(fn, warmup_ms, iters=20):
    """Median ms of `iters` back-to-back calls after calling fn for at least warmup_ms of wall time
    (the GPU's clocks settle under this call's own load first): bench_grouped_gemm's method."""
    t0 = time.perf_counter()
    n = 0
    while True:
        fn()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()  # wall time follows the GPU, not the launch queue
        if (time.perf_counter() - t0) * 1e3 >= warmup_ms:
            break
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        stops[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, stops))
    return times[len(times) // 2]


def splits_for(E, M):
    """Uneven token split (same recipe as shared/peers), then each split rounded up to ALIGN."""
    torch.manual_seed(0)
    w = torch.rand(E) + 0.5
    s = (w / w.sum() * M / 16).floor().long() * 16
    s[-1] += M - s.sum()
    s = ((s + ALIGN - 1) // ALIGN) * ALIGN
    return [int(v) for v in s.tolist()]


def attempt(rec, warmup_ms, key, fn, flops=None):
    """Times fn into rec[key + '_ms'] (and TFLOP/s), or records 'fail: ...'."""
    try:
        ms = time_ms(fn, warmup_ms)
        rec[key + "_ms"] = ms
        if flops:
            rec[key + "_TFLOPs"] = flops / (ms * 1e-3) / 1e12
        log(f"  {key:28s} {ms:9.3f} ms" + (f" {flops / (ms * 1e-3) / 1e12:8.1f} TFLOP/s" if flops else ""))
    except Exception as ex:  # an unsupported form is a result, not a crash
        rec[key + "_ms"] = "fail: " + str(ex).replace("\n", " ")[:300]
        log(f"  {key:28s} {rec[key + '_ms']}")
    torch.cuda.synchronize()


def bench_shape(name, E, H, F, M_raw, dev, warmup_ms):
    N, K = 2 * F, H
    splits = splits_for(E, M_raw)
    M = sum(splits)
    rec = {"splits": splits, "E": E, "N": N, "K": K, "M": M, "M_unpadded": M_raw, "align": ALIGN}
    log(f"{name}: E={E} N={N} K={K} M={M} (padded from {M_raw})")
    flops = 2.0 * M * N * K
    offs = torch.cumsum(torch.tensor(splits, dtype=torch.int64), 0).to(dev, torch.int32)
    g = torch.Generator(device=dev)
    g.manual_seed(1)
    X = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    dY = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g)
    W = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # (E, N, K)

    has_gmm = hasattr(torch, "_grouped_mm")
    rec["has_grouped_mm"] = has_gmm
    if has_gmm:
        Wt = W.transpose(-2, -1)  # (E, K, N) view of the (E, N, K) storage
        attempt(rec, warmup_ms, "grouped_mm_fprop", lambda: torch._grouped_mm(X, Wt, offs=offs), flops)
        attempt(rec, warmup_ms, "grouped_mm_dgrad", lambda: torch._grouped_mm(dY, W, offs=offs), flops)
        # wgrad: 2D x 2D with offs partitioning the reduction (token) dim -> (E, N, K).
        dYt = dY.t()  # (N, M) view
        attempt(rec, warmup_ms, "grouped_mm_wgrad", lambda: torch._grouped_mm(dYt, X, offs=offs), flops)
        if isinstance(rec["grouped_mm_wgrad_ms"], str):
            # Some builds want the lhs contiguous in the (N, M) layout; the copy is made outside
            # the timed region, so the figure is the GEMM alone.
            dYt_c = dY.t().contiguous()
            rec["grouped_mm_wgrad_form"] = "dY.t().contiguous()"
            attempt(rec, warmup_ms, "grouped_mm_wgrad", lambda: torch._grouped_mm(dYt_c, X, offs=offs), flops)
            del dYt_c
        else:
            rec["grouped_mm_wgrad_form"] = "dY.t() (view)"
        # Sanity: one group of each op against torch.matmul.
        try:
            e = E // 2
            lo = sum(splits[:e])
            hi = lo + splits[e]
            y = torch._grouped_mm(X, Wt, offs=offs)[lo:hi].float()
            ref = (X[lo:hi].float() @ W[e].float().t())
            rec["grouped_mm_fprop_check_rel"] = float((y - ref).norm() / ref.norm())
            if not isinstance(rec["grouped_mm_wgrad_ms"], str):
                dw = torch._grouped_mm(dYt, X, offs=offs)[e].float()
                ref = dY[lo:hi].float().t() @ X[lo:hi].float()
                rec["grouped_mm_wgrad_check_rel"] = float((dw - ref).norm() / ref.norm())
        except Exception as ex:
            rec["check"] = "fail: " + str(ex)[:200]
    else:
        for op in ("fprop", "dgrad", "wgrad"):
            rec[f"grouped_mm_{op}_ms"] = "fail: torch has no _grouped_mm"

    xs = list(torch.split(X, splits))

    def loop():
        for e in range(E):
            torch.matmul(xs[e], W[e].t())

    attempt(rec, warmup_ms, "loop_fprop", loop, flops)

    if hasattr(torch, "_scaled_grouped_mm"):
        try:
            X8 = X.to(torch.float8_e4m3fn)
            W8 = W.to(torch.float8_e4m3fn).transpose(-2, -1)  # (E, K, N), column-major per expert
            sa = torch.ones(M, device=dev, dtype=torch.float32)
            sb = torch.ones(E, N, device=dev, dtype=torch.float32)
            attempt(rec, warmup_ms, "scaled_grouped_mm_fprop",
                    lambda: torch._scaled_grouped_mm(X8, W8, sa, sb, offs=offs, out_dtype=torch.bfloat16),
                    flops)
            del X8, W8
        except Exception as ex:
            rec["scaled_grouped_mm_fprop_ms"] = "fail: " + str(ex)[:300]
    else:
        rec["scaled_grouped_mm_fprop_ms"] = "fail: torch has no _scaled_grouped_mm"
    del X, dY, W, xs
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "torch_gemm_peers.json"))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset")
    ap.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                    help="untimed warm-up before each measurement, ms of wall time (at least one call)")
    args = ap.parse_args()
    if args.warmup_ms < 0:
        ap.error("--warmup-ms must be >= 0")
    if not torch.cuda.is_available():
        log("torch_grouped_gemm: no CUDA device")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    res = {"info": {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "gpu": torch.cuda.get_device_name(), "timing": f"CUDA events, median of 20 back-to-back calls after {args.warmup_ms:g} ms of warm-up",
                    "flops": "2*M*N*K per op"}}
    log(json.dumps(res["info"]))
    for name in args.shapes.split(","):
        E, H, F, M = SHAPES[name]
        res[name] = bench_shape(name, E, H, F, M, dev, args.warmup_ms)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
