// CUDA == CPU, bitwise, for what the distributed optimizer's low-precision gather adds: the NVFP4
// amax op, the NVFP4 quantize with a given amax (no amax output), the columnwise copy of 2D
// weights derived from the rowwise one (aligned and misaligned pointers), and GroupedParam's
// row-range quantization on the GPU against the CPU's whole-pack quantize.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/device_buffer.h"
#include "core/codecs.h"
#include "nn/grouped_param.h"

namespace packmoe {
namespace {

Backend* gpu_or_null() {
  Result<Backend*> b = get_backend(Device::kCUDA);
  return b.is_ok() ? b.value() : nullptr;
}

#define SKIP_WITHOUT_GPU()      \
  Backend* gpu = gpu_or_null(); \
  if (gpu == nullptr)           \
  GTEST_SKIP() << "no usable GPU: " << get_backend(Device::kCUDA).status().message()

// rows x k values, a scale per 16 rows, NaNs and an infinity in the last rows.
std::vector<float> random_values(std::mt19937& rng, int64_t rows, int64_t k) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-6, 6);
  std::vector<float> v(rows * k);
  float scale = 1.0f;
  for (int64_t i = 0; i < rows * k; ++i) {
    if (i % (16 * k) == 0) scale = std::ldexp(1.0f, exp(rng));
    v[i] = dist(rng) * scale;
    if (i % 613 == 3) v[i] = std::numeric_limits<float>::quiet_NaN();
  }
  v[rows * k - 5] = std::numeric_limits<float>::infinity();
  return v;
}

std::vector<uint16_t> bf16_of(const std::vector<float>& f) {
  std::vector<uint16_t> out(f.size());
  for (size_t i = 0; i < f.size(); ++i) out[i] = f32_to_bf16(f[i]);
  return out;
}

template <typename T>
DeviceBuffer to_gpu(Backend& gpu, const std::vector<T>& h, size_t extra = 0) {
  DeviceBuffer b(gpu, h.size() * sizeof(T) + extra);
  gpu.fill_zero(b.get(), b.size());
  gpu.copy(static_cast<uint8_t*>(b.get()) + extra, h.data(), h.size() * sizeof(T),
           Backend::CopyKind::kHostToDevice);
  return b;
}

std::vector<uint8_t> from_gpu(Backend& gpu, const void* p, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  gpu.copy(h.data(), p, bytes, Backend::CopyKind::kDeviceToHost);
  return h;
}

// Group pointers at row offsets of a base pointer.
std::vector<void*> at_rows(void* base, const std::vector<int64_t>& rows, int64_t bytes_per_row) {
  std::vector<void*> out;
  int64_t at = 0;
  for (int64_t r : rows) {
    out.push_back(static_cast<uint8_t*>(base) + at);
    at += r * bytes_per_row;
  }
  return out;
}

std::vector<const void*> const_ptrs(const std::vector<void*>& v) { return {v.begin(), v.end()}; }

