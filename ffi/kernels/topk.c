#include "topk.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Radix selection of the k-th largest magnitude key (never a sort), then one emitting scan.
 *
 * The key of x[i] is its bit pattern without the sign, a 31-bit integer whose unsigned order is
 * the order of |x| (NaNs, exponent all ones and mantissa non-zero, sort above inf). Selecting the
 * top k keys means finding the threshold key T and the number `ties` of keys equal to T to take:
 * every key > T is selected, and the first `ties` keys == T in index order.
 *
 * Large n, exact path: pass 1 histograms the top 15 key bits of all of x, which fixes the bucket
 * holding T and the count of keys at or above that bucket's floor; pass 2 copies those candidates
 * (about k) out in index order; a histogram and two 8-bit radix levels over the candidates give T
 * and ties; pass 3 emits from the candidates.
 * Large n, fast path: a fixed 1/32 sample of x guesses the floor instead of pass 1, so x is
 * read about once and the 512 KB of pass-1 tables are neither cleared nor summed (below 64k
 * entries they cost more than the rest of the selection). The guess is checked (at least k
 * candidates, not more than the buffer holds) and a bad guess falls back to the exact path: it
 * can cost time, never exactness.
 * Small n: four radix levels (7+8+8+8 bits) over x itself, with 256-bin histograms that need no
 * heap, then one emitting scan. */

static inline uint32_t key_at(const float *x, int64_t i) {
  uint32_t bits;
  memcpy(&bits, x + i, sizeof bits);
  return bits & 0x7fffffffu;
}

#define KEY_BITS 31
#define HI_SHIFT 16
#define HI_BINS (1u << (KEY_BITS - HI_SHIFT))
#define HI_TABLES 4           /* interleaved pass-1 tables: runs of equal keys do not serialise */
#define SMALL_N (1 << 13)     /* below this, skip the pass-1 tables: their setup (~30 us) dominates */
#define BLOCK 32              /* pass-1/2 block: skipped whole when all zero / without candidate */
#define SAMPLE_CHUNK 16       /* contiguous entries per sampled chunk (one cache line) */
#define SAMPLE_STRIDE 512     /* one chunk per SAMPLE_STRIDE entries: a 1/32 sample */

/* Walks bins from the top until the running count reaches need (1 <= need <= sum of hist).
 * Returns the crossing bin; *above receives the count strictly above it. The empty top of the
 * table is skipped a vector-wide block at a time: gradients' keys sit about halfway up it, and
 * walking the empty bins one by one cost more than the rest of a selection of 37k entries. */
static uint32_t crossing_bin(const uint32_t *hist, uint32_t bins, int64_t need, int64_t *above) {
  enum { SKIP = 64 };
  int64_t acc = 0;
  uint32_t b = bins;
  while (b >= SKIP) {
    uint32_t any = 0;
    for (uint32_t j = b - SKIP; j < b; ++j) any |= hist[j];
    if (any) break;
    b -= SKIP;
  }
  while (b > 0) {
    --b;
    if (acc + hist[b] >= need) break;
    acc += hist[b];
  }
  *above = acc;
  return b;
}

/* Resolves the low `shift` bits of the threshold among the keys of v[0..m) whose bits above
 * `shift` equal `prefix`, one radix digit of widths[l] <= 8 bits per scan. *need is the rank
 * wanted among those keys on entry, the number of ties to take at the threshold on return.
 * A first vector pass finds the bits that vary among those keys: digits where none vary (ties,
 * integer-valued or bfloat16-valued data) are known without counting. The counting scans are
 * branchless (other keys count into a spare bin) over four interleaved tables, so that neither
 * an unpredictable prefix test nor a run of equal keys stalls them. */
