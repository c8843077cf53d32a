// Ragged paged attention for the CPU, as an XLA FFI custom call (pagedjax.attention.native_cpu).
//
// Same contract as pagedjax/attention/reference.py (the oracle it is tested against), fp32
// only. The XLA version must gather each chunk of pages into a temporary before its dots;
// here every page is read once, straight from the pool, while it sits in L1: per work unit
// (sequence, KV head, tile of up to kQueryTile queries) the pages are walked in order and
// each query of the tile folds the page's keys into its online softmax (flash-attention
// style, one rescale per page). Units are shared between the calling thread and XLA's
// intra-op thread pool through an atomic counter.
//
// The pool is stacked over layers, [L, NB, Hkv, bs, D] per K and V, and the layer index is an
// operand: the model's layer loop hands this call the whole carried pool (no per-layer slice,
// which XLA would materialize as a copy every layer of every step) and the kernel offsets
// into it. The sliding window is an operand too (per-layer windows under the loop; <= 0: none).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryTile = 16;  // queries of one sequence per work unit

struct Problem {
  const float* q;            // [T, Hq, D]
  const float* k;            // [NB, Hkv, bs, D]: the selected layer of the stacked pool
  const float* v;            // [NB, Hkv, bs, D]
  const int32_t* tables;     // [S, M]
  const int32_t* kv_lens;    // [S]
  const int32_t* cu;         // [S + 1]
  float* out;                // [T, Hq, D]
  int64_t num_blocks, hkv, group, bs, d, max_blocks;
  float sm_scale;
  int32_t window;            // 0: none
  float soft_cap;            // 0: none
};

struct Unit {
  int32_t seq, kv_head, first_query, num_queries;
};

// Runs one unit; returns false on an out-of-range page id (the caller reports it).
bool RunUnit(const Problem& p, const Unit& u, std::vector<float>& scratch) {
  const int64_t d = p.d, g_count = p.group, bs = p.bs;
  const int64_t rows = static_cast<int64_t>(u.num_queries) * g_count;
  scratch.resize(rows * (2 * d + 2) + bs);
  float* qv = scratch.data();      // [rows, d], pre-scaled queries
  float* acc = qv + rows * d;      // [rows, d]
  float* m = acc + rows * d;       // [rows]
  float* l = m + rows;             // [rows]
  float* s = l + rows;             // [bs] scores of one page
  const int32_t kv_len = p.kv_lens[u.seq];
  const int32_t q_len = p.cu[u.seq + 1] - p.cu[u.seq];
  const int64_t hq = p.hkv * g_count;
  for (int64_t i = 0; i < u.num_queries; ++i) {
    const int64_t t = p.cu[u.seq] + u.first_query + i;
    for (int64_t g = 0; g < g_count; ++g) {
      const float* src = p.q + (t * hq + u.kv_head * g_count + g) * d;
      float* dst = qv + (i * g_count + g) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * p.sm_scale;
    }
  }
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);

  // Query i sits at position kv_len - q_len + first_query + i and attends keys
  // [lo(pos), pos] with lo = pos - window + 1 under a sliding window, else 0.
  const int64_t pos0 = static_cast<int64_t>(kv_len) - q_len + u.first_query;
  const int64_t pos_last = pos0 + u.num_queries - 1;
  const int64_t lo_first = p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
  for (int64_t page = lo_first / bs; page <= pos_last / bs; ++page) {
    const int64_t block = p.tables[u.seq * p.max_blocks + page];
    if (block < 0 || block >= p.num_blocks) return false;
    const float* kp = p.k + (block * p.hkv + u.kv_head) * bs * d;
    const float* vp = p.v + (block * p.hkv + u.kv_head) * bs * d;
    const int64_t key0 = page * bs;
    for (int64_t i = 0; i < u.num_queries; ++i) {
      const int64_t pos = pos0 + i;
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
      const int64_t j0 = std::max<int64_t>(0, lo - key0);
      const int64_t j1 = std::min<int64_t>(bs, pos - key0 + 1);  // exclusive
      if (j0 >= j1) continue;
      for (int64_t g = 0; g < g_count; ++g) {
        const int64_t r = i * g_count + g;
        const float* qr = qv + r * d;
        float page_max = -std::numeric_limits<float>::infinity();
        for (int64_t j = j0; j < j1; ++j) {
          const float* kr = kp + j * d;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < d; ++x) dot += qr[x] * kr[x];
          if (p.soft_cap > 0.0f) dot = p.soft_cap * std::tanh(dot / p.soft_cap);
          s[j] = dot;
          page_max = std::max(page_max, dot);
        }
        const float m_new = std::max(m[r], page_max);
        const float alpha = std::exp(m[r] - m_new);  // 0 while m is -inf
        float* ar = acc + r * d;
        float sum = 0.0f;
        for (int64_t x = 0; x < d; ++x) ar[x] *= alpha;
        for (int64_t j = j0; j < j1; ++j) {
          const float pj = std::exp(s[j] - m_new);
          sum += pj;
          const float* vr = vp + j * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) ar[x] += pj * vr[x];
        }
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
      }
    }
  }
  for (int64_t i = 0; i < u.num_queries; ++i) {
    const int64_t t = p.cu[u.seq] + u.first_query + i;
    for (int64_t g = 0; g < g_count; ++g) {
      const int64_t r = i * g_count + g;
      float* dst = p.out + (t * hq + u.kv_head * g_count + g) * d;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t x = 0; x < d; ++x) dst[x] = acc[r * d + x] * inv;
    }
  }
  return true;
}

