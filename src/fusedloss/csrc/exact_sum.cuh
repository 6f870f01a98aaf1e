// Exact, order-free summation of a reduction's tile partials in a few hundred
// bytes.
//
// Tiles finish in any order. Keeping one partial per tile and folding them in a
// fixed order costs memory in proportion to N; here each tile adds its partial
// into one fixed-point integer with integer atomics instead. Integer addition
// does not depend on order, so the result has the same bits on every run, and it
// is the exact sum of the partials, rounded once at the end.
//
// Why an integer holds it: every value a loss sums is >= 0 (or NaN / +inf, which
// set a flag), a whole multiple of 2^kLowExponent (the smallest subnormal of T,
// the type the loss is computed in), and a tile's partial is below
// 2^kHighExponent. The integer is stored as base-2^34 digits in 64-bit words: a
// partial touches at most three digits, and the 30 spare bits of a word absorb
// the carries of up to 2^30 tiles (launch_reduced_loss refuses more).
//
// Neighbouring tiles add into different copies of the digits, each copy from
// the start of its own 128-byte line, as many as the scratch holds: atomics
// from many tiles to a few lines queue at L2.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

namespace fusedloss {

using Word = unsigned long long;  // the type CUDA's 64-bit atomics take

constexpr int kLineWords = 128 / sizeof(Word);
constexpr int kDigitBits = 34;
constexpr int kMaxTilesLog2 = 64 - kDigitBits;
constexpr Word kDigitMask = (Word(1) << kDigitBits) - 1;
constexpr Word kSawNaN = 1;
constexpr Word kSawInf = 2;

template <typename T>
struct ExactSumRange;
// fp32 losses: partials are double sums of at most 2^13 finite fp32 values.
template <>
struct ExactSumRange<float> {
  static constexpr int kLowExponent = -149;
  static constexpr int kHighExponent = 128 + 13;
};
template <>
struct ExactSumRange<double> {
  static constexpr int kLowExponent = -1074;
  static constexpr int kHighExponent = 1024;
};

template <typename T>
struct ExactSum {
  static constexpr int kLowExponent = ExactSumRange<T>::kLowExponent;
  static constexpr int kDigits =
      (ExactSumRange<T>::kHighExponent + kMaxTilesLog2 - kLowExponent + kDigitBits - 1) / kDigitBits;
  // A copy: its flags, then its digits, from the start of a line.
  static constexpr int kCopyWords = (1 + kDigits + kLineWords - 1) / kLineWords * kLineWords;
  // Values per tile that kHighExponent allows for.
  static constexpr int64_t kMaxTileValues = int64_t(1) << 13;

  // Adds `partial` (>= 0, NaN or +inf), a tile's sum, into the copy at `copy`.
  // One thread per tile.
  __device__ __forceinline__ static void add(Word* copy, double partial) {
    if (!(partial <= DBL_MAX)) {
      atomicOr(copy, isnan(partial) ? kSawNaN : kSawInf);
      return;
    }
    if (partial == 0.0) return;
    const Word bits = Word(__double_as_longlong(partial));
    const int biased_exponent = int(bits >> 52);
    Word mantissa = bits & ((Word(1) << 52) - 1);
    int exponent = -1074;  // partial == mantissa * 2^exponent
    if (biased_exponent != 0) {
      mantissa |= Word(1) << 52;
      exponent = biased_exponent - 1075;
    }
    // partial is a multiple of 2^kLowExponent: only zero bits shift out.
    if (exponent < kLowExponent) {
      mantissa >>= kLowExponent - exponent;
      exponent = kLowExponent;
    }
    const int offset = exponent - kLowExponent;
    const int shift = offset % kDigitBits;
    // The 53-bit mantissa shifted by < kDigitBits, cut into three digits.
    const Word digits[3] = {(mantissa << shift) & kDigitMask, (mantissa >> (kDigitBits - shift)) & kDigitMask,
                            2 * kDigitBits - shift < 53 ? mantissa >> (2 * kDigitBits - shift) : 0};
    Word* sum = copy + 1 + offset / kDigitBits;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      if (digits[k] != 0) atomicAdd(sum + k, digits[k]);
    }
  }

  // The sum of everything added to the `copies` copies at `words` (in shared
  // memory, which this overwrites), rounded to the nearest double, ties to
  // even. One thread.
  __device__ static double total(Word* words, int copies) {
    Word flags = 0;
    for (int c = 0; c < copies; ++c) flags |= words[c * kCopyWords];
    if (flags & kSawNaN) return NAN;
    if (flags & kSawInf) return INFINITY;
    // Fold the copies into copy 0, carrying: afterwards each digit < 2^kDigitBits.
    Word* digits = words + 1;
    unsigned __int128 carry = 0;
    for (int d = 0; d < kDigits; ++d) {
      for (int c = 0; c < copies; ++c) carry += digits[c * kCopyWords + d];
      digits[d] = Word(carry) & kDigitMask;
      carry >>= kDigitBits;
    }
    int top = kDigits - 1;
    while (top >= 0 && digits[top] == 0) --top;
    if (top < 0) return 0.0;
    // The top three digits carry more than 53 bits; of those below, only
    // whether any is set matters for rounding.
    const int low = top < 2 ? 0 : top - 2;
    unsigned __int128 window = 0;
    for (int d = top; d >= low; --d) window = (window << kDigitBits) | digits[d];
    bool sticky = false;
    for (int d = 0; d < low; ++d) sticky |= digits[d] != 0;
    int exponent = kLowExponent + low * kDigitBits;
    const Word high = Word(window >> 64);
    const int length = high != 0 ? 128 - __clzll(high) : 64 - __clzll(Word(window));
    if (length > 53) {
      const int drop = length - 53;
      const unsigned __int128 one = 1;
      const unsigned __int128 rest = window & ((one << drop) - 1);
      const unsigned __int128 half = one << (drop - 1);
      window >>= drop;
      exponent += drop;
      if (rest > half || (rest == half && (sticky || (window & 1)))) ++window;
    }
    // Exact unless it overflows to inf: below 2^-1022 the sum has < 53 bits.
    return ldexp(double(Word(window)), exponent);
  }
};

// The scratch a reduction sums into: one 512-byte allocator block, as small as
// the 0-d loss itself, below kLargeScratchFromTiles tiles; from there on
// 2 KiB, whose extra lines spread the atomics of many tiles. Eager PyTorch's
// own mean allocates as much for its staging at those sizes, so a training
// step's peak memory stays at or below eager's.
constexpr int64_t kSmallScratchBytes = 512;
constexpr int64_t kLargeScratchBytes = 2048;
constexpr int64_t kLargeScratchFromTiles = 8192;
constexpr int kMaxScratchWords = kLargeScratchBytes / sizeof(Word);

__host__ __device__ constexpr int64_t scratch_bytes(int64_t tiles) {
  return tiles < kLargeScratchFromTiles ? kSmallScratchBytes : kLargeScratchBytes;
}

// How many copies of the exact sum the scratch holds: a power of two.
template <typename T>
__host__ __device__ constexpr int scratch_copies(int64_t tiles) {
  static_assert(ExactSum<T>::kCopyWords * sizeof(Word) <= kSmallScratchBytes, "a copy must fit the scratch");
  return int(scratch_bytes(tiles) / sizeof(Word)) / ExactSum<T>::kCopyWords;
}

}  // namespace fusedloss
