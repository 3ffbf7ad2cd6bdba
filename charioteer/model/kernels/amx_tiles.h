// AMX tile state shared by the tile kernels (amx_gemm.cpp, amx_attention.cpp). Only called where
// the CPU has AMX-BF16 and amx_ready() said yes; the functions carry AMX's target attribute, so both
// ISA builds hold them.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <vector>

constexpr int64_t kTileRows = 16;  // rows of an A or C tile
constexpr int64_t kTileK = 32;     // bf16 values in a tile row (64 bytes): an A tile's k, a B tile's 16 pairs
constexpr int64_t kTileN = 16;     // columns of a C tile
constexpr int64_t kTileElems = kTileRows * kTileK;
constexpr int64_t kPairCols = 2 * kTileN;  // a pair of column blocks: an int8 panel's columns, a pass's C columns

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 16 rows of 64 bytes, then `rows[t]` where given (nonzero) for tile t.
__attribute__((target("amx-tile"))) inline void configure_tiles(const uint8_t (&rows)[8]) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = rows[t] ? rows[t] : kTileRows;
  }
  // not _tile_loadconfig: GCC's takes the config as an 8-byte operand, so the stores of the rest
  // may be dropped as dead (ldtilecfg then faults on a half-written config)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// `count` values of T in `buffer`, grown as needed (kept between calls: a fresh tens-of-MB tensor each call pays its
// page faults), from a 64-byte boundary: a tile row read across two cache lines costs two (a LLaMA-7B layer's int8
// GEMMs at 64 rows took 21.8 or 26.6 ms from one process to the next as std::vector's blocks fell).
template <typename T>
T* aligned_buffer(std::vector<char>& buffer, int64_t count) {
  const auto bytes = static_cast<size_t>(count) * sizeof(T) + 64;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
}
