// The attention ops of the CUDA backend (backend/ops/model.h): the FlashAttention-class kernels
// of flash_attention_sm90.h on the backend's stream, the backward's workspace from the backend.
// Invariant: deterministic and batch-invariant (the kernels' promise: docs/attention-sm90.md).
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/flash_attention_sm90.h"

namespace packmoe {

Status attention_sm90(CudaBackend& be, const AttentionArgs& a) {
  const cuda::FlashAttentionShape shape{a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim, a.scale};
  return cuda::flash_attention_forward_sm90(shape, a.q, a.k, a.v, a.doc_start, a.o, a.lse,
                                            be.stream());
}

Status attention_backward_sm90(CudaBackend& be, const AttentionBackwardArgs& a) {
  const cuda::FlashAttentionShape shape{a.batch, a.seq, a.q_heads, a.kv_heads, a.head_dim, a.scale};
  void* workspace = be.workspace(cuda::flash_attention_backward_workspace_bytes(shape));
  return cuda::flash_attention_backward_sm90(shape, a.q, a.k, a.v, a.o, a.dout, a.lse,
                                             a.doc_start, a.dq, a.dk, a.dv, workspace,
                                             be.stream());
}

}  // namespace packmoe
