#!/usr/bin/env bash
# Copies the tokenizer libraries of this Debian machine (PCRE2, ICU's common + data libraries,
# SentencePiece: what scripts/install-deps.sh installs) into one relocatable folder, for a machine
# that has the Python tokenizer packages but not these -dev packages (the GPU machine's image).
# There: PKG_CONFIG_PATH=$PWD/DIR/lib/pkgconfig cmake -S . -B build-tok -DPACKMOE_CUDA=OFF
# -DPACKMOE_TOKENIZERS=ON, build packmoe, and run it with LD_LIBRARY_PATH=$PWD/DIR/lib (ICU's data
# library is found through it), e.g. for scripts/tokenizer_check.py. About 41 MB.
# Usage: scripts/tokenizer-libs.sh [DIR]  (default: tokdeps; add it to .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-tokdeps}
lib=/usr/lib/x86_64-linux-gnu
for f in pcre2.h sentencepiece_processor.h sentencepiece_trainer.h unicode/utypes.h; do
  [ -f "/usr/include/$f" ] || { echo "tokenizer-libs: /usr/include/$f missing: run scripts/install-deps.sh" >&2; exit 1; }
done
rm -rf "$dir"
mkdir -p "$dir/lib/pkgconfig" "$dir/include"
cp -a "$lib"/libsentencepiece.so* "$lib"/libsentencepiece_train.so* "$lib"/libpcre2-8.so* \
      "$lib"/libicuuc.so* "$lib"/libicudata.so* "$dir/lib/"
cp -a /usr/include/pcre2.h /usr/include/sentencepiece_processor.h /usr/include/sentencepiece_trainer.h \
      /usr/include/unicode "$dir/include/"
# pkg-config files whose prefix is the folder itself (${pcfiledir}), so it can move.
for pc in sentencepiece libpcre2-8 icu-uc; do
  sed -E -e 's|^(prefix *= *).*|\1${pcfiledir}/../..|' -e 's|^(exec_prefix *= *).*|\1${prefix}|' \
         -e 's|^(libdir *= *).*|\1${prefix}/lib|' -e 's|^(includedir *= *).*|\1${prefix}/include|' \
         "$lib/pkgconfig/$pc.pc" > "$dir/lib/pkgconfig/$pc.pc"
done
echo "tokenizer-libs: wrote $dir ($(du -sh "$dir" | cut -f1)): PKG_CONFIG_PATH=$dir/lib/pkgconfig, LD_LIBRARY_PATH=$dir/lib (absolute paths)"
