#!/usr/bin/env python3
"""Checks that `packmoe export-hf` output is the model packmoe trains, as Hugging Face sees it.

prepare (needs the packmoe binary, no Python packages): trains the tiny preset a few steps, saves
a checkpoint, exports it in F32, writes an llm.c token shard and records packmoe's forward loss on
the first batch of that shard (the `--init-from-hf` run's iteration-1 loss, before any update).
check (needs torch and transformers): loads the export with
Qwen3MoeForCausalLM.from_pretrained, computes the cross-entropy on the same batch and compares it
with packmoe's. packmoe rounds GEMM operands to BF16, so the two agree to about 1e-3 relative, not
bitwise; a wrong name, gate/up order, norm or RoPE convention moves the loss by far more.
Usage: hf_export_check.py prepare PACKMOE DIR | hf_export_check.py check DIR
"""
import json
import os
import re
import struct
import subprocess
import sys

BATCH, SEQ = 4, 64
TOLERANCE = 1e-2  # relative difference of the losses


def prepare(packmoe, root):
    os.makedirs(root, exist_ok=True)

    def run(*args):
        out = subprocess.run([packmoe, *args], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"hf_export_check: packmoe {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
        return out.stdout

    run("train", "--preset", "tiny", "--device", "cpu", "--steps", "20", "--micro-batch", "4",
        "--seq-len", "64", "--warmup", "2", "--eval-interval", "0", "--save-dir",
        f"{root}/ckpt", "--save-interval", "20", "--out", f"{root}/train")
    run("export-hf", f"{root}/ckpt", f"{root}/hf", "--dtype", "f32")
    # llm.c GPT-2 shard: 256 int32 header (magic, version, count), then uint16 tokens.
    text = open(__file__, "rb").read()[: BATCH * SEQ * 4]
    tokens = list(text)
    with open(f"{root}/tokens.bin", "wb") as f:
        header = [20240520, 1, len(tokens)] + [0] * 253
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))
    log = run("train", "--init-from-hf", f"{root}/hf", "--data", f"llmc:{root}/tokens.bin",
              "--device", "cpu", "--steps", "1", "--micro-batch", str(BATCH), "--seq-len",
              str(SEQ), "--eval-interval", "0", "--log-interval", "1", "--out", f"{root}/eval")
    loss = float(re.search(r"lm loss: ([0-9.E+-]+)", log).group(1))
    # The sampler's first batch: row b is tokens[b S, b S + S + 1) (train/batch_sampler.h).
    rows = [tokens[b * SEQ: b * SEQ + SEQ + 1] for b in range(BATCH)]
    json.dump({"loss": loss, "rows": rows}, open(f"{root}/expected.json", "w"))
    print(f"hf_export_check: prepared {root}: packmoe loss {loss:.6f}")


def check(root):
    try:
        import torch
        from transformers import Qwen3MoeForCausalLM
    except ImportError as e:
        print(f"hf_export_check: SKIPPED ({e})")
        return
    expected = json.load(open(f"{root}/expected.json"))
    model = Qwen3MoeForCausalLM.from_pretrained(f"{root}/hf", torch_dtype=torch.float32).eval()
    rows = torch.tensor(expected["rows"], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=rows[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             rows[:, 1:].reshape(-1)).item()
    rel = abs(loss - expected["loss"]) / expected["loss"]
    verdict = "ok" if rel <= TOLERANCE else "MISMATCH"
    print(f"hf_export_check: {verdict}: transformers loss {loss:.6f}, packmoe {expected['loss']:.6f}, "
          f"rel diff {rel:.2e} (tol {TOLERANCE:g})")
    if rel > TOLERANCE:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        sys.exit(__doc__)
