// The kernels' entry points, shared by the Python bindings and the one-call decode layers. Every
// source is built twice, once per instruction set (vec_math.h), into two extension modules.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <utility>
#include <vector>

// The AVX-512 kernels that stream a weight from memory with no other prefetching (GGUF blocks, int8
// VNNI panels) ask for the line this far ahead into L1 as they go: one SmolLM2 decode stream ran up to
// 1.14x (GGUF) and 1.13x (int8) faster with it on a Zen 5, never clearly slower (BENCHMARKS.md). The
// panel kernel keeps its own 16 KB into L2 (8 KB into L1 was no faster there), the bf16 kernel none
// (no faster with it either).
constexpr int64_t kStreamAhead = 8192;
inline void prefetch_ahead(const void* at) { _mm_prefetch(static_cast<const char*>(at) + kStreamAhead, _MM_HINT_T0); }

// The one parallel region of a decode step's layers (DecodeLayers::run): inside it each thread holds workers
// [first, last) of `size`, and the GEMMs and decode attention compute their share of panels or pairs
// (parallel_split) instead of starting a parallel region of their own, which costs about 1.1 us with the caches
// cold, 5 a layer. Elsewhere nullptr.
struct TeamShare {
  int64_t first, last, size;
};
const TeamShare* team_share();
// [first, last) of n: this thread's equal part inside a team, else all of it (a row op's elements).
inline std::pair<int64_t, int64_t> team_part(int64_t n) {
  const TeamShare* share = team_share();
  if (share == nullptr) return {0, n};
  return {n * share->first / share->size, n * share->last / share->size};
}
// fn(first, last) over [0, n): this thread's share inside a team, else split over the threads by at::parallel_for.
// (Shrinking ranges taken from a count shared by the team, to even out the threads' finishes, made SmolLM2's GGUF
// layers from memory 1.3x slower: BENCHMARKS.md.)
template <typename F>
void parallel_split(int64_t n, const F& fn) {
  if (team_share() != nullptr) {
    const auto [first, last] = team_part(n);
    if (first < last) fn(first, last);
    return;
  }
  at::parallel_for(0, n, 1, fn);
}

// x itself where its rows are contiguous (they may be strided), else a contiguous copy: borrowed, so that no
// reference count is written (inside DecodeLayers' team every thread would write the same one).
inline c10::MaybeOwned<torch::Tensor> with_rows(const torch::Tensor& x) {
  return x.stride(-1) == 1 ? c10::MaybeOwned<torch::Tensor>::borrowed(x)
                           : c10::MaybeOwned<torch::Tensor>::owned(x.contiguous());
}

inline bool fp32_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

// A kernel's result tensor: `out` where the caller gives one (checked to be contiguous, of `sizes` and `type`, and to
// share no memory with `inputs`), else a new one. The one-call decode layers keep their outputs from one layer and step
// to the next: with a step's weights streaming through the caches, each new tensor costs about half a microsecond.
void check_out(const char* name, const torch::Tensor& out, at::IntArrayRef sizes, const torch::TensorOptions& options);
void check_apart(const char* name, const torch::Tensor& out, const torch::Tensor& input);
// Both checks of a given output (the `_into` forms' and output_or_new's).
template <typename... Inputs>  // inputs by reference: a copy of each would write its reference count
void check_output(const char* name, const torch::Tensor& out, at::IntArrayRef sizes,
                  const torch::TensorOptions& options, const Inputs&... inputs) {
  check_out(name, out, sizes, options);
  (check_apart(name, out, inputs), ...);
}
// The given output, else a new tensor: for a wrapper whose `_into` form checks the output itself.
inline torch::Tensor given_or_empty(const c10::optional<torch::Tensor>& out, at::IntArrayRef sizes,
                                    const torch::TensorOptions& options) {
  return out.has_value() ? *out : torch::empty(sizes, options);
}
template <typename... Inputs>
torch::Tensor output_or_new(const char* name, const c10::optional<torch::Tensor>& out, at::IntArrayRef sizes,
                            const torch::TensorOptions& options, const Inputs&... inputs) {
  if (!out.has_value()) return torch::empty(sizes, options);
  check_output(name, *out, sizes, options, inputs...);
  return *out;
}

