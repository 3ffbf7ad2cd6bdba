// Decode attention on the KV cache in place: one query token per request against its own cached
// context, read through its slot list, so no padded copy of the contexts is made.
//
// Work is split over (request, KV head, chunk) items: a chunk is up to kChunk positions of the context, and
// each item computes the scores of the query heads that share the KV head (grouped-query attention), a
// softmax with a vectorised exp, and the weighted sum of V rows. A context of one chunk is written
// whole; a longer one's chunks leave their sums unscaled with their maximum and total, which are then
// combined in chunk order (as vLLM's paged attention v2 and flash-decoding do). The chunks let one
// request's long context spread over every thread: by (request, KV head) alone, SmolLM2's 3 KV heads
// split 2:1 over 2 threads. Threads take items longest context first, one at a time (a static split of
// a batch's mixed lengths left one thread idle for a sixth of the call; inside DecodeLayers' team each
// thread takes an equal share of the query heads' positions, share_of_heads), and while an item sums its
// V rows, which are in L2 by then, the thread prefetches the K rows of its next item, so its memory stream
// does not pause. A context's chunks depend on its length alone, so which thread computes an item, and
// what else is in the batch, does not change a result's bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int kMaxGroup = 4;  // query heads scored together against one read of a K or V row
constexpr int64_t kAhead = 8;  // K rows prefetched ahead of the score loop
// Positions a work item covers at most: a context up to this long is one item per KV head, with the bits it had
// before contexts were chunked; a longer one is cut into equal chunks. Chunks of 256 made 16 requests of 600
// positions 1.08x slower (BENCHMARKS.md), chunks of 1024 left them alone.
constexpr int64_t kChunk = 1024;

template <typename T>
inline void prefetch_row(const T* row, int dim, int hint) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < dim * int64_t(sizeof(T)); c += 64) {  // a cache line each
    if (hint == 0) _mm_prefetch(bytes + c, _MM_HINT_T0);
    else _mm_prefetch(bytes + c, _MM_HINT_T1);
  }
}

// The K rows a thread reads next (its next pair's), prefetched into L2 while the current pair sums V.
template <typename T>
struct NextRows {
  const T* k = nullptr;
  const int64_t* slots = nullptr;
  int64_t length = 0;
};

// Query heads [0, G) of one KV head against its context. Each K and V row is read once for all
// G heads; the cache rows are cold at a decode step (every weight streamed since the last one),
// so K rows are prefetched a few rows ahead and V rows into L2 during the score pass.
// With `stats` (a chunk of a longer context), out gets the unscaled sums and stats each head's maximum score and
// total of exp(score - maximum), for combine_chunks; else out gets the attention.
template <int Dim, int G, typename T>
void attend_group(const float* q, int64_t q_stride, const T* k, const T* v, int64_t row_stride,
                  const int64_t* slots, int64_t length, float scale, float* out, float* stats, float* scores,
                  const NextRows<T>& next) {
  constexpr int C = Dim / kLanes;
  Vec qv[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) qv[j][c] = vload(q + j * q_stride + kLanes * c);
  float best[G];
  for (int j = 0; j < G; ++j) best[j] = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < length; ++t) {
    if (t + kAhead < length) prefetch_row(k + slots[t + kAhead] * row_stride, Dim, 0);
    prefetch_row(v + slots[t] * row_stride, Dim, 1);
    const T* kr = k + slots[t] * row_stride;
    Vec kv[C];
    for (int c = 0; c < C; ++c) kv[c] = vload_row(kr + kLanes * c);
    for (int j = 0; j < G; ++j) {
      Vec acc = vmul(qv[j][0], kv[0]);
      for (int c = 1; c < C; ++c) acc = vfma(qv[j][c], kv[c], acc);
      const float s = vsum(acc) * scale;
      scores[j * length + t] = s;
      best[j] = std::max(best[j], s);
    }
  }
  float inv[G];
  for (int j = 0; j < G; ++j) {
    float* sj = scores + j * length;
    const Vec top = vset1(best[j]);
    Vec total = vzero();
    for (int64_t t = 0; t < length; t += kLanes) {
      const Vec e = exp_ps(vsub(vload_n(sj + t, length - t), top));
      vstore_n(sj + t, e, length - t);
      total = vadd(total, vkeep_n(e, length - t));
    }
    const float sum = vsum(total);
    inv[j] = 1.f / sum;
    if (stats != nullptr) {
      stats[2 * j] = best[j];
      stats[2 * j + 1] = sum;
    }
  }
  Vec acc[G][C];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c) acc[j][c] = vzero();
  for (int64_t t = 0; t < length; ++t) {
    if (t < next.length) prefetch_row(next.k + next.slots[t] * row_stride, Dim, 1);
    const T* vr = v + slots[t] * row_stride;
    Vec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload_row(vr + kLanes * c);
    for (int j = 0; j < G; ++j) {
      const Vec p = vset1(scores[j * length + t]);
      for (int c = 0; c < C; ++c) acc[j][c] = vfma(p, vv[c], acc[j][c]);
    }
  }
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < C; ++c)
      vstore(out + j * Dim + kLanes * c, stats != nullptr ? acc[j][c] : vmul(acc[j][c], vset1(inv[j])));
}

