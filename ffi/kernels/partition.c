#include "partition.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void iota_i32(int32_t *idx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) idx[i] = (int32_t)i;
}

/* Gradients are mostly zeros: a block of them is skipped with one test on the OR of their bits
 * without the sign (x != 0 exactly when those bits are not all zero, NaN included), which the
 * compiler turns into a few vector ORs; the emission loop cannot be vectorized. */
enum { ZERO_BLOCK = 32 };

static int all_zero(const float *x) {
  uint32_t bits[ZERO_BLOCK], any = 0;
  memcpy(bits, x, sizeof bits);
  for (int j = 0; j < ZERO_BLOCK; ++j) any |= bits[j];
  return (any & 0x7fffffffu) == 0;
}

/* Appends the nonzeros of x[*from..n) as pairs at out[o..cap), advancing *from past what it read. */
static int64_t append_nonzeros(const float *x, int64_t n, int64_t *from, int32_t *out_idx, float *out_val,
                               int64_t o, int64_t cap) {
  int64_t i = *from;
  while (i < n && o < cap) {
    if (i + ZERO_BLOCK <= n && all_zero(x + i)) {
      i += ZERO_BLOCK;
      continue;
    }
    int64_t end = i + ZERO_BLOCK < n ? i + ZERO_BLOCK : n;
    for (; i < end && o < cap; ++i) {
      if (x[i] != 0.0f) {
        out_idx[o] = (int32_t)i;
        out_val[o++] = x[i];
      }
    }
  }
  *from = i;
  return o;
}

int64_t sparcml_count_nonzeros(const float *x, int64_t n, int64_t limit) {
  /* Branch-free inside a block, so that it vectorizes; a count that reached the limit (the dense
   * threshold: the representation is decided) stops reading. */
  enum { COUNT_BLOCK = 4096 };
  int64_t count = 0;
  for (int64_t start = 0; start < n && count < limit; start += COUNT_BLOCK) {
    int64_t end = start + COUNT_BLOCK < n ? start + COUNT_BLOCK : n;
    for (int64_t i = start; i < end; ++i) count += x[i] != 0.0f;
  }
  return count;
}

void sparcml_from_dense(const float *x, int64_t n, int64_t dense_threshold, int32_t *out_idx, float *out_val,
                        int64_t out_cap, int64_t *out_nnz) {
  /* Counting first decides the representation before anything is written. */
  int64_t count = sparcml_count_nonzeros(x, n, INT64_MAX);

  if (count >= dense_threshold && out_cap >= n) {
    if (n > 0) memcpy(out_val, x, (size_t)n * sizeof(float));
    iota_i32(out_idx, n);
    sparcml_pad_tail(out_idx, out_val, n, out_cap, n);
    *out_nnz = n;
    return;
  }
  int64_t from = 0, kept = count < out_cap ? count : out_cap;
  append_nonzeros(x, n, &from, out_idx, out_val, 0, kept);
  sparcml_pad_tail(out_idx, out_val, kept, out_cap, n);
  *out_nnz = count;
}

void sparcml_from_dense_counted(const float *x, int64_t n, int32_t *out_idx, float *out_val, int64_t out_cap,
                                int64_t *out_nnz, int64_t *count) {
  int64_t i = 0;
  int64_t o = append_nonzeros(x, n, &i, out_idx, out_val, 0, out_cap);
  int64_t rest = 0;
  for (; i < n; ++i) rest += x[i] != 0.0f;
  sparcml_pad_tail(out_idx, out_val, o, out_cap, n);
  *out_nnz = o;
  *count = o + rest;
}

/* Stable LSD radix sort of (key, val) by key in [0, n), 11-bit digits, only as many as n needs.
 * key_tmp and val_tmp hold m entries of scratch; the result ends in key and val. */
