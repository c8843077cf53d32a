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
//
// 8-bit pages (pagedjax.attention.kv_quant; a second handler, PagedjaxRaggedPagedAttention8):
// int8 with one float scale per (block, head, slot), or fp8 (E4M3FN / E5M2) bytes with one
// scale per (layer, head). Each page a unit walks is converted to fp32 once into the unit's
// scratch (a 256-entry table per fp8 format, so no hardware fp8 is needed) and the fp32 loop
// above runs on it unchanged; only the rows a query reads are ever used, so poisoned slots
// (NaN scales, NaN fp8 bytes) never reach the output.
//
// Draft-tree masks (pallas_kernels.reference.tree_visible): an optional uint32 operand, one
// word per query token, empty ([0]) for none. Bit d of a row's word lets it see the key d
// slots back; keys 32 or more back are always visible. Only the <= 32 keys nearest a query
// can be masked, so a row pays one extra pass over at most 32 scores of the (at most two)
// pages they sit in, and none at all when its word is all ones (prefill / decode rows) or
// when no mask is given: the unmasked loop is unchanged.
//
// Where the compiler targets AVX-512 and the head dimension is 64, 80, 96, 128 or 256, a
// row's work on one page runs in registers (the `Avx512` helpers): the scaled query stays
// in head_dim / 16 vector registers while the page's scores are taken (one tree
// reduction per key instead of a chain of 16 dependent scalar adds), the page's
// probabilities come from one vector exp per 16 keys, and the row's accumulator is
// loaded and stored once per page instead of once per key. Measured on the engine's
// decode steps (SmolLM2-135M, 64 rows, 9 / 3 heads of 64) this loop was ~23 % of a step,
// most of it in those adds and the accumulator's loads and stores. Other head dimensions
// and other compilers take the portable loop, which gives the same results up to fp32
// rounding. (The AVX-512 loop needs `_mm512_reduce_add_ps`: GCC >= 7 or clang.)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "../native_pool.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kQueryTile = 16;  // queries of one sequence per work unit
constexpr int64_t kPrefetchBytes = 16 * 1024;  // of the next page's K (and of its V)

// How the pages are stored (the 8-bit handler's `mode` attribute).
enum PageMode : int32_t { kF32 = 0, kInt8 = 1, kE4M3 = 2, kE5M2 = 3 };

// fp32 value of every fp8 byte. E4M3FN: bias 7, no infinities, S.1111.111 is NaN.
// E5M2: bias 15, IEEE-like (exponent 31: inf or NaN).
struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int b = 0; b < 256; ++b) {
      const float sign = (b & 0x80) ? -1.0f : 1.0f;
      int e = (b >> 3) & 0xF, m = b & 7;
      if (e == 15 && m == 7) {
        e4m3[b] = std::numeric_limits<float>::quiet_NaN();
      } else {
        e4m3[b] = sign * (e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7));
      }
      e = (b >> 2) & 0x1F;
      m = b & 3;
      if (e == 31) {
        e5m2[b] = m == 0 ? sign * std::numeric_limits<float>::infinity()
                         : std::numeric_limits<float>::quiet_NaN();
      } else {
        e5m2[b] = sign * (e == 0 ? std::ldexp(float(m), -16) : std::ldexp(1.0f + m / 4.0f, e - 15));
      }
    }
  }
};

const Fp8Tables& Tables() {
  static const Fp8Tables tables;
  return tables;
}

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
  // 8-bit pages (mode != kF32; k and v are then null): the selected layer's bytes
  // [NB, Hkv, bs, D] and scales, [NB, Hkv, bs] (int8) or [Hkv] (fp8).
  const uint8_t* k8 = nullptr;
  const uint8_t* v8 = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int32_t mode = kF32;
  const uint32_t* tree = nullptr;  // [T] draft-tree words, or null: causal
};

constexpr int64_t kTreeBits = 32;  // keys a tree word covers (pallas_kernels.reference)
constexpr uint32_t kAllBits = 0xFFFFFFFFu;

struct Unit {
  int32_t seq, kv_head, first_query, num_queries;
};

