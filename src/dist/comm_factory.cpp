// make_communicator: picks and builds the implementation. Lives in the `packmoe` library (beside
// backend/registry.cpp), not packmoe_base, because it reaches the CPU backend instance and, in
// CUDA builds, the NCCL factory; host code never includes CUDA or NCCL headers.
#include "dist/communicator.h"
#include "dist/nccl_communicator.h"

namespace packmoe {

Result<std::unique_ptr<Communicator>> make_communicator(CommKind kind, const CommOptions& options) {
  switch (kind) {
    case CommKind::kLocal:
      return make_local_communicator(cpu_backend(), options);
    case CommKind::kMpi:
      return make_mpi_communicator(cpu_backend(), options);
    case CommKind::kNccl: {
#if defined(PACKMOE_WITH_CUDA)
      // The host channel's calls are internal to NCCL calls that are already checked.
      CommOptions host_options = options;
      host_options.verify_calls = false;
      Result<std::unique_ptr<Communicator>> host =
          launched_by_mpirun() ? make_mpi_communicator(cpu_backend(), host_options)
                               : make_local_communicator(cpu_backend(), host_options);
      if (!host) return host.status();
      return make_nccl_communicator(std::move(host).value(), options);
#else
      return Status::error("this packmoe was built without CUDA: the NCCL communicator needs "
                           "-DPACKMOE_CUDA=ON");
#endif
    }
  }
  return Status::error("unknown communicator kind");
}

int visible_cuda_devices() {
#if defined(PACKMOE_WITH_CUDA)
  return cuda_device_count();
#else
  return 0;
#endif
}

Result<std::unique_ptr<Communicator>> make_communicator(Device device) {
  Result<CommOptions> options = comm_options_from_env();
  if (!options) return options.status();
  return make_communicator(comm_kind_for(device), options.value());
}

}  // namespace packmoe