static void radix_sort_pairs(int32_t *key, float *val, int32_t *key_tmp, float *val_tmp, int64_t m, int64_t n) {
  enum { DIGIT_BITS = 11, BUCKETS = 1 << DIGIT_BITS };
  int32_t *key_in = key, *key_out = key_tmp;
  float *val_in = val, *val_out = val_tmp;
  for (int shift = 0; shift < 32 && ((n - 1) >> shift) > 0; shift += DIGIT_BITS) {
    int64_t start[BUCKETS] = {0};
    for (int64_t i = 0; i < m; ++i) start[(key_in[i] >> shift) & (BUCKETS - 1)]++;
    int64_t offset = 0;
    for (int b = 0; b < BUCKETS; ++b) {
      int64_t count = start[b];
      start[b] = offset;
      offset += count;
    }
    for (int64_t i = 0; i < m; ++i) {
      int64_t o = start[(key_in[i] >> shift) & (BUCKETS - 1)]++;
      key_out[o] = key_in[i];
      val_out[o] = val_in[i];
    }
    int32_t *k = key_in; key_in = key_out; key_out = k;
    float *v = val_in; val_in = val_out; val_out = v;
  }
  if (key_in != key && m > 0) {
    memcpy(key, key_in, (size_t)m * sizeof(int32_t));
    memcpy(val, val_in, (size_t)m * sizeof(float));
  }
}

int sparcml_coalesce(const int32_t *idx, const float *val, int64_t m, int64_t n, int64_t dense_threshold,
                     int32_t *out_idx, float *out_val, int64_t out_cap, int64_t *out_nnz, char *err) {
  int64_t kept = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (idx[i] < 0 || idx[i] > n) {
      if (out_cap > 0) {
        out_idx[0] = idx[i];
        out_val[0] = val[i];
      }
      sparcml_pad_tail(out_idx, out_val, 1, out_cap, n);
      *out_nnz = 1;
      return 0;
    }
    kept += idx[i] < n;
  }
  int32_t *key = malloc((size_t)(2 * kept + 1) * sizeof(int32_t));
  float *sum = malloc((size_t)(2 * kept + 1) * sizeof(float));
  if (key == NULL || sum == NULL) {
    free(key);
    free(sum);
    snprintf(err, SPARCML_ERRLEN, "coalesce: out of memory for %lld pairs of scratch", (long long)kept);
    return 1;
  }
  for (int64_t i = 0, o = 0; i < m; ++i) {
    if (idx[i] < n) {
      key[o] = idx[i];
      sum[o++] = val[i];
    }
  }
  radix_sort_pairs(key, sum, key + kept, sum + kept, kept, n);
  int64_t distinct = 0;
  for (int64_t i = 0; i < kept; ++i) {
    if (distinct > 0 && key[distinct - 1] == key[i]) {
      sum[distinct - 1] += sum[i];
    } else {
      key[distinct] = key[i];
      sum[distinct++] = sum[i];
    }
  }
  if (distinct >= dense_threshold && out_cap >= n) {
    if (n > 0) memset(out_val, 0, (size_t)n * sizeof(float));
    for (int64_t j = 0; j < distinct; ++j) out_val[key[j]] = sum[j];
    iota_i32(out_idx, n);
    sparcml_pad_tail(out_idx, out_val, n, out_cap, n);
    *out_nnz = n;
  } else {
    int64_t stored = distinct < out_cap ? distinct : out_cap;
    if (stored > 0) {
      memcpy(out_idx, key, (size_t)stored * sizeof(int32_t));
      memcpy(out_val, sum, (size_t)stored * sizeof(float));
    }
    sparcml_pad_tail(out_idx, out_val, stored, out_cap, n);
    *out_nnz = distinct;
  }
  free(key);
  free(sum);
  return 0;
}

int sparcml_scatter_add(const int32_t *idx, const float *val, int64_t nnz, int64_t cap, const float *dense,
                        int64_t n, float *out, char *err) {
  if (sparcml_check_stream("stream", idx, nnz, cap, n, err)) return 1;
  if (nnz == n) {
    for (int64_t i = 0; i < n; ++i) out[i] = dense[i] + val[i];
    return 0;
  }
  if (out != dense && n > 0) memcpy(out, dense, (size_t)n * sizeof(float));
  for (int64_t j = 0; j < nnz; ++j) out[idx[j]] += val[j];
  return 0;
}

int sparcml_to_dense(const int32_t *idx, const float *val, int64_t nnz, int64_t cap, int64_t n, float *out,
                     char *err) {
  if (sparcml_check_stream("stream", idx, nnz, cap, n, err)) return 1;
  sparcml_densify(idx, val, nnz, n, out);
  return 0;
}