// All `heads` query heads that share one KV head, kMaxGroup at a time (the last group prefetches `next`).
template <int Dim, typename T>
void attend(const float* q, int64_t q_stride, int64_t heads, const T* k, const T* v, int64_t row_stride,
            const int64_t* slots, int64_t length, float scale, float* out, float* stats, float* scores,
            const NextRows<T>& next) {
  using Fn = void (*)(const float*, int64_t, const T*, const T*, int64_t, const int64_t*, int64_t, float,
                      float*, float*, float*, const NextRows<T>&);
  static constexpr Fn by_size[kMaxGroup] = {attend_group<Dim, 1, T>, attend_group<Dim, 2, T>, attend_group<Dim, 3, T>,
                                            attend_group<Dim, 4, T>};
  for (int64_t j = 0; j < heads; j += kMaxGroup) {
    const int64_t g = std::min<int64_t>(kMaxGroup, heads - j);
    by_size[g - 1](q + j * q_stride, q_stride, k, v, row_stride, slots, length, scale, out + j * Dim,
                   stats != nullptr ? stats + 2 * j : nullptr, scores, j + g < heads ? NextRows<T>{} : next);
  }
}

// One (request, KV head) pair's chunks combined, in chunk order: each head's sums weighted by exp(its chunk's
// maximum - the largest), over the totals weighted alike. sums [chunks][heads][dim], stats [chunks][heads][2].
void combine_chunks(const float* sums, const float* stats, int64_t chunks, int64_t heads, int64_t dim, float* out) {
  for (int64_t j = 0; j < heads; ++j) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, stats[(c * heads + j) * 2]);
    float total = 0.f;
    for (int64_t i = 0; i < dim; i += kLanes) vstore(out + j * dim + i, vzero());
    for (int64_t c = 0; c < chunks; ++c) {
      const float weight = std::exp(stats[(c * heads + j) * 2] - top);
      total += weight * stats[(c * heads + j) * 2 + 1];
      const float* sum = sums + (c * heads + j) * dim;
      for (int64_t i = 0; i < dim; i += kLanes)
        vstore(out + j * dim + i, vfma(vset1(weight), vload(sum + i), vload(out + j * dim + i)));
    }
    const Vec inv = vset1(1.f / total);
    for (int64_t i = 0; i < dim; i += kLanes) vstore(out + j * dim + i, vmul(vload(out + j * dim + i), inv));
  }
}

// A work item: positions [start, start + length) of request d's context against KV head g. `part` indexes the
// item's sums and stats in the room where its context has several chunks, -1 where it has one.
struct Item {
  int64_t d, g, start, length, part;
};

// A pair (request d, KV head g) whose `chunks` chunks are parts first .. first + chunks - 1 of the room.
struct Chunked {
  int64_t d, g, first, chunks;
};

int64_t chunks_of(int64_t length) { return (length + kChunk - 1) / kChunk; }

// Query heads [h0, h1) of item `item`'s group: a team thread's part of an item.
struct Run {
  int64_t item, h0, h1;
};