int64_t panel_width();  // output columns per packed panel in this build
int64_t panel_row_block();  // rows the panel GEMM's microkernel computes at once in this build
// x fp32; panels fp32, bf16 or int8 (then `scale`: fp32, one per output column).
// `out` (here and below): where to write the result (output_or_new).
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                           const c10::optional<torch::Tensor>& scale = c10::nullopt,
                           const c10::optional<torch::Tensor>& out = c10::nullopt);
// The GEMMs into a given y (checked as output_or_new checks it; `scale` nullptr for none), the form DecodeLayers calls:
// with no tensor made or copied, its team's threads write no reference count that they share.
void panel_linear_into(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const torch::Tensor* scale,
                       const torch::Tensor& y);
void gguf_linear_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool vnni, const torch::Tensor& y);
void vnni_linear_int8_into(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const torch::Tensor& scale,
                          const torch::Tensor& y);
void avx512_bf16_linear_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output,
                             const torch::Tensor& y);
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& slots, const torch::Tensor& lengths, double scale, torch::Tensor& out);  // caches fp32 or bf16
void store_kv(torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
              const torch::Tensor& k, const torch::Tensor& v);
// What DecodeLayers' team gives decode attention for contexts of several chunks: a meeting point between the
// chunks and their combination (meet(meeting)), and room, shared by the team, for the chunks' partial results
// (decode_attention_room floats or more).
struct DecodeTeam {
  void (*meet)(const void*);
  const void* meeting;
  float* room;
  int64_t room_floats;
};
// The same two on layer `layer` of a [layers, 2, slots, kv_heads, dim] cache, without views of it; inside
// DecodeLayers' team, with `team`.
void decode_attention_layer(const torch::Tensor& q, const torch::Tensor& kv, int64_t layer,
                            const torch::Tensor& slots, const torch::Tensor& lengths, double scale, torch::Tensor& out,
                            const DecodeTeam* team = nullptr);
int64_t decode_attention_chunk();  // positions a decode attention work item covers; longer contexts are combined
// The floats of room decode attention needs for these contexts' chunks (`heads` query heads of size `dim`).
int64_t decode_attention_room(const torch::Tensor& lengths, int64_t heads, int64_t dim);
void store_kv_layer(const torch::Tensor& kv, int64_t layer, const torch::Tensor& slot_mapping, const torch::Tensor& k,
                    const torch::Tensor& v);
// delta fp32 or bf16; the norm fp32, or bf16 with bf16_out (rope and store_kv also take bf16 rows).
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                            bool bf16_out = false, const c10::optional<torch::Tensor>& out = c10::nullopt);
// sum = x + delta (contiguous, apart from x) and out = its norm, add_rms_norm_'s bits: inside DecodeLayers' team each
// thread stores its part of the sum's columns and the whole norm into its own out (no meeting after it).
void add_rms_norm_into(const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                       bool bf16_out, const torch::Tensor& sum, const torch::Tensor& out);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                   const c10::optional<torch::Tensor>& out = c10::nullopt);
torch::Tensor silu_mul(const torch::Tensor& gate_up, const c10::optional<torch::Tensor>& out = c10::nullopt);
// rope and silu_mul into a given out (checked as output_or_new checks it), the form DecodeLayers calls: with no tensor
// made or copied, its team's threads write no reference count that they share. Inside the team, silu_mul computes
// this thread's part of the columns.
void rope_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin,
               const torch::Tensor& out);
void silu_mul_into(const torch::Tensor& gate_up, const torch::Tensor& out);
torch::Tensor argmax_rows(const torch::Tensor& logits);

