#!/usr/bin/env python3
"""Peer of `packmoe train`: the lean PyTorch Qwen3-MoE training step of the shared peer script
(torch_qwen3_moe_train.py: FP32 parameters, BF16 autocast, SDPA, torch._grouped_mm, fused AdamW,
optionally torch.compile per decoder layer), here with gradient accumulation: each optimizer step
runs --grad-accum micro-batches of B x S fresh random tokens (loss / grad_accum each), then AdamW.
Prints one JSON line: ms per optimizer step, tokens/s, peak GPU memory.

Usage: torch_train_step.py --peers DIR [--preset P] [--batch B] [--seq S] [--grad-accum N]
                           [--compile] [--steps N]
"""
import argparse
import json
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", required=True, help="folder holding torch_qwen3_moe_train.py")
    ap.add_argument("--preset", default="qwen3_30b_a3b_layers")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps (after 2 warm-up)")
    a = ap.parse_args()
    sys.path.insert(0, a.peers)
    import torch
    import torch_qwen3_moe_train as peer

    c = peer.PRESETS[a.preset]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = peer.Model(c)
    if a.compile:
        for layer in model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    # One (B, S + 1) row block per micro-batch: each step sees grad_accum distinct micro-batches.
    ids = torch.randint(0, c["V"], (a.grad_accum, a.batch, a.seq + 1), device="cuda")

    def step():
        for m in range(a.grad_accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids[m, :, :-1], ids[m, :, 1:]) / a.grad_accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / a.steps
    print(json.dumps({
        "peer": "torch_train_step", "preset": a.preset, "B": a.batch, "S": a.seq,
        "grad_accum": a.grad_accum, "compile": a.compile, "ms_per_step": round(dt * 1e3, 2),
        "tokens_per_s": round(a.grad_accum * a.batch * a.seq / dt),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