// A team thread's runs: the query heads (of every item, each head's work its item's length) that start in its equal
// share of the team's work. Where a request's KV heads are fewer than the threads' multiple (SmolLM2's 3 over 2
// threads, a context of one chunk), whole items split 2:1 where heads split 5:4; a KV head's rows are read by
// both threads where its heads are split between them.
std::vector<Run> share_of_heads(const std::vector<Item>& items, int64_t group, const TeamShare& share) {
  int64_t total = 0;
  for (const Item& it : items) total += it.length * group;
  const int64_t from = total * share.first / share.size, to = total * share.last / share.size;
  std::vector<Run> runs;
  int64_t at = 0;  // the work of the items before item i
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()) && at < to; ++i) {
    const int64_t length = items[i].length;  // head j starts at at + j * length; the first at or past `from`, `to`:
    const int64_t h0 = std::clamp<int64_t>((from - at + length - 1) / length, 0, group);
    const int64_t h1 = std::clamp<int64_t>((to - at + length - 1) / length, 0, group);
    if (h0 < h1) runs.push_back({i, h0, h1});
    at += length * group;
  }
  return runs;
}

// Every item of the batch over caches of element type T, then the chunks of longer contexts combined.
template <typename T>
void attend_all(const float* qp, int64_t q_rows, const T* kp, const T* vp, const int64_t* sp, const int64_t* len,
                int64_t decodes, int64_t heads, int64_t kv_heads, int64_t dim, int64_t width, float scale, float* op,
                const DecodeTeam* team) {
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  const auto fn = dim == 64 ? attend<64, T> : attend<128, T>;
  std::vector<int64_t> order(decodes);  // longest context first
  for (int64_t i = 0; i < decodes; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
  std::vector<Item> items;
  std::vector<Chunked> chunked;
  int64_t parts = 0;
  for (const int64_t d : order) {
    const int64_t chunks = chunks_of(len[d]);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t start = len[d] * c / chunks, end = len[d] * (c + 1) / chunks;  // equal chunks, none empty
      for (int64_t g = 0; g < kv_heads; ++g)
        items.push_back({d, g, start, end - start, chunks > 1 ? parts + g * chunks + c : -1});
    }
    if (chunks == 1) continue;
    for (int64_t g = 0; g < kv_heads; ++g) chunked.push_back({d, g, parts + g * chunks, chunks});
    parts += chunks * kv_heads;
  }
  std::vector<float> own_room;
  float* sums = nullptr;
  if (parts > 0) {
    const int64_t floats = parts * group * (dim + 2);
    if (team != nullptr) {
      TORCH_CHECK(team->room_floats >= floats, "decode attention's room is ", team->room_floats, " floats, needs ",
                  floats);
      sums = team->room;
    } else {
      own_room.resize(floats);
      sums = own_room.data();
    }
  }
  float* stats = sums + parts * group * dim;
  const int64_t score_floats = std::min<int64_t>(group, kMaxGroup) * std::min(width, kChunk);
  // query heads [h0, h1) of item `i`'s group, prefetching item `following`'s K rows (-1: none)
  const auto attend_item = [&](int64_t i, int64_t h0, int64_t h1, int64_t following, float* scores) {
    NextRows<T> next;
    if (following >= 0) {
      const Item& f = items[following];
      next = {kp + f.g * dim, sp + f.d * width + f.start, f.length};
    }
    const Item& it = items[i];
    float* out = (it.part < 0 ? op + (it.d * heads + it.g * group) * dim : sums + it.part * group * dim) + h0 * dim;
    fn(qp + it.d * q_rows + (it.g * group + h0) * dim, dim, h1 - h0, kp + it.g * dim, vp + it.g * dim, row_stride,
       sp + it.d * width + it.start, it.length, scale, out,
       it.part < 0 ? nullptr : stats + (it.part * group + h0) * 2, scores, next);
  };
  const auto combine = [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const Chunked& c = chunked[p];
      combine_chunks(sums + c.first * group * dim, stats + c.first * group * 2, c.chunks, group, dim,
                     op + (c.d * heads + c.g * group) * dim);
    }
  };
  const int64_t n = items.size();
  if (const TeamShare* share = team_share(); share != nullptr && team != nullptr) {  // this thread's share, in order
    std::vector<float> scores(score_floats);
    const auto runs = share_of_heads(items, group, *share);
    for (size_t r = 0; r < runs.size(); ++r)
      attend_item(runs[r].item, runs[r].h0, runs[r].h1, r + 1 < runs.size() ? runs[r + 1].item : -1, scores.data());
    if (chunked.empty()) return;
    team->meet(team->meeting);
    parallel_split(chunked.size(), combine);
    return;
  }
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(score_floats);
    for (int64_t current = taken.fetch_add(1), following; current < n; current = following) {
      following = taken.fetch_add(1);
      attend_item(current, 0, group, following < n ? following : -1, scores.data());
    }
  });
  if (!chunked.empty()) at::parallel_for(0, chunked.size(), 1, combine);
}