TEST(CudaShardOps, Nvfp4AmaxAndGivenAmaxQuantizeMatchCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(31);
  const std::vector<int64_t> rows = {32, 0, 16, 48, 128};
  const int64_t k = 64, total = 224;
  const std::vector<float> f = random_values(rng, total, k);
  const std::vector<uint16_t> h = bf16_of(f);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(dtype_name(dt));
    const size_t es = dt == DType::kF32 ? 4 : 2;
    std::vector<uint8_t> host_in(total * k * es);
    std::memcpy(host_in.data(), dt == DType::kF32 ? static_cast<const void*>(f.data()) : h.data(),
                host_in.size());
    DeviceBuffer dev_in = to_gpu(*gpu, host_in);
    GroupedMatrices cin, gin;
    cin.dtype = gin.dtype = dt;
    cin.cols = gin.cols = k;
    cin.rows = gin.rows = rows;
    cin.data = const_ptrs(at_rows(host_in.data(), rows, k * es));
    gin.data = const_ptrs(at_rows(dev_in.get(), rows, k * es));
    std::vector<float> camax(rows.size());
    DeviceBuffer gamax(*gpu, rows.size() * 4);
    ASSERT_TRUE(ops::nvfp4_amax(cpu_backend(), cin, camax.data()).is_ok());
    ASSERT_TRUE(ops::nvfp4_amax(*gpu, gin, static_cast<float*>(gamax.get())).is_ok());
    EXPECT_EQ(from_gpu(*gpu, gamax.get(), gamax.size()),
              std::vector<uint8_t>(reinterpret_cast<uint8_t*>(camax.data()),
                                   reinterpret_cast<uint8_t*>(camax.data()) + gamax.size()));

    // Given an amax >= each group's own (x 1.5 for some), both copies, 1x16 and 2D.
    std::vector<float> given = camax;
    for (size_t g = 0; g < given.size(); g += 2) given[g] *= 1.5f;
    DeviceBuffer ggiven = to_gpu(*gpu, given);
    for (bool two_d : {false, true}) {
      SCOPED_TRACE(two_d ? "2D" : "1x16");
      Nvfp4Config ccfg;
      ccfg.columnwise = true;
      ccfg.two_d = two_d;
      Nvfp4Config gcfg = ccfg;
      ccfg.amax = given.data();
      gcfg.amax = static_cast<const float*>(ggiven.get());
      const size_t data = total * k / 2, scale = total * k / 16;
      std::vector<uint8_t> crd(data), crs(scale), ccd(data), ccs(scale);
      DeviceBuffer grd(*gpu, data), grs(*gpu, scale), gcd(*gpu, data), gcs(*gpu, scale);
      Nvfp4Outputs cout_{
          at_rows(crd.data(), rows, k / 2), at_rows(crs.data(), rows, k / 16), nullptr,
          at_rows(ccd.data(), rows, k / 2), at_rows(ccs.data(), rows, k / 16), nullptr, {}};
      Nvfp4Outputs gout{at_rows(grd.get(), rows, k / 2), at_rows(grs.get(), rows, k / 16), nullptr,
                        at_rows(gcd.get(), rows, k / 2), at_rows(gcs.get(), rows, k / 16), nullptr,
                        {}};
      ASSERT_TRUE(ops::quantize_nvfp4(cpu_backend(), cin, ccfg, cout_).is_ok());
      ASSERT_TRUE(ops::quantize_nvfp4(*gpu, gin, gcfg, gout).is_ok());
      EXPECT_EQ(from_gpu(*gpu, grd.get(), data), crd);
      EXPECT_EQ(from_gpu(*gpu, grs.get(), scale), crs);
      EXPECT_EQ(from_gpu(*gpu, gcd.get(), data), ccd);
      EXPECT_EQ(from_gpu(*gpu, gcs.get(), scale), ccs);
    }
  }
}

TEST(CudaShardOps, Weight2dColumnwiseMatchesCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(32);
  const int64_t g = 3, n = 64, k = 96;
  const std::vector<uint16_t> h = bf16_of(random_values(rng, g * n, k));
  GroupedMatrices in;
  in.cols = k;
  in.rows = {n, n, n};
  in.data = {h.data(), h.data() + n * k, h.data() + 2 * n * k};
  for (Tiled2dFormat fmt : {Tiled2dFormat::kMxfp8, Tiled2dFormat::kNvfp4})
    for (size_t shift : {0, 2}) {  // 2: the data pointers miss 16-byte alignment
      const bool mx = fmt == Tiled2dFormat::kMxfp8;
      SCOPED_TRACE(std::string(mx ? "mxfp8" : "nvfp4") + (shift ? " misaligned" : ""));
      const int64_t data = n * k / (mx ? 1 : 2), scale = n * k / (mx ? 32 : 16);  // per group
      std::vector<uint8_t> rd(g * data), rs(g * scale), cd(g * data), cs(g * scale);
      auto groups = [&](std::vector<uint8_t>& b, int64_t per) {
        return std::vector<void*>{b.data(), b.data() + per, b.data() + 2 * per};
      };
      if (mx) {
        Mxfp8Config cfg;
        cfg.two_d = true;
        ASSERT_TRUE(
            quantize_mxfp8_cpu(in, cfg, {groups(rd, data), groups(rs, scale), {}, {}, {}, {}}).is_ok());
      } else {
        Nvfp4Config cfg;
        cfg.two_d = true;
        std::vector<float> a(g);
        ASSERT_TRUE(quantize_nvfp4_cpu(
                        in, cfg, {groups(rd, data), groups(rs, scale), a.data(), {}, {}, nullptr, {}})
                        .is_ok());
      }
      Weight2dCopies cw{fmt,
                        n,
                        k,
                        const_ptrs(groups(rd, data)),
                        const_ptrs(groups(rs, scale)),
                        groups(cd, data),
                        groups(cs, scale)};
      ASSERT_TRUE(ops::weight_2d_columnwise(cpu_backend(), cw).is_ok());
      DeviceBuffer grd = to_gpu(*gpu, rd, shift), grs = to_gpu(*gpu, rs);
      DeviceBuffer gcd(*gpu, g * data + shift), gcs(*gpu, g * scale);
      auto dev = [&](const DeviceBuffer& b, size_t off, int64_t per) {
        uint8_t* base = static_cast<uint8_t*>(b.get()) + off;
        return std::vector<void*>{base, base + per, base + 2 * per};
      };
      Weight2dCopies gw{fmt,
                        n,
                        k,
                        const_ptrs(dev(grd, shift, data)),
                        const_ptrs(dev(grs, 0, scale)),
                        dev(gcd, shift, data),
                        dev(gcs, 0, scale)};
      ASSERT_TRUE(ops::weight_2d_columnwise(*gpu, gw).is_ok());
      std::vector<uint8_t> got = from_gpu(*gpu, gcd.get(), gcd.size());
      EXPECT_EQ(std::vector<uint8_t>(got.begin() + shift, got.end()), cd);
      EXPECT_EQ(from_gpu(*gpu, gcs.get(), gcs.size()), cs);
    }
}