// fp32 copy of one 8-bit page [bs, d] of (block, head) into out.
void DequantizePage(const Problem& p, const uint8_t* pages, const float* scales, int64_t block,
                    int64_t head, float* out) {
  const int64_t bs = p.bs, d = p.d;
  const uint8_t* src = pages + (block * p.hkv + head) * bs * d;
  if (p.mode == kInt8) {
    const float* sc = scales + (block * p.hkv + head) * bs;
    for (int64_t j = 0; j < bs; ++j) {
      const float scale = sc[j];
      const int8_t* row = reinterpret_cast<const int8_t*>(src + j * d);
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) out[j * d + x] = static_cast<float>(row[x]) * scale;
    }
    return;
  }
  const float* table = p.mode == kE4M3 ? Tables().e4m3 : Tables().e5m2;
  const float scale = scales[head];
  for (int64_t i = 0; i < bs * d; ++i) out[i] = table[src[i]] * scale;
}

// A row's scores on one page, s[j] for j in [j0, j1), and its accumulator update from the
// page's probabilities (the `Avx512` helpers below), or null for the portable loop.
using ScoresFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
using AccumulateFn = void (*)(float*, float, const float*, const float*, int64_t, int64_t);

#if defined(__AVX512F__)
// exp of 16 floats (Cephes' single-precision polynomial, ~1 ulp on the range used here:
// scores minus their running max, <= 0). Inputs below -87.3 give 0 (exp(-inf) = 0, as a
// masked key needs); a NaN input stays NaN (max / min return their second operand then).
inline __m512 Exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f), hi = _mm512_set1_ps(88.72283f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(hi, _mm512_max_ps(lo, x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(y, n));
}

// s[j] = qr . kp[j] for j in [j0, j1): NV vectors of 16 per row (d = 16 NV).
template <int NV>
void Avx512Scores(const float* qr, const float* kp, int64_t j0, int64_t j1, float* s) {
  __m512 q[NV];
  for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qr + 16 * v);
  for (int64_t j = j0; j < j1; ++j) {
    const float* kr = kp + j * 16 * NV;
    __m512 a = _mm512_mul_ps(q[0], _mm512_loadu_ps(kr));
    for (int v = 1; v < NV; ++v) a = _mm512_fmadd_ps(q[v], _mm512_loadu_ps(kr + 16 * v), a);
    s[j] = _mm512_reduce_add_ps(a);
  }
}

// p[j] = exp(s[j] - m) for j in [j0, j1), in place; returns their sum.
inline float Avx512Probs(float* s, int64_t j0, int64_t j1, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; j += 16) {
    const __mmask16 k = j1 - j >= 16 ? static_cast<__mmask16>(0xFFFF)
                                     : static_cast<__mmask16>((1u << (j1 - j)) - 1u);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv);
    const __m512 p = _mm512_maskz_mov_ps(k, Exp16(x));
    _mm512_mask_storeu_ps(s + j, k, p);
    sum = _mm512_add_ps(sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}

// ar = ar * alpha + sum_j p[j] vp[j] for j in [j0, j1); ar loaded and stored once.
template <int NV>
void Avx512Accumulate(float* ar, float alpha, const float* p, const float* vp, int64_t j0,
                      int64_t j1) {
  __m512 a[NV];
  const __m512 al = _mm512_set1_ps(alpha);
  for (int v = 0; v < NV; ++v) a[v] = _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * v), al);
  for (int64_t j = j0; j < j1; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const float* vr = vp + j * 16 * NV;
    for (int v = 0; v < NV; ++v) a[v] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16 * v), a[v]);
  }
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(ar + 16 * v, a[v]);
}

// The register-resident helpers for head dimension d, or nulls (the portable loop).
void Avx512For(int64_t d, ScoresFn& scores, AccumulateFn& accumulate) {
  switch (d) {
    case 64: scores = Avx512Scores<4>; accumulate = Avx512Accumulate<4>; return;
    case 80: scores = Avx512Scores<5>; accumulate = Avx512Accumulate<5>; return;
    case 96: scores = Avx512Scores<6>; accumulate = Avx512Accumulate<6>; return;
    case 128: scores = Avx512Scores<8>; accumulate = Avx512Accumulate<8>; return;
    case 256: scores = Avx512Scores<16>; accumulate = Avx512Accumulate<16>; return;
    default: scores = nullptr; accumulate = nullptr;
  }
}
#endif

