// libFuzzer entry of the complete_json target (tests/fuzz/fuzz_targets.h); built only with
// -DPACKMOE_FUZZ=ON (clang): build-fuzz/fuzz_complete_json -max_total_time=600 [corpus dir].
#include "fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return packmoe::fuzz::fuzz_complete_json(data, size);
}
