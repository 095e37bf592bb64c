/* QSGD stochastic quantization (Alistarh et al., NIPS 2017; SparCML §6 applies it to the dense
 * allgather of DSAR).
 *
 * The vector is cut into buckets of `bucket` consecutive values (the last may be shorter), each
 * with one float32 scale: max |v| (SPARCML_QSGD_SCALE_MAX) or the L2 norm (SPARCML_QSGD_SCALE_L2).
 * With L = 2^(bits-1) - 1 levels per sign and u uniform in [0, 1):
 *   t     = L if |v| == scale, else min((|v| * 2^-k) * (L / (scale * 2^-k)), L)
 *           (float32, in this order; k = min(exponent of scale, 126), so nothing overflows)
 *   level = floor(t) + (u < t - floor(t) ? 1 : 0)   (floor(t + u) in exact arithmetic, <= L)
 *   code  = L + level if v >= 0, L - level if v < 0       (an unsigned value in [0, 2L])
 *   decoded = ((float)(code - L) / (float)L) * scale        (float32, in this order)
 * Codes are packed little end first: element i sits at bit (i % (8/bits)) * bits of byte
 * i / (8/bits); the packed length is ceil(n * bits / 8) and unused high bits of the last byte are 0.
 *
 * Randomness is counter based: u_i = (sparcml_qsgd_hash(s0, s1, i) >> 8) * 2^-24 where
 * (s0, s1) = sparcml_qsgd_seed(key0, key1) and key0, key1 are the two words of a JAX PRNG key.
 *
 * Special buckets: scale 0 (all zeros) stores code L everywhere and decodes to zeros. A bucket
 * holding inf or NaN gets a non-finite scale (the largest |v| bit pattern, so inf or NaN),
 * stores code L everywhere and decodes to NaN for every entry. Subnormal values (|v| < FLT_MIN)
 * count as zero and decoded values below FLT_MIN become signed zeros, whatever the floating-point
 * environment. The L2 scale is computed as
 * 2^k * sqrt(sum((|v| * 2^-k)^2)) with k = min(exponent of max |v|, 126), summed by pairwise
 * halving (see qsgd.c), and capped at FLT_MAX, so finite inputs never get a non-finite scale.
 *
 * The pure-jnp reference in sparcml_jax/kernels/qsgd.py performs the same float32 operations in
 * the same order, so both produce bit-identical codes, scales and decoded values. */
#ifndef SPARCML_QSGD_H
#define SPARCML_QSGD_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { SPARCML_QSGD_SCALE_MAX = 0, SPARCML_QSGD_SCALE_L2 = 1 };

/* Bytes of the packed codes of n values: ceil(n * bits / 8). */
int64_t sparcml_qsgd_packed_bytes(int64_t n, int bits);

/* Number of buckets (and scales) of n values: ceil(n / bucket). */
int64_t sparcml_qsgd_num_buckets(int64_t n, int64_t bucket);

/* Checks bits in {2, 4, 8}, bucket >= 1, n >= 0 and a known scale kind (scale_kind < 0 skips
 * that check). Returns 0 or writes a message naming the argument. */
int sparcml_qsgd_check(int64_t n, int bits, int64_t bucket, int scale_kind, char *err);

/* The per-call seeds derived from the two key words. */
void sparcml_qsgd_seed(uint32_t key0, uint32_t key1, uint32_t *s0, uint32_t *s1);

/* The 32-bit hash of element i under seeds (s0, s1). */
uint32_t sparcml_qsgd_hash(uint32_t s0, uint32_t s1, uint32_t i);

/* Quantizes x[0..n) into packed[0..packed_bytes(n, bits)) and scales[0..num_buckets(n, bucket)). */
int sparcml_qsgd_quantize(const float *x, int64_t n, int bits, int64_t bucket, int scale_kind, uint32_t key0,
                          uint32_t key1, uint8_t *packed, float *scales, char *err);

/* Decodes n values from packed codes and per-bucket scales into out[0..n). */
int sparcml_qsgd_dequantize(const uint8_t *packed, const float *scales, int64_t n, int bits, int64_t bucket,
                            float *out, char *err);

/* Ranges, for splitting one vector across threads: the same results as the whole-vector calls
 * for elements [first, first + count). Pointers are to the whole vector's buffers; first must be
 * a multiple of sparcml_qsgd_alignment(bucket, bits) = lcm(bucket, 8 / bits), and so must
 * first + count unless it equals n. Disjoint ranges touch disjoint bytes of every buffer. */
int64_t sparcml_qsgd_alignment(int64_t bucket, int bits);

int sparcml_qsgd_quantize_range(const float *x, int64_t n, int64_t first, int64_t count, int bits, int64_t bucket,
                                int scale_kind, uint32_t key0, uint32_t key1, uint8_t *packed, float *scales,
                                char *err);

int sparcml_qsgd_dequantize_range(const uint8_t *packed, const float *scales, int64_t n, int64_t first,
                                  int64_t count, int bits, int64_t bucket, float *out, char *err);

/* out[i] += the decoded value i, for i in the range: the same float32 additions as decoding into
 * a buffer and adding that, without the buffer (a bucket with a non-finite scale gives NaN). */
int sparcml_qsgd_accumulate_range(const uint8_t *packed, const float *scales, int64_t n, int64_t first,
                                  int64_t count, int bits, int64_t bucket, float *out, char *err);

#ifdef __cplusplus
}
#endif
#endif
