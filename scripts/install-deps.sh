#!/usr/bin/env bash
# Installs every Debian/Ubuntu package packmoe's build and tests need. Idempotent: when all are
# present it does nothing (no apt-get update). The CUDA toolkit is optional and never installed
# here: the build uses it when nvcc is found.
set -euo pipefail

packages=(
  g++ cmake ninja-build make pkg-config
  libgtest-dev          # GoogleTest
  nlohmann-json3-dev    # safetensors headers
  libcli11-dev          # command line
  libopenblas-dev       # CPU reference GEMM (cblas)
  libomp-dev            # OpenMP for the CPU backend (g++ uses libgomp; clang needs this)
  openmpi-bin           # mpirun: multi-rank jobs and the dist tests
  libopenmpi-dev        # MPI communicator (dist/mpi_communicator.cpp)
  libpcre2-dev          # tokenizer.json pre-tokenizer regexes, \p{L} \p{N} (tokenize/regex.h)
  libicu-dev            # NFC normalizer of tokenizer.json (tokenize/hf_tokenizer.cpp)
  libsentencepiece-dev  # SentencePiece .model tokenizers (tokenize/sentencepiece_tokenizer.h)
  python3               # test helpers
  fortunes              # default text corpus: /usr/share/games/fortunes (io/text_corpus.h)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=""
if [ "$(id -u)" -ne 0 ]; then sudo_cmd="sudo"; fi
$sudo_cmd apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
