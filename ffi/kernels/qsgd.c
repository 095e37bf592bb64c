#include "qsgd.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every float32 operation below is mirrored, in the same order, by the jnp reference, and no
 * result depends on the floating-point environment (XLA:CPU flushes subnormals, plain C does not):
 * - Subnormal inputs are flushed to zero in the integer domain (|v| below FLT_MIN counts as 0).
 * - Per-element work is rescaled by a power of two 2^-k, k = min(exponent of the bucket's
 *   max|v| or scale, 126): exact, 2^-k is a normal float, and L / (scale * 2^-k) cannot overflow
 *   (L / scale itself would for scale < L / FLT_MAX).
 * - XLA turns a / broadcast(b) into a * broadcast(1 / b), so the kernels divide once per bucket
 *   and only multiply per element.
 * - XLA contracts a product followed by an add into an FMA (on CPUs that have one), so a clamp
 *   sits between every product and the addition that uses it: t = min((|v| * 2^-k) * f, L) and
 *   sq = min((|v| * 2^-k)^2, 64). The clamps never bind; written as `a < b ? a : b` they compile
 *   to minps and agree with jnp.minimum on non-NaN values (NaN never reaches them: non-finite
 *   buckets are handled separately). */

#define STAGE 4096 /* codes quantized per step before packing */

/* The hot loops are compiled for AVX-512 (x86-64-v4), AVX2 and the baseline ISA, picked at load
 * time: the hash needs native 32-bit vector multiplies to keep up with memory. x86-64-v4 enables
 * FMA, but no product feeds an addition directly (see the clamps above), so the compiler has
 * nothing to contract and every clone computes the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPARCML_HOT __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define SPARCML_HOT
#endif

static inline uint32_t mix32(uint32_t x) { /* "lowbias32" (C. Wellons), an avalanching bijection */
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

void sparcml_qsgd_seed(uint32_t key0, uint32_t key1, uint32_t *s0, uint32_t *s1) {
  *s0 = mix32(key0 ^ 0x243f6a88U);
  *s1 = mix32(key1 ^ mix32(*s0 ^ 0x85a308d3U));
}

uint32_t sparcml_qsgd_hash(uint32_t s0, uint32_t s1, uint32_t i) { return mix32(mix32(i ^ s0) + s1); }

int64_t sparcml_qsgd_packed_bytes(int64_t n, int bits) { return (n * bits + 7) / 8; }

int64_t sparcml_qsgd_num_buckets(int64_t n, int64_t bucket) { return bucket > 0 ? (n + bucket - 1) / bucket : 0; }

int sparcml_qsgd_check(int64_t n, int bits, int64_t bucket, int scale_kind, char *err) {
  if (bits != 2 && bits != 4 && bits != 8) {
    snprintf(err, SPARCML_ERRLEN, "qsgd: bits=%d is not supported; use 2, 4 or 8", bits);
    return 1;
  }
  if (bucket < 1) {
    snprintf(err, SPARCML_ERRLEN, "qsgd: bucket_size=%lld must be a positive number of values (e.g. 1024)",
             (long long)bucket);
    return 1;
  }
  if (n < 0 || n > INT32_MAX) {
    snprintf(err, SPARCML_ERRLEN, "qsgd: n=%lld must lie in [0, %d]", (long long)n, INT32_MAX);
    return 1;
  }
  if (scale_kind >= 0 && scale_kind != SPARCML_QSGD_SCALE_MAX && scale_kind != SPARCML_QSGD_SCALE_L2) {
    snprintf(err, SPARCML_ERRLEN, "qsgd: scale kind %d is unknown; use \"max\" or \"l2\"", scale_kind);
    return 1;
  }
  return 0;
}

#define MIN_NORMAL_BITS 0x00800000U /* FLT_MIN */