// AMX tile GEMM (amx_gemm.cpp): only where the CPU has AMX-BF16, and after amx_ready().
bool amx_ready();  // Linux granted this process the tile state
// bf16 [N, K] -> [ceil(N/16), ceil(K/32), 16, 32]: per 16 columns and 32 k, the B tile tdpbf16ps reads.
torch::Tensor amx_pack(const torch::Tensor& weight);
// x [M, K] (bf16, or fp32 rounded to it) @ w.T -> [M, n], fp32 or rounded to bf16 (bf16_output), for
// packed = amx_pack(w).
torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output);
// amx_linear into a given y (checked as output_or_new checks it), the form DecodeLayers calls: inside its team, this
// thread's share of the column pairs, x rounded by each thread into a buffer of its own.
void amx_linear_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output,
                     const torch::Tensor& y);
// x as amx_pack's layout reads it: bf16, K zero padded to kb steps of 32; in place where it already is.
torch::Tensor tile_input(const torch::Tensor& x, int64_t kb);
// The same rows without a tensor: x itself where it is laid out so, else x rounded (to nearest even, as torch's
// .to()) into a buffer the calling thread keeps, with their stride in elements. A decode step's new tensor costs about
// half a microsecond with the caches cold, and inside DecodeLayers' team each thread rounds its own.
std::pair<const uint16_t*, int64_t> tile_rows(const torch::Tensor& x, int64_t kb);
// The checks of the tile-order GEMMs (`name`: amx_linear or avx512_bf16_linear) on x [M, K] (fp32, rounded to bf16 to
// nearest even, or bf16) and a weight packed by amx_pack; tile_gemm_output also returns their output [M, n], fp32 or
// bf16 (output_or_new).
void check_tile_gemm(const char* name, const torch::Tensor& x, const torch::Tensor& packed, int64_t n);
torch::Tensor tile_gemm_output(const char* name, const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                               bool bf16_output, const c10::optional<torch::Tensor>& out = c10::nullopt);
// The same product as amx_linear, on the same packed weight, with AVX512-BF16's vdpbf16ps instead of tiles
// (avx512_bf16_gemm.cpp): only in the avx512 build, and where the CPU has AVX512-BF16. Inside DecodeLayers' team it
// computes this thread's share of the columns.
torch::Tensor avx512_bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool bf16_output,
                                 const c10::optional<torch::Tensor>& out = c10::nullopt);
// x fp32 [M, K] @ (q * scale[:, None]).T -> fp32 [M, n] on AMX's int8 tiles, for int8 q in the AVX-512 build's
// 32-column panels (panel_linear's): each row of x quantized to int16 with its own scale, q exact, the sums exact
// in int32; also needs AVX512-VBMI.
torch::Tensor amx_linear_int8(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const torch::Tensor& scale);
// The product with x rounded to bf16 and AVX512-BF16's vdpbf16ps (avx512_bf16_gemm.cpp), as avx512_bf16_linear
// on q in bf16 (each panel widened to it, exactly).
torch::Tensor avx512_bf16_linear_int8(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                                      const torch::Tensor& scale);
// x fp32 [M, K] @ (q * scale[:, None]).T -> fp32 [M, n] with AVX512-VNNI (vnni_gemm.cpp), on the same int8
// panels: each row's blocks of 128 x values quantized to int16 with their own scale, int16 products summed
// exactly per block. For the rows below the tile kernels'; the avx512 build only, where the CPU has AVX512-VNNI.
torch::Tensor vnni_linear_int8(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                               const torch::Tensor& scale, const c10::optional<torch::Tensor>& out = c10::nullopt);
// x [m, k] (rows ldx apart) quantized for int16 products (vnni_gemm.cpp): [m][ceil(k/2)] int32 pairs of int16,
// each block of `block` values scaled by its largest magnitude / 32767 (scales [m][blocks]), or with `bytes` for
// int8 products, [m][ceil(k/4)] int32 quads of int8 scaled by it / 127; with `sums`, the sums of the quantized x
// (times the scale) over each of a block's `sum_parts` equal parts ([m][blocks][sum_parts]).
void quantize_rows(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t block, int32_t* pairs, float* scales,
                   float* sums, int64_t sum_parts = 1, bool bytes = false);