// Work shared by the caller and pool tasks. Owned by shared_ptr: a task that starts after
// the caller returned finds no work left and touches nothing else.
struct Shared {
  Problem problem;
  std::vector<Unit> units;
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_page{false};
  std::mutex mu;
  std::condition_variable cv;
  int64_t active = 0;  // tasks that may still claim units; guarded by mu
};

void Drain(Shared& sh) {
  std::vector<float> scratch;
  const int64_t n = static_cast<int64_t>(sh.units.size());
  for (int64_t i = sh.next.fetch_add(1); i < n; i = sh.next.fetch_add(1)) {
    if (!RunUnit(sh.problem, sh.units[i], scratch)) sh.bad_page.store(true);
  }
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                                ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                                ffi::Buffer<ffi::S32> layer_index,
                                ffi::Buffer<ffi::S32> window_size,
                                ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument(
        "expected q [T,Hq,D], pool [L,NB,Hkv,bs,D], tables [S,M]");
  }
  const int64_t num_tokens = qd[0], hq = qd[1], d = qd[2];
  const int64_t num_layers = kd[0], num_blocks = kd[1];
  const int64_t hkv = kd[2], bs = kd[3], num_seqs = td[0], max_blocks = td[1];
  if (kd[4] != d || hkv <= 0 || hq % hkv != 0) {
    return ffi::Error::InvalidArgument("head_dim mismatch or Hq not a multiple of Hkv");
  }
  const int64_t layer = layer_index.typed_data()[0];
  if (layer < 0 || layer >= num_layers) {
    return ffi::Error::InvalidArgument("layer index " + std::to_string(layer) +
                                       " outside [0, " + std::to_string(num_layers) + ")");
  }
  const int64_t layer_stride = num_blocks * hkv * bs * d;
  Problem p{q.typed_data(), k_pages.typed_data() + layer * layer_stride,
            v_pages.typed_data() + layer * layer_stride,
            block_tables.typed_data(), kv_lens.typed_data(), cu_q_lens.typed_data(),
            out->typed_data(), num_blocks, hkv, hq / hkv, bs, d, max_blocks,
            sm_scale, std::max<int32_t>(window_size.typed_data()[0], 0), soft_cap};
  std::memset(p.out, 0, sizeof(float) * num_tokens * hq * d);  // padding rows stay 0

  auto sh = std::make_shared<Shared>();
  sh->problem = p;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = p.cu[s + 1] - p.cu[s];
    const int32_t kv_len = p.kv_lens[s];
    if (q_len <= 0) continue;
    if (p.cu[s] < 0 || p.cu[s + 1] > num_tokens || kv_len < q_len ||
        kv_len > max_blocks * bs) {
      return ffi::Error::InvalidArgument(
          "sequence " + std::to_string(s) + ": need 0 <= cu_q_lens <= T and q_len <= kv_len <= "
          "max_blocks * block_size (q_len " + std::to_string(q_len) + ", kv_len " +
          std::to_string(kv_len) + ")");
    }
    for (int32_t h = 0; h < hkv; ++h) {
      for (int32_t f = 0; f < q_len; f += kQueryTile) {
        sh->units.push_back({s, h, f, std::min<int32_t>(kQueryTile, q_len - f)});
      }
    }
  }
  // Longest units first (most pages), so the last units to finish are short.
  std::stable_sort(sh->units.begin(), sh->units.end(), [&](const Unit& a, const Unit& b) {
    return p.kv_lens[a.seq] - (p.cu[a.seq + 1] - p.cu[a.seq]) + a.first_query + a.num_queries >
           p.kv_lens[b.seq] - (p.cu[b.seq + 1] - p.cu[b.seq]) + b.first_query + b.num_queries;
  });

  const int64_t helpers =
      std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0),
                        static_cast<int64_t>(sh->units.size()) / 8);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([sh] {
      {
        std::lock_guard<std::mutex> lock(sh->mu);
        ++sh->active;
      }
      Drain(*sh);
      std::lock_guard<std::mutex> lock(sh->mu);
      if (--sh->active == 0) sh->cv.notify_all();
    });
  }
  Drain(*sh);
  // Every unit is claimed; wait only for tasks that started (a queued one claims nothing).
  {
    std::unique_lock<std::mutex> lock(sh->mu);
    sh->cv.wait(lock, [&] { return sh->active == 0; });
  }
  if (sh->bad_page.load()) {
    return ffi::Error::InvalidArgument("a block table entry is outside [0, num_blocks)");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxRaggedPagedAttention, RaggedPagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));
