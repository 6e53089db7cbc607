// AMX tile configuration shared by the AMX kernels (linear_avx512_bf16.cpp, greedy_head_avx512.cpp).
// Include it after a `#pragma GCC target("amx-tile,...")`: everything here uses the tile ISA.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tgq_cpu {

// Rows of every tile the kernels use, and bytes per row (palette 1's largest).
constexpr int kAmxTileRows = 16;
constexpr int kAmxTileBytes = 64;

// Palette 1's 64-byte configuration (LDTILECFG's memory operand).
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7, each 16 rows of 64 bytes. Per thread, before its first tile instruction; the
// thread gives them back with _tile_release().
inline void load_amx_tile_config() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kAmxTileBytes;
    config.rows[t] = kAmxTileRows;
  }
  _tile_loadconfig(&config);
}

}  // namespace tgq_cpu
