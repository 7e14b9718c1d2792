#!/usr/bin/env python3
"""packmoe's tokenizers against the Python libraries, on a few MB of real text (the GPU machine).

Trains three tokenizers on the same documents with the Python packages (no network needed):
  bpe-qwen       `tokenizers` byte-level BPE, NFC, Qwen2's Split regex + ByteLevel (as Qwen2/3)
  bpe-gpt2       `tokenizers` byte-level BPE, ByteLevel with GPT-2's own regex (as GPT-2)
  sentencepiece  `sentencepiece` BPE model with byte fallback (as Llama-2)
then runs `packmoe tokenize` on the same documents with each and compares the ids document by
document (Python: encode without template tokens, plus the end-of-document id packmoe appends).
Documents: the repository's text files (docs, sources, scripts), Python's standard library
sources up to --mb MB, and a few hundred seeded random multilingual documents (letters of many
scripts, digits, CJK, emoji, combining marks, contractions, special tokens, odd whitespace).

Prints one summary line, and on a mismatch one more line with the first difference; exits 0 when
every document matches, 1 otherwise.

  python3 scripts/tokenizer_check.py --packmoe build/packmoe
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import sysconfig
import time

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT_EXT = (".md", ".cpp", ".h", ".cu", ".cuh", ".py", ".sh", ".txt", ".cmake", ".json")


def repo_documents(root):
    docs = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("build", "runs"))
        for name in sorted(files):
            if name.endswith(TEXT_EXT) or name in ("Makefile", "CMakeLists.txt"):
                docs.append(os.path.join(base, name))
    return docs


def read_texts(paths, budget):
    texts, size = [], 0
    for p in paths:
        if size >= budget:
            break
        try:
            with open(p, encoding="utf-8") as f:
                t = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if t:
            texts.append(t)
            size += len(t.encode("utf-8"))
    return texts, size


def random_documents(n, seed=1234):
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x17F), (0x300, 0x36F), (0x391, 0x3C9),
              (0x410, 0x44F), (0x5D0, 0x5EA), (0x620, 0x64A), (0x660, 0x669), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F64F),
              (0x2000, 0x200A), (0x3000, 0x3000), (0xFF10, 0xFF19)]
    words = [" the", " don't", " it's", " I'M", " we'll", " 12345", " \u00e9t\u00e9",
             " e\u0301t\u0065\u0301", "\n\n", "   ", "\t", " caf\u00e9", " na\u00efve"]
    docs = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 80)):
            r = rng.random()
            if r < 0.3:
                parts.append(rng.choice(words))
            elif r < 0.33:
                parts.append(rng.choice(SPECIALS))
            else:
                lo, hi = rng.choice(ranges)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
        docs.append("".join(parts))
    return docs


def read_megatron(prefix):
    """The documents of a Megatron .idx/.bin (one sequence per document, as packmoe writes)."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "bad magic"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1
    fmt, width = {8: ("H", 2), 4: ("i", 4)}[code]
    lengths = struct.unpack_from("<%di" % n_seq, idx, 34)
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    tokens = struct.unpack("<%d%s" % (len(data) // width, fmt), data)
    docs, at = [], 0
    for n in lengths:
        docs.append(list(tokens[at:at + n]))
        at += n
    return docs


def train_bpe(texts, out_dir, qwen, vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    if qwen:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    eos = tok.token_to_id("<|endoftext|>")
    return lambda t: tok.encode(t, add_special_tokens=False).ids + [eos]


def train_sentencepiece(texts, out_dir, vocab_size):
    import sentencepiece as spm
    os.makedirs(out_dir, exist_ok=True)
    lines = os.path.join(out_dir, "lines.txt")
    with open(lines, "w", encoding="utf-8") as f:
        for t in texts:
            for line in t.splitlines():
                if line.strip():
                    f.write(line + "\n")
    prefix = os.path.join(out_dir, "sp")
    spm.SentencePieceTrainer.train(input=lines, model_prefix=prefix, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.9995,
                                   input_sentence_size=200000, shuffle_input_sentence=True,
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    eos = sp.eos_id()
    return prefix + ".model", (lambda t: sp.encode(t) + [eos])


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--packmoe", required=True, help="path to the packmoe binary")
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."),
                    help="repository root whose text files are the first documents")
    ap.add_argument("--mb", type=float, default=4.0, help="MB of text (default 4)")
    ap.add_argument("--vocab", type=int, default=8000, help="vocabulary size (default 8000)")
    ap.add_argument("--work", default="/tmp/packmoe_tokenizer_check", help="scratch folder")
    ap.add_argument("--threads", type=int, default=0, help="packmoe tokenize --threads (0: all)")
    ap.add_argument("--only", nargs="+", choices=["bpe-qwen", "bpe-gpt2", "sentencepiece"],
                    default=["bpe-qwen", "bpe-gpt2", "sentencepiece"],
                    help="tokenizers to check (default: all three)")
    args = ap.parse_args()

    budget = int(args.mb * 1e6)
    texts, size = read_texts(repo_documents(args.root), budget)
    if size < budget:
        stdlib = repo_documents(sysconfig.get_paths()["stdlib"])
        more, more_size = read_texts(stdlib, budget - size)
        texts += more
        size += more_size
    texts += random_documents(400)
    size = sum(len(t.encode("utf-8")) for t in texts)
    os.makedirs(args.work, exist_ok=True)
    corpus = os.path.join(args.work, "corpus.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")

    cases = []
    for name, qwen in (("bpe-qwen", True), ("bpe-gpt2", False)):
        if name in args.only:
            d = os.path.join(args.work, name)
            cases.append((name, d, train_bpe(texts, d, qwen, args.vocab)))
    if "sentencepiece" in args.only:
        sp_model, sp_encode = train_sentencepiece(
            texts, os.path.join(args.work, "sentencepiece"), args.vocab)
        cases.append(("sentencepiece", sp_model, sp_encode))

    results, first = [], None
    for name, tokenizer, encode in cases:
        prefix = os.path.join(args.work, name + "-out")
        cmd = [args.packmoe, "tokenize", "--quiet", "--tokenizer", tokenizer, "--input", corpus,
               "--output", prefix]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        start = time.time()
        run = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.time() - start
        if run.returncode != 0:
            results.append("%s: packmoe tokenize failed (%s)" % (name, run.stderr.strip()))
            first = first or "%s: %s" % (name, run.stderr.strip())
            continue
        ours = read_megatron(prefix)
        equal = 0
        for i, t in enumerate(texts):
            theirs = encode(t)
            mine = ours[i] if i < len(ours) else []
            if mine == theirs:
                equal += 1
            elif first is None:
                at = first_difference(mine, theirs)
                first = ("%s document %d (%r...): at token %d packmoe %s, python %s" %
                         (name, i, t[:60], at, mine[max(0, at - 3):at + 5],
                          theirs[max(0, at - 3):at + 5]))
        if len(ours) != len(texts):
            first = first or "%s: packmoe wrote %d documents, expected %d" % (
                name, len(ours), len(texts))
        results.append("%s %d/%d (%.1f s)" % (name, equal, len(texts), seconds))
    print("tokenizer_check: ids equal: %s documents, %.1f MB of text; first difference: %s" %
          (", ".join(results), size / 1e6, "none" if first is None else "see next line"))
    if first is not None:
        print("tokenizer_check: first difference: " + first)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