// Runs one unit; returns false on an out-of-range page id (the caller reports it).
bool RunUnit(const Problem& p, const Unit& u, std::vector<float>& scratch) {
  const int64_t d = p.d, g_count = p.group, bs = p.bs;
  const int64_t rows = static_cast<int64_t>(u.num_queries) * g_count;
  const int64_t page_floats = p.mode == kF32 ? 0 : 2 * bs * d;  // dequantized K and V page
  scratch.resize(rows * (2 * d + 2) + bs + page_floats);
  float* qv = scratch.data();      // [rows, d], pre-scaled queries
  float* acc = qv + rows * d;      // [rows, d]
  float* m = acc + rows * d;       // [rows]
  float* l = m + rows;             // [rows]
  float* s = l + rows;             // [bs] scores of one page
  float* kdq = s + bs;             // [bs, d] (8-bit pages only)
  float* vdq = kdq + bs * d;       // [bs, d]
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

  // The register-resident helpers for this head dimension (file comment), or nulls.
  ScoresFn scores_fn = nullptr;
  AccumulateFn accumulate_fn = nullptr;
#if defined(__AVX512F__)
  Avx512For(d, scores_fn, accumulate_fn);
#endif

  // Query i sits at position kv_len - q_len + first_query + i and attends keys
  // [lo(pos), pos] with lo = pos - window + 1 under a sliding window, else 0.
  const int64_t pos0 = static_cast<int64_t>(kv_len) - q_len + u.first_query;
  const int64_t pos_last = pos0 + u.num_queries - 1;
  const int64_t lo_first = p.window > 0 ? std::max<int64_t>(0, pos0 - p.window + 1) : 0;
  for (int64_t page = lo_first / bs; page <= pos_last / bs; ++page) {
    const int64_t block = p.tables[u.seq * p.max_blocks + page];
    if (block < 0 || block >= p.num_blocks) return false;
    const float* kp;
    const float* vp;
    if (p.mode == kF32) {
      kp = p.k + (block * p.hkv + u.kv_head) * bs * d;
      vp = p.v + (block * p.hkv + u.kv_head) * bs * d;
    } else {
      DequantizePage(p, p.k8, p.k_scale, block, u.kv_head, kdq);
      DequantizePage(p, p.v8, p.v_scale, block, u.kv_head, vdq);
      kp = kdq;
      vp = vdq;
    }
    // The next page's K and V are fetched while this one is worked on: pages of a
    // sequence sit at scattered places in the pool, so the hardware prefetcher cannot
    // guess them, and a decode row does too little work per page to hide the wait.
    // At most kPrefetchBytes of each: a larger page (long blocks, wide heads) would push
    // the current one out of L1 before a prefill unit has used it.
#if defined(__GNUC__)
    if (p.mode == kF32 && page < pos_last / bs) {
      const int64_t next = p.tables[u.seq * p.max_blocks + page + 1];
      if (next >= 0 && next < p.num_blocks) {
        const char* kn = reinterpret_cast<const char*>(p.k + (next * p.hkv + u.kv_head) * bs * d);
        const char* vn = reinterpret_cast<const char*>(p.v + (next * p.hkv + u.kv_head) * bs * d);
        const int64_t bytes = std::min<int64_t>(bs * d * 4, kPrefetchBytes);
        for (int64_t b = 0; b < bytes; b += 64) {
          __builtin_prefetch(kn + b);
          __builtin_prefetch(vn + b);
        }
      }
    }
#endif
    const int64_t key0 = page * bs;
    for (int64_t i = 0; i < u.num_queries; ++i) {
      const int64_t pos = pos0 + i;
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
      const int64_t j0 = std::max<int64_t>(0, lo - key0);
      const int64_t j1 = std::min<int64_t>(bs, pos - key0 + 1);  // exclusive
      if (j0 >= j1) continue;
      const uint32_t word =
          p.tree != nullptr ? p.tree[p.cu[u.seq] + u.first_query + i] : kAllBits;
      for (int64_t g = 0; g < g_count; ++g) {
        const int64_t r = i * g_count + g;
        const float* qr = qv + r * d;
        float page_max = -std::numeric_limits<float>::infinity();
        if (scores_fn != nullptr) scores_fn(qr, kp, j0, j1, s);
        for (int64_t j = j0; j < j1; ++j) {
          float dot = 0.0f;
          if (scores_fn != nullptr) {
            dot = s[j];
          } else {
            const float* kr = kp + j * d;
#pragma omp simd reduction(+ : dot)
            for (int64_t x = 0; x < d; ++x) dot += qr[x] * kr[x];
          }
          if (p.soft_cap > 0.0f) dot = p.soft_cap * std::tanh(dot / p.soft_cap);
          s[j] = dot;
          page_max = std::max(page_max, dot);
        }
        if (word != kAllBits) {
          // Keys d = pos - key < 32 back whose bit is clear are hidden: -inf scores
          // (exp gives 0) and the page's max taken again over the visible ones.
          bool hidden = false;
          for (int64_t j = std::max(j0, pos - key0 - (kTreeBits - 1)); j < j1; ++j) {
            if (!((word >> (pos - key0 - j)) & 1u)) {
              s[j] = -std::numeric_limits<float>::infinity();
              hidden = true;
            }
          }
          if (hidden) {
            page_max = -std::numeric_limits<float>::infinity();
            for (int64_t j = j0; j < j1; ++j) page_max = std::max(page_max, s[j]);
            if (page_max == -std::numeric_limits<float>::infinity()) continue;  // none seen
          }
        }
        const float m_new = std::max(m[r], page_max);
        const float alpha = std::exp(m[r] - m_new);  // 0 while m is -inf
        float* ar = acc + r * d;
        float sum = 0.0f;
        if (accumulate_fn != nullptr) {
#if defined(__AVX512F__)
          sum = Avx512Probs(s, j0, j1, m_new);
          accumulate_fn(ar, alpha, s, vp, j0, j1);
#endif
        } else {
          for (int64_t x = 0; x < d; ++x) ar[x] *= alpha;
          for (int64_t j = j0; j < j1; ++j) {
            const float pj = std::exp(s[j] - m_new);
            sum += pj;
            const float* vr = vp + j * d;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) ar[x] += pj * vr[x];
          }
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
  pagedjax_native::PoolJoin join;  // the pool tasks that may still claim units
};

void Drain(Shared& sh) {
  std::vector<float> scratch;
  const int64_t n = static_cast<int64_t>(sh.units.size());
  for (int64_t i = sh.next.fetch_add(1); i < n; i = sh.next.fetch_add(1)) {
    if (!RunUnit(sh.problem, sh.units[i], scratch)) sh.bad_page.store(true);
  }
}

// Shapes checked, the layer offset applied: the part both handlers share.
ffi::Error Launch(ffi::ThreadPool& pool, Problem p, int64_t num_tokens, int64_t hq,
                  int64_t num_seqs);

ffi::Error CheckShapes(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                       ffi::Span<const int64_t> td, int32_t layer) {
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument(
        "expected q [T,Hq,D], pool [L,NB,Hkv,bs,D], tables [S,M]");
  }
  if (kd[4] != qd[2] || kd[2] <= 0 || qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("head_dim mismatch or Hq not a multiple of Hkv");
  }
  if (layer < 0 || layer >= kd[0]) {
    return ffi::Error::InvalidArgument("layer index " + std::to_string(layer) +
                                       " outside [0, " + std::to_string(kd[0]) + ")");
  }
  return ffi::Error::Success();
}

// The tree words: none for an empty operand, else one per query token.
ffi::Error SetTree(Problem& p, ffi::Buffer<ffi::U32>& tree_mask, int64_t num_tokens) {
  const int64_t n = static_cast<int64_t>(tree_mask.element_count());
  if (n == 0) return ffi::Error::Success();
  if (tree_mask.dimensions().size() != 1 || n != num_tokens) {
    return ffi::Error::InvalidArgument("tree_mask must be uint32[T] (one word per query) or "
                                       "empty, got " + std::to_string(n) + " words for T = " +
                                       std::to_string(num_tokens));
  }
  p.tree = tree_mask.typed_data();
  return ffi::Error::Success();
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                                ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                                ffi::Buffer<ffi::S32> layer_index,
                                ffi::Buffer<ffi::S32> window_size,
                                ffi::Buffer<ffi::U32> tree_mask,
                                ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = block_tables.dimensions();
  const int32_t layer = layer_index.typed_data()[0];
  if (auto err = CheckShapes(qd, kd, td, layer); err.failure()) return err;
  const int64_t num_blocks = kd[1], hkv = kd[2], bs = kd[3], d = kd[4];
  const int64_t layer_stride = num_blocks * hkv * bs * d;
  Problem p{q.typed_data(), k_pages.typed_data() + layer * layer_stride,
            v_pages.typed_data() + layer * layer_stride,
            block_tables.typed_data(), kv_lens.typed_data(), cu_q_lens.typed_data(),
            out->typed_data(), num_blocks, hkv, qd[1] / hkv, bs, d, td[1],
            sm_scale, std::max<int32_t>(window_size.typed_data()[0], 0), soft_cap};
  if (auto err = SetTree(p, tree_mask, qd[0]); err.failure()) return err;
  return Launch(pool, p, qd[0], qd[1], td[0]);
}

// 8-bit pages: k_pages / v_pages are int8 or fp8 bytes [L, NB, Hkv, bs, D]; k_scale /
// v_scale are float32 [L, NB, Hkv, bs, 1] (mode kInt8) or [L, Hkv] (fp8 modes).
ffi::Error RaggedPagedAttention8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                 ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                                 ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                 ffi::Buffer<ffi::S32> block_tables,
                                 ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu_q_lens,
                                 ffi::Buffer<ffi::S32> layer_index,
                                 ffi::Buffer<ffi::S32> window_size,
                                 ffi::Buffer<ffi::U32> tree_mask,
                                 ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                                 int32_t mode) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto td = block_tables.dimensions();
  const int32_t layer = layer_index.typed_data()[0];
  if (auto err = CheckShapes(qd, kd, td, layer); err.failure()) return err;
  if (mode != kInt8 && mode != kE4M3 && mode != kE5M2) {
    return ffi::Error::InvalidArgument("mode must be 1 (int8), 2 (fp8 e4m3) or 3 (fp8 e5m2)");
  }
  if (k_pages.size_bytes() != k_pages.element_count() ||
      v_pages.size_bytes() != k_pages.size_bytes()) {
    return ffi::Error::InvalidArgument("8-bit pages expected (one byte per element)");
  }
  const int64_t num_blocks = kd[1], hkv = kd[2], bs = kd[3], d = kd[4];
  const auto sd = k_scale.dimensions();
  const bool per_token = mode == kInt8;
  const bool scale_ok = per_token ? (sd.size() == 5 && sd[0] == kd[0] && sd[1] == num_blocks &&
                                     sd[2] == hkv && sd[3] == bs && sd[4] == 1)
                                  : (sd.size() == 2 && sd[0] == kd[0] && sd[1] == hkv);
  if (!scale_ok || v_scale.element_count() != k_scale.element_count()) {
    return ffi::Error::InvalidArgument(
        "scales must be [L, NB, Hkv, bs, 1] (int8) or [L, Hkv] (fp8)");
  }
  const int64_t layer_stride = num_blocks * hkv * bs * d;
  const int64_t scale_stride = per_token ? num_blocks * hkv * bs : hkv;
  Problem p{q.typed_data(), nullptr, nullptr,
            block_tables.typed_data(), kv_lens.typed_data(), cu_q_lens.typed_data(),
            out->typed_data(), num_blocks, hkv, qd[1] / hkv, bs, d, td[1],
            sm_scale, std::max<int32_t>(window_size.typed_data()[0], 0), soft_cap};
  p.k8 = static_cast<const uint8_t*>(k_pages.untyped_data()) + layer * layer_stride;
  p.v8 = static_cast<const uint8_t*>(v_pages.untyped_data()) + layer * layer_stride;
  p.k_scale = k_scale.typed_data() + layer * scale_stride;
  p.v_scale = v_scale.typed_data() + layer * scale_stride;
  p.mode = mode;
  if (auto err = SetTree(p, tree_mask, qd[0]); err.failure()) return err;
  return Launch(pool, p, qd[0], qd[1], td[0]);
}

ffi::Error Launch(ffi::ThreadPool& pool, Problem p, int64_t num_tokens, int64_t hq,
                  int64_t num_seqs) {
  const int64_t hkv = p.hkv, bs = p.bs, d = p.d, max_blocks = p.max_blocks;
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
  pagedjax_native::RunWithHelpers(pool, sh, helpers, Drain);
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
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxRaggedPagedAttention8, RaggedPagedAttention8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("mode"));

// 1 where this build runs the AVX-512 loop for head dims 64, 80, 96, 128 and 256, else 0
// (native_cpu.vector_path(); the tests ask, so a build without it cannot pass unnoticed).
extern "C" int PagedjaxAttentionVectorPath() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
