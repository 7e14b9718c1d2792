// libFuzzer entry of the tokenizer_encode target (tests/fuzz/fuzz_targets.h); built only with
// -DPACKMOE_FUZZ=ON (clang): build-fuzz/fuzz_tokenizer_encode -max_total_time=600 [corpus dir].
#include "fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return packmoe::fuzz::fuzz_tokenizer_encode(data, size);
}