/* out[0..n) = the pairs' values at idx - lo, zeros elsewhere (every idx in [lo, lo + n)). */
static void densify_range(const int32_t *idx, const float *val, int64_t nnz, int64_t lo, int64_t n, float *out) {
  enum { BLOCK = 4096 }; /* floats: a block stays in L1 between its zero-fill and its scatter */
  int64_t j = 0;
  for (int64_t at = 0; at < n; at += BLOCK) {
    int64_t hi = at + BLOCK < n ? at + BLOCK : n;
    memset(out + at, 0, (size_t)(hi - at) * sizeof(float));
    for (; j < nnz && idx[j] - lo < hi; ++j) out[idx[j] - lo] = val[j];
  }
}

void sparcml_densify(const int32_t *idx, const float *val, int64_t nnz, int64_t n, float *out) {
  if (nnz == n) {
    if (n > 0 && out != val) memcpy(out, val, (size_t)n * sizeof(float));
    return;
  }
  densify_range(idx, val, nnz, 0, n, out);
}

void sparcml_pack(const void *const *parts, const int64_t *bytes, int64_t count, void *out) {
  char *at = out;
  for (int64_t i = 0; i < count; ++i) {
    if (bytes[i] > 0) memcpy(at, parts[i], (size_t)bytes[i]);
    at += bytes[i];
  }
}

void sparcml_unpack(const void *in, void *const *parts, const int64_t *bytes, int64_t count) {
  const char *at = in;
  for (int64_t i = 0; i < count; ++i) {
    if (bytes[i] > 0) memcpy(parts[i], at, (size_t)bytes[i]);
    at += bytes[i];
  }
}

int sparcml_to_dense_parts(const int32_t *idx, const float *val, int64_t nnz, int64_t cap, int64_t n,
                           float *const *parts, const int64_t *sizes, int64_t count, char *err) {
  if (sparcml_check_stream("stream", idx, nnz, cap, n, err)) return 1;
  int64_t lo = 0, j = 0;
  for (int64_t i = 0; i < count; lo += sizes[i], ++i) {
    if (nnz == n) {
      if (sizes[i] > 0) memcpy(parts[i], val + lo, (size_t)sizes[i] * sizeof(float));
      continue;
    }
    int64_t first = j; /* idx is sorted: this piece's pairs are the next run */
    while (j < nnz && idx[j] < lo + sizes[i]) ++j;
    densify_range(idx + first, val + first, j - first, lo, sizes[i], parts[i]);
  }
  return 0;
}

int64_t sparcml_part_start(int64_t n, int64_t parts, int64_t r) { return r >= parts ? n : r * (n / parts); }

/* First position in idx[lo..hi) whose index is >= key (idx sorted). */
static int64_t lower_bound(const int32_t *idx, int64_t lo, int64_t hi, int64_t key) {
  while (lo < hi) {
    int64_t mid = lo + (hi - lo) / 2;
    if (idx[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

int sparcml_split(const int32_t *idx, int64_t nnz, int64_t cap, int64_t n, int64_t parts, int32_t *offsets,
                  char *err) {
  if (parts < 1) {
    snprintf(err, SPARCML_ERRLEN, "split: parts must be >= 1, got %lld", (long long)parts);
    return 1;
  }
  if (sparcml_check_stream("stream", idx, nnz, cap, n, err)) return 1;
  offsets[0] = 0;
  if (nnz == n) { /* dense: pair i is entry i */
    for (int64_t r = 1; r <= parts; ++r) offsets[r] = (int32_t)sparcml_part_start(n, parts, r);
    return 0;
  }
  int64_t lo = 0;
  for (int64_t r = 1; r < parts; ++r) {
    lo = lower_bound(idx, lo, nnz, sparcml_part_start(n, parts, r));
    offsets[r] = (int32_t)lo;
  }
  offsets[parts] = (int32_t)nnz;
  return 0;
}

int sparcml_gather(const float *dense, int64_t n, const int32_t *indices, int64_t nnz, int64_t cap,
                   int32_t *out_idx, float *out_val, char *err) {
  if (sparcml_check_stream("indices", indices, nnz, cap, n, err)) return 1;
  if (nnz == n) {
    if (n > 0) memcpy(out_val, dense, (size_t)n * sizeof(float));
    iota_i32(out_idx, n);
  } else {
    for (int64_t j = 0; j < nnz; ++j) {
      out_idx[j] = indices[j];
      out_val[j] = dense[indices[j]];
    }
  }
  sparcml_pad_tail(out_idx, out_val, nnz, cap, n);
  return 0;
}