static uint32_t radix_refine(const float *v, int64_t m, uint32_t prefix, int shift, const int *widths, int levels,
                             int64_t *need) {
  uint32_t any = 0, all = ~0u;
  const uint32_t fixed_in = ~0u << shift;
  for (int64_t i = 0; i < m; ++i) {
    uint32_t kk = key_at(v, i);
    int match = (kk & fixed_in) == prefix;
    any |= match ? kk : 0u;
    all &= match ? kk : ~0u;
  }
  const uint32_t varying = any ^ all;

  enum { SPARE = 256 };
  uint32_t hist[4][SPARE + 1];
  for (int l = 0; l < levels; ++l) {
    const uint32_t fixed = ~0u << shift; /* bits resolved so far (shift >= 1 here) */
    shift -= widths[l];
    const uint32_t digit_mask = (1u << widths[l]) - 1;
    if (((varying >> shift) & digit_mask) == 0) { /* one digit value: nothing above it */
      prefix |= ((any >> shift) & digit_mask) << shift;
      continue;
    }
    memset(hist, 0, sizeof hist);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      for (int t = 0; t < 4; ++t) {
        uint32_t kk = key_at(v, i + t);
        hist[t][(kk & fixed) == prefix ? (kk >> shift) & digit_mask : SPARE]++;
      }
    }
    for (; i < m; ++i) {
      uint32_t kk = key_at(v, i);
      hist[0][(kk & fixed) == prefix ? (kk >> shift) & digit_mask : SPARE]++;
    }
    for (uint32_t b = 0; b <= digit_mask; ++b) hist[0][b] += hist[1][b] + hist[2][b] + hist[3][b];
    int64_t above = 0;
    uint32_t d = crossing_bin(hist[0], digit_mask + 1, *need, &above);
    *need -= above;
    prefix |= d << shift;
  }
  return prefix;
}

/* Pass 3 over a candidate list in index order: keys above t, then keys equal to t while ties
 * remain, so that among equal magnitudes the lower index wins. Returns the number written. */
static int64_t emit_candidates(const int32_t *ci, const float *cv, int64_t m, uint32_t t, int64_t ties,
                               int32_t *out_idx, float *out_val) {
  int64_t o = 0;
  for (int64_t j = 0; j < m; ++j) {
    uint32_t kk = key_at(cv, j);
    if (kk > t || (kk == t && ties > 0)) {
      ties -= kk == t;
      out_idx[o] = ci[j];
      out_val[o++] = cv[j];
    }
  }
  return o;
}

static int64_t emit_scan(const float *x, int64_t n, int64_t k, uint32_t t, int64_t ties, int32_t *out_idx,
                         float *out_val) {
  int64_t o = 0;
  for (int64_t i = 0; i < n && o < k; ++i) {
    uint32_t kk = key_at(x, i);
    if (kk >= t && (kk > t || ties > 0)) {
      ties -= kk == t;
      out_idx[o] = (int32_t)i;
      out_val[o++] = x[i];
    }
  }
  return o;
}

/* Pass 1: histogram of key >> HI_SHIFT into HI_TABLES interleaved tables, summed into the first.
 * Blocks of zeros (gradients that are already sparse) are counted with one vector OR. */
static void histogram_hi(const float *x, int64_t n, uint32_t *h) {
  int64_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    uint32_t any = 0;
    for (int j = 0; j < BLOCK; ++j) any |= key_at(x, i + j);
    if (any == 0) {
      h[0] += BLOCK;
      continue;
    }
    for (int j = 0; j < BLOCK; j += 4) {
      h[0 * HI_BINS + (key_at(x, i + j) >> HI_SHIFT)]++;
      h[1 * HI_BINS + (key_at(x, i + j + 1) >> HI_SHIFT)]++;
      h[2 * HI_BINS + (key_at(x, i + j + 2) >> HI_SHIFT)]++;
      h[3 * HI_BINS + (key_at(x, i + j + 3) >> HI_SHIFT)]++;
    }
  }
  for (; i < n; ++i) h[key_at(x, i) >> HI_SHIFT]++;
  for (uint32_t b = 0; b < HI_BINS; ++b) h[b] += h[HI_BINS + b] + h[2 * HI_BINS + b] + h[3 * HI_BINS + b];
}

/* Pass 2: copies the entries with key >= floor_key to ci/cv in index order; the buffers hold
 * cap + BLOCK entries. Returns their count, or -1 as soon as it exceeds cap. Blocks without a
 * candidate, the vast majority at small k, cost a few vector instructions. */
#if defined(__SSE2__) && defined(__GNUC__) && !defined(SPARCML_TOPK_PORTABLE)
#include <emmintrin.h>

/* Bit j set when x[j] is a candidate. Keys and floor_key - 1 lie in [-1, 2^31): signed compare. */
static inline uint32_t candidate_mask(const float *x, uint32_t floor_key) {
  const __m128i below = _mm_set1_epi32((int32_t)floor_key - 1), magnitude = _mm_set1_epi32(0x7fffffff);
  uint32_t mask = 0;
  for (int v = 0; v < BLOCK / 4; ++v) {
    __m128i key = _mm_and_si128(_mm_loadu_si128((const __m128i *)(const void *)(x + 4 * v)), magnitude);
    mask |= (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(key, below))) << (4 * v);
  }
  return mask;
}