// quantize_rows' output for m rows of kp pairs and `blocks` blocks (and `sums` sums a row), in buffers the calling
// thread keeps from one call to the next: a decode step's GEMMs would otherwise allocate three tensors each, at
// about 0.4 us apiece with the caches cold.
struct QuantizedRows {
  int32_t* pairs;
  float* scales;
  float* sums;
};
QuantizedRows quantized_rows_buffers(int64_t m, int64_t kp, int64_t blocks, int64_t sums);
// x fp32 [M, K] @ W.T -> fp32 [M, n] for W in a GGUF file's own blocks, repacked by BlockWeight.pack
// (gguf_blocks.py) into [N/32][K/32][record] (gguf_gemm.cpp): x quantized to int16 per block of 32, the
// weights widened to int16, products summed exactly per block; a 4-bit form packed for int8 activations
// ([N/32][K/32][record / 128][128]): x quantized to int8, the products of its unsigned q four to a lane. The
// same bits in both builds, and with `vnni` (the avx512 build, a CPU with AVX512-VNNI) from vpdpwssd, vpdpbusd.
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool vnni,
                          const c10::optional<torch::Tensor>& out = c10::nullopt);
// The int8 GEMMs' checks of x, the 32-column panels, n and the scales (`name` is the caller's, for the messages).
void check_int8_panels(const char* name, const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                       const torch::Tensor& scale);
// A prompt chunk's attention (amx_attention.cpp): q bf16 [n, heads, dim] at positions start..start+n-1 against
// k, v bf16 [start + n, kv_heads, dim], causal; writes out [n, heads, dim] (fp32 or bf16; rows may be strided).
void amx_prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                           double scale, torch::Tensor& out);
// The same attention in vectors (prefill_attention.cpp): q, k, v and out fp32 or bf16 (k and v alike),
// computed in fp32, or with `bf16_products` (the AVX-512 build, a CPU with AVX512-BF16, bf16 k and v) on
// bf16 products as SDPA in bf16.
void prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start,
                       double scale, torch::Tensor& out, bool bf16_products = false);

// Every layer of a decode-only batch in one call (decode_layers.cpp).
class DecodeLayers {
 public:
  // Per layer: the two norm weights and the four weights packed into panels (cpu_kernels.pack), or
  // for bf16 with `plain`, into AMX tiles (amx_pack) where the model runs those.
  // `scales`: for int8 panels, each layer's four column scales (qkv, o, gate_up, down) in layer
  // order; empty for fp32 or bf16 panels; a batch of `native_rows` rows or more (0: none) then runs
  // amx_linear_int8 (`amx_tiles`) or avx512_bf16_linear_int8 on the same panels. `plain`: for bf16
  // panels, each layer's four weights as NarrowLinear holds them for oneDNN (plain bf16 or packed by
  // precision.pack_native_bf16), in the same order; a batch of `native_rows` rows or more rounds its input to bf16 and multiplies
  // through oneDNN's bf16 GEMM, as NarrowLinear does; empty: the panels only. Weights packed by
  // amx_pack run the smaller batches on AMX tiles with `amx_tiles`, else with AVX512-BF16. `vnni`: int8 panels
  // below native_rows on vnni_linear_int8, and GGUF blocks (uint8 panels, gguf_linear) with vpdpwssd.
  DecodeLayers(std::vector<torch::Tensor> attn_norm, std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> o,
               std::vector<torch::Tensor> ffn_norm, std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
               std::vector<torch::Tensor> scales, std::vector<torch::Tensor> plain, int64_t native_rows,
               bool amx_tiles, bool vnni, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate,
               double eps, double scale);

