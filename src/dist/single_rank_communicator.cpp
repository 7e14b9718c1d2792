// The one-rank communicator of a process that trains alone: dist/communicator.h's local one.
#include "dist/single_rank_communicator.h"

namespace packmoe {

std::unique_ptr<Communicator> make_single_rank_communicator(Backend& backend) {
  CommOptions options;
  options.verify_calls = false;
  options.timeout_s = 0;
  return make_local_communicator(backend, options);
}

}  // namespace packmoe
