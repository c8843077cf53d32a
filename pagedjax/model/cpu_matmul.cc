// y[T, N] = x[T, K] @ w[layer, K, N], fp32: a matmul that reads one layer of a stacked
// weight where it lies (native_matmul.py says why: under the layer loop XLA would first copy
// the layer's slice out of the stacked array, doubling the bytes a decode step moves).
//
// Work units are column tiles of kCols outputs, shared by the calling thread and XLA's
// intra-op thread pool through an atomic counter. A unit walks K in chunks of kChunk rows
// (a kChunk x kCols tile of w, 32 KiB, stays in L1 while every block of kRows rows of x
// uses it) and keeps a kRows x kCols block of y in vector registers within a chunk. The
// order of the sum over K is fixed (chunk by chunk, row by row) and does not depend on T,
// so a row's result is the same in every batch. Needs N % 16 == 0 (the caller checks).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "../native_pool.h"

namespace ffi = xla::ffi;

namespace {

// 16 floats: one AVX-512 register (two AVX2 ones where that is the widest).
typedef float v16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kCols = 64;  // outputs per unit: 4 vectors
constexpr int64_t kVecs = kCols / 16;
constexpr int64_t kRows = 4;     // rows per register block: 16 accumulators
constexpr int64_t kChunk = 128;  // k per pass over a tile
constexpr int64_t kPrefetch = 16;  // w rows ahead (a sweep of 0, 8, 16 on the 34M model's shapes)

struct Problem {
  const float* x;  // [T, K]
  const float* w;  // [K, N]: the selected layer
  float* y;        // [T, N]
  int64_t t, k, n;
};

inline v16 Load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// y[r0:r0+R, c0:c0+16V] (+)= x[r0:r0+R, k0:k1] @ w[k0:k1, c0:c0+16V]; `first` starts
// from zero instead of the partial sums already in y. The w rows kPrefetch ahead are
// prefetched: a tile's rows lie N floats apart, each in another 4 KiB page, where the
// hardware prefetchers do not follow (measured on a loaded box: 1.2-1.5x at 1-4 rows).
template <int R, int V>
void Block(const Problem& p, int64_t r0, int64_t c0, int64_t k0, int64_t k1, bool first) {
  v16 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j)
      acc[r][j] = first ? v16{} : Load(p.y + (r0 + r) * p.n + c0 + 16 * j);
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + (r0 + r) * p.k;
  const float* wp = p.w + k0 * p.n + c0;
  for (int64_t kk = k0; kk < k1; ++kk, wp += p.n) {
    if (kk + kPrefetch < p.k)
      for (int j = 0; j < V; ++j) __builtin_prefetch(wp + kPrefetch * p.n + 16 * j, 0, 3);
    v16 wv[V];
    for (int j = 0; j < V; ++j) wv[j] = Load(wp + 16 * j);
    for (int r = 0; r < R; ++r) {
      const float s = xr[r][kk];
      for (int j = 0; j < V; ++j) acc[r][j] += s * wv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) Store(p.y + (r0 + r) * p.n + c0 + 16 * j, acc[r][j]);
}

template <int V>
void RunTile(const Problem& p, int64_t c0) {
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    const int64_t k1 = std::min(p.k, k0 + kChunk);
    int64_t r = 0;
    for (; r + kRows <= p.t; r += kRows) Block<kRows, V>(p, r, c0, k0, k1, k0 == 0);
    for (; r < p.t; ++r) Block<1, V>(p, r, c0, k0, k1, k0 == 0);
  }
}

// Unit i covers columns [64 i, min(64 i + 64, N)); the last may be 16, 32 or 48 wide.
void RunUnit(const Problem& p, int64_t c0) {
  switch (std::min<int64_t>(kVecs, (p.n - c0) / 16)) {
    case 4: return RunTile<4>(p, c0);
    case 3: return RunTile<3>(p, c0);
    case 2: return RunTile<2>(p, c0);
    default: return RunTile<1>(p, c0);
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
  for (int64_t i = sh.next.fetch_add(1); i < sh.units; i = sh.next.fetch_add(1)) {
    RunUnit(sh.problem, i * kCols);
  }
}

ffi::Error StackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::S32> layer_index, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] % 16 != 0) {
    return ffi::Error::InvalidArgument("expected x [T, K], w [L, K, N] with N % 16 == 0");
  }
  const int32_t layer = layer_index.typed_data()[0];
  if (layer < 0 || layer >= wd[0]) {
    return ffi::Error::InvalidArgument("layer index " + std::to_string(layer) +
                                       " outside [0, " + std::to_string(wd[0]) + ")");
  }
  auto sh = std::make_shared<Shared>();
  sh->problem = Problem{x.typed_data(), w.typed_data() + layer * wd[1] * wd[2],
                        y->typed_data(), xd[0], xd[1], wd[2]};
  sh->units = (wd[2] + kCols - 1) / kCols;
  if (xd[0] == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0),
                                            sh->units / 2);
  pagedjax_native::RunWithHelpers(pool, sh, helpers, Drain);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxStackedMatmul, StackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