  // x [D, hidden] (updated in place and returned) and h = RMSNorm(x) with the first layer's
  // weight; kv [layers, 2, slots + 1, kv_heads, dim]; cos, signed_sin [D, dim]; slot_mapping [D];
  // slots [D, width] and lengths [D] as for decode_attention.
  torch::Tensor run(torch::Tensor x, torch::Tensor h, const torch::Tensor& kv, const torch::Tensor& cos,
                    const torch::Tensor& signed_sin, const torch::Tensor& slot_mapping, const torch::Tensor& slots,
                    const torch::Tensor& lengths);
  // A whole model's decode step up to its LM head: token_ids and positions [D] (int64) pick rows of embed [vocab,
  // hidden] (fp32, or bf16 widened exactly) and of cos and signed_sin [max_position, dim] (fp32); the first input
  // norm, run, and the final norm follow. Returns RMSNorm(x) * final_norm of the last layer's x, what the LM head
  // reads: the bits of the Python embedding, rms_norm and run (each op costs microseconds from Python there).
  torch::Tensor run_tokens(const torch::Tensor& token_ids, const torch::Tensor& positions, const torch::Tensor& embed,
                           const torch::Tensor& cos, const torch::Tensor& signed_sin, const torch::Tensor& final_norm,
                           const torch::Tensor& kv, const torch::Tensor& slot_mapping, const torch::Tensor& slots,
                           const torch::Tensor& lengths);

 private:
  // One batch size's activations and the views into them, kept from one layer and step to the next: fused QKV
  // (and its part to rotate, and V), RoPE's output (and Q, K), attention's output (and as rows), then the O
  // projection, a norm's output, gate/up, SiLU's output and the down projection; for run_tokens, the embedded rows,
  // their first norm (fp32 whatever h is) and their rows of the RoPE tables.
  struct Buffers {
    int64_t rows = -1;
    torch::Tensor fused, to_rotate, v, rotated, q, k, attn, attn_rows, o, h, gate_up, act, ffn;
    torch::Tensor x, first_h, cos, signed_sin;
    torch::Tensor sum;  // x + o within a layer (x + ffn goes back to x)
    std::vector<torch::Tensor> own_h;  // in a team, each thread's own norm output (by its first worker)
    torch::Tensor room;  // decode attention's, for contexts of several chunks (grown by run)
    torch::Tensor made[4];  // the last product of each GEMM of a layer where the kernel makes a new tensor
  };
  void keep_buffers(int64_t rows, int64_t hidden, const torch::TensorOptions& options);
  struct Step {  // run's arguments
    torch::Tensor& x;
    const torch::Tensor &h, &kv, &cos, &signed_sin, &slot_mapping, &slots, &lengths;
  };
  // Layer l: its GEMMs, attention, norms and SiLU on this thread's share (team_share) or every thread, RoPE and
  // the KV store where `lead`; meet() between them (waits for the other threads of a team, or nothing).
  template <typename Meet>
  void layer(int64_t l, const Step& in, bool lead, const Meet& meet);
  bool int8_tiles(int64_t rows) const;  // int8 panels widened to bf16 at this many rows (no out-variant)
  // Whether every GEMM of a batch of `rows` writes into its buffer, on a kernel that takes a team's share: the batches
  // that may run in one region (int8 on the tile kernels and oneDNN's GEMMs start their own).
  bool writes_buffers(int64_t rows) const;
  const torch::Tensor* scale(int64_t layer, int64_t which) const;  // which: 0 qkv, 1 o, 2 gate_up, 3 down; or none
  // Writes into `out` (fp32, or bf16 with `plain`) and returns it where the kernel has an out-variant (a team's
  // batches), else returns the kernel's new tensor, kept in buffers_.made.
  const torch::Tensor& linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t layer, int64_t which,
                              int64_t n, const torch::Tensor& out);

  Buffers buffers_;

  std::vector<torch::Tensor> attn_norm_, qkv_, o_, ffn_norm_, gate_up_, down_, scales_, plain_;
  int64_t native_rows_;
  bool amx_tiles_, vnni_;
  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  double eps_, scale_;
};
