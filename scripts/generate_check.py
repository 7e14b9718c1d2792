#!/usr/bin/env python3
"""Compares `packmoe generate` with transformers' greedy generate on an export-hf directory.

check (needs torch and transformers): runs `packmoe generate DIR --prompt TEXT --json` (greedy,
--tokens new tokens) and, on the same prompt ids, Qwen3MoeForCausalLM.generate (greedy, no
sampling, no penalties, the same end-of-sequence ids) in FP32 and in BF16, then compares the new
tokens one by one. At the first disagreement it reports transformers' top-2 logit margin there
(top-1 minus top-2 logit of that step) and packmoe's token's rank and logit gap: greedy decoding
can only follow one model's rounding, so a disagreement is expected where the margin is below the
numerical difference of the two implementations (packmoe rounds GEMM operands and activations to
BF16), and a bug where it is large. Exit status 0 when every dtype agrees or first disagrees at a
margin below --margin-bound, 1 otherwise.
prepare (needs only the packmoe binary): trains the tiny preset on the CPU for --steps steps and
writes DIR/hf (export-hf --dtype f32), a model whose logits are far from uniform.
Usage:
  generate_check.py prepare PACKMOE DIR [--steps 400]
  generate_check.py check PACKMOE HF_DIR [--prompt TEXT] [--tokens 32] [--device cuda|cpu]
                    [--packmoe-device cpu|cuda] [--dtypes float32,bfloat16] [--margin-bound 0.1]
"""
import argparse
import json
import os
import subprocess
import sys


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"generate_check: {' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
    return out.stdout


def prepare(args):
    root = args.dir
    os.makedirs(root, exist_ok=True)
    # A corpus of its own (the default one is the fortunes package, which a machine may lack).
    words = ("the quick brown fox jumps over a lazy dog while seven wise owls sing "
             "about rivers and stones under the old moon").split()
    with open(f"{root}/corpus.txt", "w") as f:
        for i in range(4000):
            f.write(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(9)) + ".\n")
    run([args.packmoe, "train", "--preset", "tiny", "--device", "cpu", "--steps", str(args.steps),
         "--eval-interval", "0", "--data", f"text:{root}/corpus.txt", "--save-dir", f"{root}/ckpt",
         "--out", f"{root}/train"])
    run([args.packmoe, "export-hf", f"{root}/ckpt", f"{root}/hf", "--dtype", "f32"])
    print(f"generate_check: prepared {root}/hf ({args.steps} steps of the tiny preset)")


def hf_greedy(torch, model_cls, model_dir, dtype, device, prompt_ids, tokens, stop_ids):
    """Transformers' greedy tokens after prompt_ids and the logits of every step."""
    model = model_cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    model = model.to(device).eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    eos = stop_ids if stop_ids else None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             do_sample=False, num_beams=1, repetition_penalty=1.0, top_k=None,
                             top_p=None, temperature=None, eos_token_id=eos,
                             pad_token_id=eos[0] if eos else 0, output_logits=True,
                             output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, len(prompt_ids):].tolist()
    # The raw logits of every step (the scores equal them here: no processor is active).
    steps = out.logits if getattr(out, "logits", None) is not None else out.scores
    logits = [step[0].float().cpu() for step in steps]
    return new, logits


def compare(name, packmoe_ids, hf_ids, logits, bound):
    """One report line; True when the tokens agree or first disagree below the margin bound."""
    n = min(len(packmoe_ids), len(hf_ids))
    margins = []
    for i in range(n):
        top2 = logits[i].topk(2).values.tolist()
        margin = top2[0] - top2[1]
        if packmoe_ids[i] != hf_ids[i]:
            z = logits[i]
            rank = int((z > z[packmoe_ids[i]]).sum())
            gap = float(z.max() - z[packmoe_ids[i]])
            smallest = min(margins) if margins else float("nan")
            ok = margin < bound
            print(f"generate_check: {name}: first disagreement at new token {i}: transformers "
                  f"{hf_ids[i]}, packmoe {packmoe_ids[i]} (rank {rank} in transformers, "
                  f"{gap:.4g} below its top); transformers' top-2 margin there {margin:.4g} "
                  f"({'below' if ok else 'ABOVE'} the bound {bound}); the {i} agreeing tokens "
                  f"had margins >= {smallest:.4g}")
            return ok
        margins.append(margin)
    if len(packmoe_ids) != len(hf_ids):
        print(f"generate_check: {name}: the first {n} tokens agree, then one side stopped: "
              f"packmoe {len(packmoe_ids)} tokens, transformers {len(hf_ids)}")
        return False
    print(f"generate_check: {name}: all {n} tokens agree (smallest top-2 margin "
          f"{min(margins) if margins else float('nan'):.4g})")
    return True


def check(args):
    try:
        import torch
        from transformers import Qwen3MoeForCausalLM
    except ImportError as e:
        print(f"generate_check: SKIPPED ({e})")
        return 0
    got = json.loads(run([args.packmoe, "generate", args.dir, "--prompt", args.prompt,
                          "--max-new-tokens", str(args.tokens), "--device", args.packmoe_device,
                          "--json"]))
    prompt_ids, ids, stop_ids = got["prompt_ids"], got["ids"], got["stop_ids"]
    print(f"generate_check: packmoe on {got['device']}: {len(prompt_ids)} prompt tokens "
          f"({got['tokenizer']}), {len(ids)} new, stopped at {got['stop']}")
    try:  # the tokenizer's ids for the prompt, when the directory has Hugging Face tokenizer files
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.dir)
        hf_prompt = tok(args.prompt, add_special_tokens=False)["input_ids"]
        print(f"generate_check: prompt ids {'equal' if hf_prompt == prompt_ids else 'DIFFER'} "
              f"between packmoe and AutoTokenizer")
    except Exception as e:  # byte tokens: no tokenizer files
        print(f"generate_check: no AutoTokenizer for {args.dir} ({type(e).__name__}); using "
              f"packmoe's prompt ids")
    device = args.device if args.device != "cuda" or torch.cuda.is_available() else "cpu"
    ok = True
    for name in args.dtypes.split(","):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
        hf_ids, logits = hf_greedy(torch, Qwen3MoeForCausalLM, args.dir, dtype, device,
                                   prompt_ids, args.tokens, stop_ids)
        ok = compare(f"transformers {name} on {device}", ids, hf_ids, logits,
                     args.margin_bound) and ok
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("packmoe")
    pp.add_argument("dir")
    pp.add_argument("--steps", type=int, default=400)
    pc = sub.add_parser("check")
    pc.add_argument("packmoe")
    pc.add_argument("dir", help="an export-hf directory")
    pc.add_argument("--prompt", default="The meaning of life is")
    pc.add_argument("--tokens", type=int, default=32)
    pc.add_argument("--device", default="cuda", help="transformers' device")
    pc.add_argument("--packmoe-device", default="cpu")
    pc.add_argument("--dtypes", default="float32,bfloat16")
    pc.add_argument("--margin-bound", type=float, default=0.1,
                    help="a first disagreement is accepted where transformers' top-2 margin is "
                         "below this (logit units)")
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args)
        return 0
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
