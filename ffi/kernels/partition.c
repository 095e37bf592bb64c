#include "partition.h"

#include <stdio.h>
#include <string.h>

static void iota_i32(int32_t *idx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) idx[i] = (int32_t)i;
}

int sparcml_from_dense(const float *x, int64_t n, int64_t dense_threshold, int32_t *out_idx, float *out_val,
                       int64_t out_cap, int64_t *out_nnz, char *err) {
  /* Counting first keeps this pass branch-free (vectorizable) and lets us fail before writing. */
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += x[i] != 0.0f;

  if (count >= dense_threshold && out_cap >= n) {
    if (n > 0) memcpy(out_val, x, (size_t)n * sizeof(float));
    iota_i32(out_idx, n);
    sparcml_pad_tail(out_idx, out_val, n, out_cap, n);
    *out_nnz = n;
    return 0;
  }
  if (count > out_cap) {
    snprintf(err, SPARCML_ERRLEN, "from_dense: x has %lld nonzeros but capacity is %lld; pass a larger capacity",
             (long long)count, (long long)out_cap);
    return 1;
  }
  int64_t o = 0;
  for (int64_t i = 0; o < count; ++i) {
    if (x[i] != 0.0f) {
      out_idx[o] = (int32_t)i;
      out_val[o++] = x[i];
    }
  }
  sparcml_pad_tail(out_idx, out_val, count, out_cap, n);
  *out_nnz = count;
  return 0;
}

void sparcml_from_dense_counted(const float *x, int64_t n, int32_t *out_idx, float *out_val, int64_t out_cap,
                                int64_t *out_nnz, int64_t *count) {
  int64_t o = 0, i = 0;
  for (; i < n && o < out_cap; ++i) {
    if (x[i] != 0.0f) {
      out_idx[o] = (int32_t)i;
      out_val[o++] = x[i];
    }
  }
  int64_t rest = 0;
  for (; i < n; ++i) rest += x[i] != 0.0f;
  sparcml_pad_tail(out_idx, out_val, o, out_cap, n);
  *out_nnz = o;
  *count = o + rest;
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