static inline uint32_t bits_of_float(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

static inline float float_of_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

/* |v| with subnormals flushed to +0, and its bit pattern. */
static inline float flushed_abs(float v, uint32_t *abits) {
  uint32_t b = bits_of_float(v) & 0x7fffffffU;
  *abits = b;
  return b < MIN_NORMAL_BITS ? 0.0f : float_of_bits(b);
}

/* 2^-k for k = min(exponent of the normal positive float with bits b, 126), and 2^k. */
static inline float pow2_down(uint32_t b, float *up) {
  int32_t k = (int32_t)(b >> 23) - 127;
  k = k < 126 ? k : 126;
  *up = float_of_bits((uint32_t)(127 + k) << 23);
  return float_of_bits((uint32_t)(127 - k) << 23);
}

/* Largest |v| as the bit pattern of a float with its sign cleared, 0 when every |v| is below
 * FLT_MIN. Integer order equals float order for non-negative floats and puts inf above every
 * finite value and NaN above inf. */
SPARCML_HOT static uint32_t max_abs_bits(const float *x, int64_t m) {
  uint32_t best = 0;
  for (int64_t j = 0; j < m; ++j) {
    uint32_t b = bits_of_float(x[j]) & 0x7fffffffU;
    best = b > best ? b : best;
  }
  return best < MIN_NORMAL_BITS ? 0 : best;
}

static inline float clamped_square(float v, float inv) {
  uint32_t abits;
  float a = flushed_abs(v, &abits) * inv; /* exact unless it underflows */
  float sq = a * a;
  return sq < 64.0f ? sq : 64.0f;
}

/* sum(min((|x[j]| * inv)^2, 64)) by pairwise halving over the next power of two p >= m (zeros
 * pad): t = s[:p/2] + s[p/2:], then t = t[:h] + t[h:] until one value is left. work holds p/2. */
SPARCML_HOT static float halving_sum_squares(const float *x, int64_t m, float inv, float *work) {
  if (m == 1) return clamped_square(x[0], inv);
  int64_t h = 1;
  while (2 * h < m) h *= 2; /* h = p / 2 < m <= p */
  for (int64_t j = 0; j < m - h; ++j) work[j] = clamped_square(x[j], inv) + clamped_square(x[j + h], inv);
  for (int64_t j = m - h; j < h; ++j) work[j] = clamped_square(x[j], inv);
  while (h > 1) {
    h /= 2;
    for (int64_t j = 0; j < h; ++j) work[j] += work[j + h];
  }
  return work[0];
}

/* The scale of one bucket: max|v|, or 2^k * sqrt(sum((|v| * 2^-k)^2)) capped at FLT_MAX. */
static float bucket_scale(const float *x, int64_t m, int scale_kind, float *work) {
  uint32_t mbits = max_abs_bits(x, m);
  float mx = float_of_bits(mbits);
  if (scale_kind == SPARCML_QSGD_SCALE_MAX || mbits == 0 || !isfinite(mx)) return mx;
  float up, inv = pow2_down(mbits, &up);
  float s = sqrtf(halving_sum_squares(x, m, inv, work)) * up;
  return s < FLT_MAX ? s : FLT_MAX;
}

/* codes[j] for x[j], j < m, where x[0] is element `first` of the vector. */
SPARCML_HOT static void quantize_codes(const float *x, int64_t m, uint32_t first, float scale, int L, uint32_t s0,
                                       uint32_t s1, uint8_t *codes) {
  if (scale == 0.0f || !isfinite(scale)) {
    memset(codes, L, (size_t)m);
    return;
  }
  const uint32_t sbits = bits_of_float(scale);
  float up, inv = pow2_down(sbits, &up);
  const float Lf = (float)L, f = Lf / (scale * inv);
  const uint32_t count = (uint32_t)m; /* 32-bit counters vectorize better; n <= INT32_MAX */
  for (uint32_t j = 0; j < count; ++j) {
    uint32_t abits;
    float a = flushed_abs(x[j], &abits);
    float t = (a * inv) * f;
    t = t < Lf ? t : Lf;
    t = abits == sbits ? Lf : t; /* the bucket max is exactly level L */
    uint32_t h = sparcml_qsgd_hash(s0, s1, first + j);
    float u = (float)(int32_t)(h >> 8) * 0x1p-24f;
    int32_t level = (int32_t)t;    /* floor: t >= 0 */
    float frac = t - (float)level; /* exact */
    level += u < frac;             /* = floor(t + u) in exact arithmetic */
    codes[j] = (uint8_t)((bits_of_float(x[j]) >> 31) ? L - level : L + level);
  }
}

/* Packs count codes (a multiple of 8 / bits) into count * bits / 8 bytes. */
SPARCML_HOT static void pack_codes(const uint8_t *c, int64_t count, int bits, uint8_t *out) {
  if (bits == 8) {
    memcpy(out, c, (size_t)count);
  } else if (bits == 4) {
    for (int64_t b = 0; b < count / 2; ++b) out[b] = (uint8_t)(c[2 * b] | (c[2 * b + 1] << 4));
  } else {
    for (int64_t b = 0; b < count / 4; ++b)
      out[b] = (uint8_t)(c[4 * b] | (c[4 * b + 1] << 2) | (c[4 * b + 2] << 4) | (c[4 * b + 3] << 6));
  }
}

int64_t sparcml_qsgd_alignment(int64_t bucket, int bits) {
  int64_t per_byte = 8 / bits, a = bucket;
  while (a % per_byte != 0) a += bucket; /* lcm(bucket, per_byte): per_byte is 1, 2 or 4 */
  return a;
}

static int check_range(int64_t n, int64_t first, int64_t count, int bits, int64_t bucket, char *err) {
  int64_t align = sparcml_qsgd_alignment(bucket, bits), end = first + count;
  if (first < 0 || count < 0 || end > n || first % align != 0 || (end != n && end % align != 0)) {
    snprintf(err, SPARCML_ERRLEN,
             "qsgd: range [%lld, %lld) of n=%lld must lie inside [0, n) with both ends multiples of %lld "
             "(bucket_size and whole bytes) or the end at n",
             (long long)first, (long long)end, (long long)n, (long long)align);
    return 1;
  }
  return 0;
}

int sparcml_qsgd_quantize_range(const float *x, int64_t n, int64_t first, int64_t count, int bits, int64_t bucket,
                                int scale_kind, uint32_t key0, uint32_t key1, uint8_t *packed, float *scales,
                                char *err) {
  if (sparcml_qsgd_check(n, bits, bucket, scale_kind, err)) return 1;
  if (check_range(n, first, count, bits, bucket, err)) return 1;
  const int L = (1 << (bits - 1)) - 1, per_byte = 8 / bits;
  const int64_t end = first + count;
  uint32_t s0, s1;
  sparcml_qsgd_seed(key0, key1, &s0, &s1);

  float *work = NULL;
  if (scale_kind == SPARCML_QSGD_SCALE_L2 && count > 1) {
    int64_t h = 1, m = bucket < count ? bucket : count;
    while (2 * h < m) h *= 2;
    work = (float *)malloc((size_t)h * sizeof(float));
    if (!work) {
      snprintf(err, SPARCML_ERRLEN, "qsgd: out of memory for a bucket_size=%lld work buffer", (long long)bucket);
      return 1;
    }
  }

  uint8_t stage[STAGE + 8];
  int64_t pending = 0; /* codes in stage not yet packed (< per_byte) */
  uint8_t *out = packed + first / per_byte;
  for (int64_t start = first, b = first / bucket; start < end; start += bucket, ++b) {
    int64_t m = end - start < bucket ? end - start : bucket;
    float scale = bucket_scale(x + start, m, scale_kind, work);
    scales[b] = scale;
    for (int64_t off = 0; off < m; off += STAGE) {
      int64_t c = m - off < STAGE ? m - off : STAGE;
      quantize_codes(x + start + off, c, (uint32_t)(start + off), scale, L, s0, s1, stage + pending);
      int64_t total = pending + c, whole = total - total % per_byte;
      pack_codes(stage, whole, bits, out);
      out += whole / per_byte;
      pending = total - whole;
      memmove(stage, stage + whole, (size_t)pending);
    }
  }
  if (pending > 0) { /* the last byte: unused high bits stay 0 */
    memset(stage + pending, 0, (size_t)(per_byte - pending));
    pack_codes(stage, per_byte, bits, out);
  }
  free(work);
  return 0;
}

int sparcml_qsgd_quantize(const float *x, int64_t n, int bits, int64_t bucket, int scale_kind, uint32_t key0,
                          uint32_t key1, uint8_t *packed, float *scales, char *err) {
  return sparcml_qsgd_quantize_range(x, n, 0, n, bits, bucket, scale_kind, key0, key1, packed, scales, err);
}

/* ((code - L) / L) * scale, a result below FLT_MIN flushed to a signed zero. */
static inline float decode_one(uint32_t code, int L, float Lf, float scale) {
  float o = (float)((int32_t)code - L) / Lf * scale;
  uint32_t b = bits_of_float(o);
  return (b & 0x7fffffffU) < MIN_NORMAL_BITS ? float_of_bits(b & 0x80000000U) : o;
}

/* Decodes elements [first, first + m) into out[0..m) (`out[j] = decoded`, or with ACC
 * `out[j] += decoded`): a head up to a byte boundary, whole bytes, then a tail. */
#define STORE_0(o, v) ((o) = (v))
#define STORE_1(o, v) ((o) += (v))
#define DEFINE_DECODE(NAME, BITS, ACC)                                                                  \
  SPARCML_HOT static void NAME(const uint8_t *packed, int64_t first, int64_t m, float scale, float *out) { \
    enum { K = 8 / BITS, MASK = (1 << BITS) - 1, L = (1 << (BITS - 1)) - 1 };                           \
    const float Lf = (float)L;                                                                          \
    int64_t i = first, end = first + m;                                                                 \
    for (; i < end && i % K != 0; ++i)                                                                  \
      STORE_##ACC(out[i - first], decode_one((packed[i / K] >> ((i % K) * BITS)) & MASK, L, Lf, scale)); \
    int64_t body_bytes = (end - i) / K;                                                                 \
    const uint8_t *p = packed + i / K;                                                                  \
    float *o = out + (i - first);                                                                       \
    for (int64_t b = 0; b < body_bytes; ++b) {                                                          \
      uint32_t byte = p[b];                                                                             \
      for (int j = 0; j < K; ++j) STORE_##ACC(o[b * K + j], decode_one((byte >> (j * BITS)) & MASK, L, Lf, scale)); \
    }                                                                                                   \
    for (i += body_bytes * K; i < end; ++i)                                                             \
      STORE_##ACC(out[i - first], decode_one((packed[i / K] >> ((i % K) * BITS)) & MASK, L, Lf, scale)); \
  }

DEFINE_DECODE(decode_2, 2, 0)
DEFINE_DECODE(decode_4, 4, 0)
DEFINE_DECODE(decode_8, 8, 0)
DEFINE_DECODE(accumulate_2, 2, 1)
DEFINE_DECODE(accumulate_4, 4, 1)
DEFINE_DECODE(accumulate_8, 8, 1)

static int decode_range(const uint8_t *packed, const float *scales, int64_t n, int64_t first, int64_t count,
                        int bits, int64_t bucket, int accumulate, float *out, char *err) {
  if (sparcml_qsgd_check(n, bits, bucket, -1, err)) return 1;
  if (check_range(n, first, count, bits, bucket, err)) return 1;
  const int64_t end = first + count;
  for (int64_t start = first, b = first / bucket; start < end; start += bucket, ++b) {
    int64_t m = end - start < bucket ? end - start : bucket;
    float scale = scales[b], *o = out + start;
    if (!isfinite(scale)) {
      for (int64_t j = 0; j < m; ++j) o[j] = accumulate ? o[j] + NAN : NAN;
    } else if (bits == 2) {
      (accumulate ? accumulate_2 : decode_2)(packed, start, m, scale, o);
    } else if (bits == 4) {
      (accumulate ? accumulate_4 : decode_4)(packed, start, m, scale, o);
    } else {
      (accumulate ? accumulate_8 : decode_8)(packed, start, m, scale, o);
    }
  }
  return 0;
}

int sparcml_qsgd_dequantize_range(const uint8_t *packed, const float *scales, int64_t n, int64_t first,
                                  int64_t count, int bits, int64_t bucket, float *out, char *err) {
  return decode_range(packed, scales, n, first, count, bits, bucket, 0, out, err);
}

int sparcml_qsgd_accumulate_range(const uint8_t *packed, const float *scales, int64_t n, int64_t first,
                                  int64_t count, int bits, int64_t bucket, float *out, char *err) {
  return decode_range(packed, scales, n, first, count, bits, bucket, 1, out, err);
}

int sparcml_qsgd_dequantize(const uint8_t *packed, const float *scales, int64_t n, int bits, int64_t bucket,
                            float *out, char *err) {
  return sparcml_qsgd_dequantize_range(packed, scales, n, 0, n, bits, bucket, out, err);
}