// One cache row from fp32 or bf16 values: a copy, each fp32 value rounded to bf16 (to nearest even, as
// torch's .to()), or each bf16 value widened.
inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(c10::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}
inline void store_row(c10::BFloat16* dst, const c10::BFloat16* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(c10::BFloat16));
}
inline void store_row(float* dst, const c10::BFloat16* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T, typename K, typename V>
void store_rows(T* kc, T* vc, const K* kp, const V* vp, int64_t ks, int64_t vs, const int64_t* sp, int64_t rows,
                int64_t row) {
  for (int64_t t = 0; t < rows; ++t) {
    store_row(kc + sp[t] * row, kp + t * ks, row);
    store_row(vc + sp[t] * row, vp + t * vs, row);
  }
}

// One layer's K and V caches, [slots, kv_heads, dim] each, contiguous, both fp32 or both bf16.
struct Caches {
  void* k;
  void* v;
  int64_t slots, kv_heads, dim;
  bool bf16;
};

Caches caches_of(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "the caches must be [slots, kv_heads, dim]");
  TORCH_CHECK(fp32_or_bf16(k_cache) && v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must both be fp32 or both bf16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  return {k_cache.data_ptr(), v_cache.data_ptr(), k_cache.size(0), k_cache.size(1), k_cache.size(2),
          k_cache.scalar_type() == torch::kBFloat16};
}

// Layer `layer` of a [layers, 2, slots, kv_heads, dim] cache, without a view of it.
Caches caches_of(const torch::Tensor& kv, int64_t layer) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.is_contiguous() && fp32_or_bf16(kv),
              "kv must be a contiguous fp32 or bf16 [layers, 2, slots, kv_heads, dim] cache");
  TORCH_CHECK(0 <= layer && layer < kv.size(0), "layer out of range");
  char* k = static_cast<char*>(kv.data_ptr()) + layer * kv.stride(0) * kv.element_size();
  return {k, k + kv.stride(1) * kv.element_size(), kv.size(2), kv.size(3), kv.size(4),
          kv.scalar_type() == torch::kBFloat16};
}

void attend_caches(const torch::Tensor& q, const Caches& c, const torch::Tensor& slots, const torch::Tensor& lengths,
                   double scale, torch::Tensor& out, const DecodeTeam* team) {
  TORCH_CHECK(q.dim() == 3, "q must be [D, heads, dim]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat, "q and out must be fp32");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous (its rows may be strided)");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "out must be a contiguous tensor of q's shape");
  TORCH_CHECK(slots.dim() == 2 && slots.scalar_type() == torch::kLong && lengths.dim() == 1 &&
              lengths.scalar_type() == torch::kLong, "slots must be [D, width] and lengths [D], int64");
  const int64_t decodes = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = c.kv_heads;
  TORCH_CHECK(c.dim == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(slots.size(0) == decodes && lengths.size(0) == decodes, "one slot row and length per query");
  TORCH_CHECK(dim == 64 || dim == 128, "head_dim must be 64 or 128, got ", dim);
  const auto sc = slots.expect_contiguous();  // borrowed: no reference count written (DecodeLayers' team)
  const auto lc = lengths.expect_contiguous();
  const int64_t width = sc->size(1);
  const int64_t* len = lc->data_ptr<int64_t>();
  for (int64_t d = 0; d < decodes; ++d) TORCH_CHECK(0 < len[d] && len[d] <= width, "length out of range");
  const int64_t* sp = sc->data_ptr<int64_t>();
  for (int64_t i = 0; i < decodes * width; ++i) TORCH_CHECK(0 <= sp[i] && sp[i] < c.slots, "slot out of range");
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  if (!c.bf16) {
    attend_all(qp, q.stride(0), static_cast<const float*>(c.k), static_cast<const float*>(c.v), sp, len, decodes,
               heads, kv_heads, dim, width, s, op, team);
  } else {
    attend_all(qp, q.stride(0), static_cast<const uint16_t*>(c.k), static_cast<const uint16_t*>(c.v), sp, len,
               decodes, heads, kv_heads, dim, width, s, op, team);
  }
}