static int64_t compact(const float *x, int64_t n, uint32_t floor_key, int32_t *ci, float *cv, int64_t cap) {
  int64_t m = 0, i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    uint32_t mask = candidate_mask(x + i, floor_key);
    if (mask == 0) continue;
    if (m > cap) return -1;
    do { /* only the set bits: about one per hit block at small k */
      int j = __builtin_ctz(mask);
      ci[m] = (int32_t)(i + j);
      cv[m++] = x[i + j];
      mask &= mask - 1;
    } while (mask);
  }
#else
/* Portable: key - floor_key has its top bit set exactly when key < floor_key (keys are below
 * 2^31), so an AND over a block, plain SIMD without compares, finds the blocks to skip. */
static int64_t compact(const float *x, int64_t n, uint32_t floor_key, int32_t *ci, float *cv, int64_t cap) {
  int64_t m = 0, i = 0;
  for (; i + BLOCK <= n; i += BLOCK) {
    uint32_t below = ~0u;
    for (int j = 0; j < BLOCK; ++j) below &= key_at(x, i + j) - floor_key;
    if (below >> 31) continue;
    if (m > cap) return -1;
    for (int j = 0; j < BLOCK; ++j) { /* branchless: slot m is scratch until counted */
      ci[m] = (int32_t)(i + j);
      cv[m] = x[i + j];
      m += key_at(x, i + j) >= floor_key;
    }
  }
#endif
  if (m > cap) return -1;
  for (; i < n; ++i) {
    ci[m] = (int32_t)i;
    cv[m] = x[i];
    m += key_at(x, i) >= floor_key;
  }
  return m > cap ? -1 : m;
}

/* The top k of m >= k candidates (index order, every key of x above theirs among them):
 * one histogram of the top key bits, two 8-bit radix levels, one emitting scan. hist holds
 * HI_TABLES * HI_BINS counters. Fewer than SMALL_N candidates (the sampled path at small k)
 * take the small-n radix levels instead: clearing the pass-1 tables would cost more than
 * counting them. */
static int64_t select_from_candidates(const int32_t *ci, const float *cv, int64_t m, int64_t k, uint32_t *hist,
                                      int32_t *out_idx, float *out_val) {
  if (m < SMALL_N) {
    static const int digits[4] = {7, 8, 8, 8};
    int64_t ties = k;
    const uint32_t t = radix_refine(cv, m, 0, KEY_BITS, digits, 4, &ties);
    return emit_candidates(ci, cv, m, t, ties, out_idx, out_val);
  }
  static const int low_digits[2] = {8, 8};
  memset(hist, 0, (size_t)HI_TABLES * HI_BINS * sizeof(uint32_t));
  histogram_hi(cv, m, hist);
  int64_t above = 0;
  const uint32_t hi = crossing_bin(hist, HI_BINS, k, &above);
  int64_t ties = k - above;
  const uint32_t t = radix_refine(cv, m, hi << HI_SHIFT, HI_SHIFT, low_digits, 2, &ties);
  return emit_candidates(ci, cv, m, t, ties, out_idx, out_val);
}

static int64_t isqrt(int64_t v) { /* floor(sqrt(v)), 0 <= v < 2^62 */
  int64_t lo = 0, hi = (v < 3037000499 ? v : 3037000499) + 1;
  while (hi - lo > 1) {
    int64_t mid = lo + (hi - lo) / 2;
    if (mid * mid <= v) lo = mid; else hi = mid;
  }
  return lo;
}

/* Guesses, from a deterministic 1/32 sample of x (chunks of SAMPLE_CHUNK entries at hashed
 * offsets, so that a row-periodic layout cannot bias it), a floor key with at least k keys of x
 * at or above it and not many more: the sample's rank k/32 plus a wide margin. The guess only
 * decides speed: the caller verifies the count and falls back to the exact histogram.
 * Returns 0 when the sample cannot help (k too large, or a big run of equal keys). */
static int sample_floor(const float *x, int64_t n, int64_t k, uint32_t *hist, uint32_t *floor_key, int64_t *cap) {
  memset(hist, 0, (size_t)HI_BINS * sizeof(uint32_t));
  const int64_t chunks = n / SAMPLE_STRIDE;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t slot = ((uint32_t)c * 2654435761u) >> 27; /* 0..31 */
    const int64_t at = c * SAMPLE_STRIDE + (int64_t)slot * SAMPLE_CHUNK;
    for (int j = 0; j < SAMPLE_CHUNK; ++j) hist[key_at(x, at + j) >> HI_SHIFT]++;
  }
  const int64_t size = chunks * SAMPLE_CHUNK;
  const int64_t ks = k * size / n; /* the sample's expected rank of the k-th largest key */
  const int64_t want = ks + ks / 8 + 8 * isqrt(ks) + 16;
  if (want > size / 4) return 0;
  int64_t acc = 0; /* want <= size, the sample's count: the walk crosses it */
  const uint32_t b = crossing_bin(hist, HI_BINS, want, &acc);
  acc += hist[b];
  const int64_t estimate = acc * n / size;
  if (acc < want || 2 * estimate > n / 4) return 0;
  *floor_key = b << HI_SHIFT;
  *cap = 2 * estimate + 1024;
  return 1;
}

