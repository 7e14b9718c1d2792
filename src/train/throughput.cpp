// Model FLOPs per token (formula in the header).
#include "train/throughput.h"

namespace packmoe::train {

double model_flops_per_token(const ModelConfig& m, int64_t seq_len) {
  const double H = static_cast<double>(m.hidden_size), D = static_cast<double>(m.head_dim);
  const double Hq = static_cast<double>(m.num_attention_heads);
  const double Hkv = static_cast<double>(m.num_key_value_heads);
  double matmul = static_cast<double>(m.vocab_size) * H;  // lm_head
  for (int64_t i = 0; i < m.num_hidden_layers; ++i) {
    matmul += H * Hq * D + 2 * H * Hkv * D + Hq * D * H;
    if (m.is_moe_layer(i)) {
      matmul += static_cast<double>(m.num_experts) * H +
                static_cast<double>(m.num_experts_per_tok) * 3 *
                    static_cast<double>(m.moe_intermediate_size) * H;
    } else {
      matmul += 3 * static_cast<double>(m.intermediate_size) * H;
    }
  }
  const double attention = 12 * static_cast<double>(m.num_hidden_layers) *
                           static_cast<double>(seq_len) * Hq * D;
  return 6 * matmul + attention;
}

}  // namespace packmoe::train