void store_caches(const Caches& c, const torch::Tensor& slot_mapping, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == c.kv_heads && k.size(2) == c.dim,
              "k and v must be [T, kv_heads, dim] like the cache rows");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k's and v's heads must be contiguous (their rows may be strided)");
  TORCH_CHECK(fp32_or_bf16(k) && fp32_or_bf16(v), "k and v must be fp32 or bf16");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == torch::kLong &&
              slot_mapping.size(0) == k.size(0), "slot_mapping must be [T] int64");
  const auto sm = slot_mapping.expect_contiguous();
  const int64_t* sp = sm->data_ptr<int64_t>();
  const int64_t rows = k.size(0), row = k.size(1) * k.size(2);
  for (int64_t t = 0; t < rows; ++t) TORCH_CHECK(0 <= sp[t] && sp[t] < c.slots, "slot out of range");
  const auto into = [&](auto* kc, auto* vc) {
    const auto from = [&](const auto* kp) {
      if (v.scalar_type() == torch::kFloat) store_rows(kc, vc, kp, v.data_ptr<float>(), k.stride(0), v.stride(0), sp, rows, row);
      else store_rows(kc, vc, kp, v.data_ptr<c10::BFloat16>(), k.stride(0), v.stride(0), sp, rows, row);
    };
    if (k.scalar_type() == torch::kFloat) from(k.data_ptr<float>());
    else from(k.data_ptr<c10::BFloat16>());
  };
  if (!c.bf16) into(static_cast<float*>(c.k), static_cast<float*>(c.v));
  else into(static_cast<c10::BFloat16*>(c.k), static_cast<c10::BFloat16*>(c.v));
}

}  // namespace

// The caches may be fp32 or bf16 (widened to fp32 as they are read); q and out are fp32.
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& slots, const torch::Tensor& lengths, double scale, torch::Tensor& out) {
  attend_caches(q, caches_of(k_cache, v_cache), slots, lengths, scale, out, nullptr);
}

void decode_attention_layer(const torch::Tensor& q, const torch::Tensor& kv, int64_t layer,
                            const torch::Tensor& slots, const torch::Tensor& lengths, double scale, torch::Tensor& out,
                            const DecodeTeam* team) {
  attend_caches(q, caches_of(kv, layer), slots, lengths, scale, out, team);
}

int64_t decode_attention_chunk() { return kChunk; }

int64_t decode_attention_room(const torch::Tensor& lengths, int64_t heads, int64_t dim) {
  TORCH_CHECK(lengths.dim() == 1 && lengths.scalar_type() == torch::kLong, "lengths must be [D] int64");
  const auto lc = lengths.contiguous();
  const int64_t* len = lc.data_ptr<int64_t>();
  int64_t parts = 0;
  for (int64_t d = 0; d < lc.size(0); ++d)
    if (chunks_of(len[d]) > 1) parts += chunks_of(len[d]);
  return parts * heads * (dim + 2);
}

// k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t]: the step's new K/V rows (which may be
// strided views of the fused QKV projection) copied into the cache, a memcpy per row, or rounded
// to bf16 for a bf16 cache.
void store_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
              const torch::Tensor& k, const torch::Tensor& v) {
  store_caches(caches_of(k_cache, v_cache), slot_mapping, k, v);
}

void store_kv_layer(const torch::Tensor& kv, int64_t layer, const torch::Tensor& slot_mapping, const torch::Tensor& k,
                    const torch::Tensor& v) {
  store_caches(caches_of(kv, layer), slot_mapping, k, v);
}