static int select_large(const float *x, int64_t n, int64_t k, int32_t *out_idx, float *out_val, char *err) {
  uint32_t *hist = malloc((size_t)HI_TABLES * HI_BINS * sizeof(uint32_t));
  if (!hist) {
    snprintf(err, SPARCML_ERRLEN, "topk: out of memory for the histograms (n=%lld)", (long long)n);
    return 1;
  }
  int64_t written = -1;
  int32_t *ci = NULL;
  float *cv = NULL;

  /* Fast path: a sampled floor saves the full histogram pass. */
  uint32_t floor_key = 0;
  int64_t cap = 0;
  if (sample_floor(x, n, k, hist, &floor_key, &cap)) {
    ci = malloc((size_t)(cap + BLOCK) * sizeof(int32_t));
    cv = malloc((size_t)(cap + BLOCK) * sizeof(float));
    int64_t m = ci && cv ? compact(x, n, floor_key, ci, cv, cap) : -1;
    if (m >= k) written = select_from_candidates(ci, cv, m, k, hist, out_idx, out_val);
    free(ci), free(cv);
    ci = NULL, cv = NULL;
  }

  /* Exact path: pass 1 histograms all of x, which fixes the floor and the candidate count. */
  if (written < 0) {
    memset(hist, 0, (size_t)HI_TABLES * HI_BINS * sizeof(uint32_t));
    histogram_hi(x, n, hist);
    int64_t above = 0;
    const uint32_t hi = crossing_bin(hist, HI_BINS, k, &above);
    const int64_t candidates = above + hist[hi];
    floor_key = hi << HI_SHIFT;
    if (candidates <= n / 4) { /* the usual case; otherwise rescanning x is as cheap as copying it */
      ci = malloc((size_t)(candidates + BLOCK) * sizeof(int32_t));
      cv = malloc((size_t)(candidates + BLOCK) * sizeof(float));
    }
    if (ci && cv) {
      int64_t m = compact(x, n, floor_key, ci, cv, candidates);
      written = m == candidates ? select_from_candidates(ci, cv, m, k, hist, out_idx, out_val) : -1;
    } else {
      static const int low_digits[2] = {8, 8};
      int64_t ties = k - above; /* rank wanted inside the bucket */
      const uint32_t t = radix_refine(x, n, floor_key, HI_SHIFT, low_digits, 2, &ties);
      written = emit_scan(x, n, k, t, ties, out_idx, out_val);
    }
    free(ci), free(cv);
  }
  free(hist);
  if (written != k) { /* unreachable: the histograms count exactly what the scans see */
    snprintf(err, SPARCML_ERRLEN, "topk: internal error, selected %lld of k=%lld", (long long)written,
             (long long)k);
    return 1;
  }
  return 0;
}

int sparcml_topk(const float *x, int64_t n, int64_t k, int32_t *out_idx, float *out_val, char *err) {
  if (n < 0 || n > INT32_MAX) {
    snprintf(err, SPARCML_ERRLEN, "topk: n=%lld must lie in [0, %d] (int32 indices); split the vector",
             (long long)n, INT32_MAX);
    return 1;
  }
  if (k < 0 || k > n) {
    snprintf(err, SPARCML_ERRLEN, "topk: k=%lld must lie in [0, n=%lld]", (long long)k, (long long)n);
    return 1;
  }
  if (k == 0) return 0;
  if (k == n) { /* everything: the dense representation */
    for (int64_t i = 0; i < n; ++i) out_idx[i] = (int32_t)i;
    memcpy(out_val, x, (size_t)n * sizeof(float));
    return 0;
  }
  if (n >= SMALL_N) return select_large(x, n, k, out_idx, out_val, err);

  static const int digits[4] = {7, 8, 8, 8};
  int64_t ties = k;
  uint32_t t = radix_refine(x, n, 0, KEY_BITS, digits, 4, &ties);
  int64_t written = emit_scan(x, n, k, t, ties, out_idx, out_val);
  if (written != k) {
    snprintf(err, SPARCML_ERRLEN, "topk: internal error, selected %lld of k=%lld", (long long)written,
             (long long)k);
    return 1;
  }
  return 0;
}
