// Factory of the NCCL communicator, declared without CUDA headers so host code can call it. It is
// defined in dist/cuda/nccl_communicator.cu and linked only in CUDA builds (PACKMOE_WITH_CUDA):
// call it only there (dist/comm_factory.cpp does).
#pragma once

#include <memory>

#include "dist/communicator.h"

namespace packmoe {

// NCCL over the ranks of `host` (MPI under mpirun, Local for one rank), which passes the NCCL
// unique id from rank 0 and stays the host channel (call checks, barrier, abort). Selects GPU
// OMPI_COMM_WORLD_LOCAL_RANK (0 without mpirun) before the CUDA backend is first created. With
// several ranks a failure aborts the job (the other ranks are already waiting); alone it returns
// the Status.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(std::unique_ptr<Communicator> host,
                                                             const CommOptions& options);

// cudaGetDeviceCount, 0 on error (no driver, no device); creates no backend and selects no GPU.
int cuda_device_count();

}  // namespace packmoe
