// delta[T, N] = scale[s] * (x[t] @ a[layer, s] @ b[layer, s]) with s = slot[t] clipped to
// [0, S), and exact zeros for rows of slot 0 (no adapter): the LoRA term of a batch whose
// rows use different adapters, in fp32 (native_lora.py says why it exists).
//
// Rows are grouped by slot with a counting sort (stable: a slot's rows keep their order),
// so each adapter's A and B are read once per group of up to kRows rows, as the grouped
// (Punica / S-LoRA SGMV) kernels do; nothing is computed for other slots, where XLA's dense
// form multiplies every row by every slot. Work units are such groups, shared by the
// calling thread and XLA's intra-op pool through an atomic counter when there is enough
// work to pay for waking the pool. A row's sums run in a fixed order (k ascending, then
// r ascending) whatever the batch, so a row's delta is the same in every batch.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "../native_pool.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 8;            // rows of one slot per unit: each A row is reused 8 times
constexpr int64_t kMaxRank = 512;       // t's stack buffer; the caller checks rank <= this
constexpr int64_t kPoolWork = 1 << 20;  // multiply-adds below which the pool is not woken

struct Problem {
  const float* x;      // [T, K]
  const float* a;      // [S, K, R]: the layer's slots
  const float* b;      // [S, R, N]
  const float* scale;  // [S]
  float* y;            // [T, N]
  int64_t k, r, n;
  std::vector<int64_t> order;  // rows sorted by slot (stable)
  std::vector<int64_t> unit_start, unit_end, unit_slot;  // unit i: order[start:end], one slot
};

// One unit: rows order[lo:hi] (all of adapter `slot`, hi - lo <= kRows).
void RunUnit(const Problem& p, int64_t lo, int64_t hi, int64_t slot) {
  const int64_t rows = hi - lo, k = p.k, r = p.r, n = p.n;
  float t[kRows][kMaxRank];
  for (int64_t i = 0; i < rows; ++i) std::memset(t[i], 0, sizeof(float) * r);
  const float* a = p.a + slot * k * r;
  const float* b = p.b + slot * r * n;
  // shrink: t[i, :] = x[row_i, :] @ A, one A row (r floats) at a time for every row.
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* ar = a + kk * r;
    for (int64_t i = 0; i < rows; ++i) {
      const float xv = p.x[p.order[lo + i] * k + kk];
      float* ti = t[i];
#pragma omp simd
      for (int64_t j = 0; j < r; ++j) ti[j] += xv * ar[j];
    }
  }
  // expand: y[row_i, :] = scale * t[i, :] @ B, one B row (n floats) at a time.
  const float s = p.scale[slot];
  for (int64_t i = 0; i < rows; ++i) {
    float* yr = p.y + p.order[lo + i] * n;
    std::memset(yr, 0, sizeof(float) * n);
    for (int64_t j = 0; j < r; ++j) {
      const float tj = t[i][j] * s;
      const float* br = b + j * n;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) yr[c] += tj * br[c];
    }
  }
}

// Owned by shared_ptr: a pool task that starts after the caller returned finds no unit left.
struct Shared {
  Problem problem;
  int64_t units = 0;
  std::atomic<int64_t> next{0};
  pagedjax_native::PoolJoin join;  // the pool tasks that may still claim units
};

void Drain(Shared& sh) {
  const Problem& p = sh.problem;
  for (int64_t i = sh.next.fetch_add(1); i < sh.units; i = sh.next.fetch_add(1)) {
    RunUnit(p, p.unit_start[i], p.unit_end[i], p.unit_slot[i]);
  }
}

ffi::Error LoraDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                     ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                     ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer_index,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto ad = a.dimensions();
  const auto bd = b.dimensions();
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || ad[0] != bd[0] ||
      ad[1] != bd[1] || ad[2] != xd[1] || ad[3] != bd[2] || slots.dimensions().size() != 1 ||
      slots.dimensions()[0] != xd[0] || scale.dimensions().size() != 1 ||
      scale.dimensions()[0] != ad[1] || ad[1] < 1 || ad[3] > kMaxRank) {
    return ffi::Error::InvalidArgument(
        "expected x [T, K], slots [T], a [L, S, K, R], b [L, S, R, N], scale [S], R <= 512");
  }
  const int32_t layer = layer_index.typed_data()[0];
  if (layer < 0 || layer >= ad[0]) {
    return ffi::Error::InvalidArgument("layer index " + std::to_string(layer) +
                                       " outside [0, " + std::to_string(ad[0]) + ")");
  }
  const int64_t t = xd[0], k = xd[1], num_slots = ad[1], r = ad[3], n = bd[3];
  auto sh = std::make_shared<Shared>();
  Problem& p = sh->problem;
  p = Problem{x.typed_data(), a.typed_data() + layer * num_slots * k * r,
              b.typed_data() + layer * num_slots * r * n, scale.typed_data(), y->typed_data(),
              k, r, n, {}, {}, {}, {}};
  // Counting sort of the rows by (clipped) slot; slot 0's rows get zeros and no unit.
  std::vector<int64_t> count(num_slots + 1, 0);
  const int32_t* s = slots.typed_data();
  auto slot_of = [&](int64_t i) {
    return std::min<int64_t>(std::max<int64_t>(s[i], 0), num_slots - 1);
  };
  for (int64_t i = 0; i < t; ++i) ++count[slot_of(i) + 1];
  for (int64_t j = 0; j < num_slots; ++j) count[j + 1] += count[j];
  p.order.resize(t);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < t; ++i) p.order[fill[slot_of(i)]++] = i;
  for (int64_t i = count[0]; i < count[1]; ++i) {
    std::memset(p.y + p.order[i] * n, 0, sizeof(float) * n);
  }
  for (int64_t j = 1; j < num_slots; ++j) {
    for (int64_t lo = count[j]; lo < count[j + 1]; lo += kRows) {
      p.unit_start.push_back(lo);
      p.unit_end.push_back(std::min(lo + kRows, count[j + 1]));
      p.unit_slot.push_back(j);
    }
  }
  sh->units = static_cast<int64_t>(p.unit_slot.size());
  if (sh->units == 0) return ffi::Error::Success();
  const int64_t work = (t - (count[1] - count[0])) * (k + n) * r;
  const int64_t helpers =
      work < kPoolWork ? 0
                       : std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0),
                                           sh->units - 1);
  pagedjax_native::RunWithHelpers(pool, sh, helpers, Drain);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxLoraDelta, LoraDelta,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