// Rows quantized apart on the GPU (the lowp gather's partial cast) give the CPU's whole-pack bytes.
TEST(CudaShardOps, GroupedParamRowRangesOnTheGpuEqualTheCpuWholePack) {
  SKIP_WITHOUT_GPU();
  struct C {
    const char* name;
    QuantRecipe recipe;
    PrimaryWeight primary;
  };
  const C cases[] = {{"mxfp8", {Recipe::kMxfp8, false, 1}, PrimaryWeight::kLowPrecision},
                     {"mxfp8_2d", {Recipe::kMxfp8, true, 1}, PrimaryWeight::kLowPrecision},
                     {"nvfp4", {Recipe::kNvfp4, false, 1}, PrimaryWeight::kLowPrecision},
                     {"nvfp4 high", {Recipe::kNvfp4, false, 1}, PrimaryWeight::kHighPrecision}};
  constexpr int64_t e = 3, n = 64, k = 64;
  std::mt19937 rng(33);
  for (const C& c : cases)
    for (Layout layout : {Layout::kSingle, Layout::kDiscrete}) {
      SCOPED_TRACE(std::string(c.name) + (layout == Layout::kSingle ? " single" : " discrete"));
      Tensor init = Tensor::empty(cpu_backend(), DType::kF32, {e, n, k});
      const std::vector<float> iv = random_values(rng, e * n, k);
      std::memcpy(init.data(), iv.data(), iv.size() * 4);
      const std::vector<uint16_t> w = bf16_of(random_values(rng, e * n, k));
      GroupedParam cpu_param(cpu_backend(), c.recipe, c.primary, layout, init);
      GroupedParam gpu_param(*gpu, c.recipe, c.primary, layout, init);
      std::vector<void*> hv;
      for (int64_t x = 0; x < e; ++x) hv.push_back(const_cast<uint16_t*>(w.data()) + x * n * k);
      cpu_param.write_primary_from_bf16(
          GroupedStorage::view(cpu_backend(), Layout::kDiscrete, hv, n * k * 2));

      DeviceBuffer rows = to_gpu(*gpu, w);
      const uint16_t* wr = static_cast<const uint16_t*>(rows.get());
      const int64_t unit = gpu_param.shard_unit_rows();
      // One cut inside each expert (unit <= 32 < n = 64), increasing.
      const std::vector<int64_t> cuts = {0, unit, n + unit, 2 * n + unit, e * n};
      DeviceBuffer amax(*gpu, e * 4);
      gpu->fill_zero(amax.get(), amax.size());
      float* am = static_cast<float*>(amax.get());
      if (gpu_param.needs_global_amax()) {  // max over the pieces, as the all-reduce would
        std::vector<float> combined(e, 0.0f);
        DeviceBuffer local(*gpu, e * 4);
        for (size_t i = 0; i + 1 < cuts.size(); ++i) {
          gpu->fill_zero(local.get(), local.size());
          gpu_param.rows_amax(wr + cuts[i] * k, cuts[i], cuts[i + 1],
                              static_cast<float*>(local.get()));
          const std::vector<uint8_t> b = from_gpu(*gpu, local.get(), local.size());
          for (int64_t x = 0; x < e; ++x) {
            float v;
            std::memcpy(&v, b.data() + 4 * x, 4);
            combined[x] = std::max(combined[x], v);
          }
        }
        gpu->copy(am, combined.data(), e * 4, Backend::CopyKind::kHostToDevice);
      }
      std::vector<DeviceBuffer> images;
      std::vector<void*> ptrs;
      for (const PackedComponent& pc : gpu_param.packed_components()) {
        images.emplace_back(*gpu, e * n * k * pc.bytes_num / pc.bytes_den);
        ptrs.push_back(images.back().get());
      }
      for (size_t i = 0; i + 1 < cuts.size(); ++i)
        gpu_param.quantize_rows(wr + cuts[i] * k, cuts[i], cuts[i + 1], am, ptrs);
      gpu_param.write_primary_from_packed(const_ptrs(ptrs), am);
      cpu_param.prepare_compute();
      gpu_param.prepare_compute();
      const auto a = cpu_param.weight_components(), b = gpu_param.weight_components();
      ASSERT_EQ(a.size(), b.size());
      for (size_t j = 0; j < a.size(); ++j)
        EXPECT_TRUE(a[j].storage->download() == b[j].storage->download()) << a[j].name;
    }
}

}  // namespace
}  // namespace packmoe
