#include "merge.h"

#include <stdio.h>
#include <string.h>

void sparcml_densify_inplace(int32_t *idx, float *val, int64_t nnz, int64_t n) {
  /* idx[j] >= j for a sorted unique stream, so walking backwards never overwrites an unread pair. */
  int64_t hole_end = n;
  for (int64_t j = nnz - 1; j >= 0; --j) {
    int64_t at = idx[j];
    float v = val[j];
    if (hole_end > at + 1) memset(val + at + 1, 0, (size_t)(hole_end - at - 1) * sizeof(float));
    val[at] = v;
    hole_end = at;
  }
  if (hole_end > 0) memset(val, 0, (size_t)hole_end * sizeof(float));
  for (int64_t i = 0; i < n; ++i) idx[i] = (int32_t)i;
}

static void add_sparse_into_dense(const int32_t *idx, const float *val, int64_t nnz, float *dense) {
  for (int64_t j = 0; j < nnz; ++j) dense[idx[j]] += val[j];
}

static int64_t merge_sparse(const int32_t *ai, const float *av, int64_t an, const int32_t *bi,
                            const float *bv, int64_t bn, int32_t *oi, float *ov, int64_t out_cap) {
  int64_t i = 0, j = 0, o = 0;
  while (i < an && j < bn) {
    if (o == out_cap) return -1;
    if (ai[i] < bi[j]) {
      oi[o] = ai[i]; ov[o++] = av[i++];
    } else if (bi[j] < ai[i]) {
      oi[o] = bi[j]; ov[o++] = bv[j++];
    } else {
      oi[o] = ai[i]; ov[o++] = av[i++] + bv[j++];
    }
  }
  int64_t rest_a = an - i, rest_b = bn - j;
  if (o + rest_a + rest_b > out_cap) return -1;
  memcpy(oi + o, ai + i, (size_t)rest_a * sizeof(int32_t));
  memcpy(ov + o, av + i, (size_t)rest_a * sizeof(float));
  o += rest_a;
  memcpy(oi + o, bi + j, (size_t)rest_b * sizeof(int32_t));
  memcpy(ov + o, bv + j, (size_t)rest_b * sizeof(float));
  return o + rest_b;
}

int sparcml_merge(const int32_t *a_idx, const float *a_val, int64_t a_nnz, int64_t a_cap,
                  const int32_t *b_idx, const float *b_val, int64_t b_nnz, int64_t b_cap,
                  int64_t n, int64_t dense_threshold,
                  int32_t *out_idx, float *out_val, int64_t out_cap, int64_t *out_nnz, char *err) {
  if (sparcml_check_stream("a", a_idx, a_nnz, a_cap, n, err)) return 1;
  if (sparcml_check_stream("b", b_idx, b_nnz, b_cap, n, err)) return 1;
  int a_dense = a_nnz == n, b_dense = b_nnz == n;

  if (a_dense || b_dense) {
    if (out_cap < n) {
      snprintf(err, SPARCML_ERRLEN, "merge: a dense input needs out_capacity >= n=%lld, got %lld",
               (long long)n, (long long)out_cap);
      return 1;
    }
    const float *dense = a_dense ? a_val : b_val;
    const int32_t *other_idx = a_dense ? b_idx : a_idx;
    const float *other_val = a_dense ? b_val : a_val;
    int64_t other_nnz = a_dense ? b_nnz : a_nnz;
    if (other_nnz == n) {
      for (int64_t i = 0; i < n; ++i) out_val[i] = dense[i] + other_val[i];
    } else {
      memcpy(out_val, dense, (size_t)n * sizeof(float));
      add_sparse_into_dense(other_idx, other_val, other_nnz, out_val);
    }
    for (int64_t i = 0; i < n; ++i) out_idx[i] = (int32_t)i;
    sparcml_pad_tail(out_idx, out_val, n, out_cap, n);
    *out_nnz = n;
    return 0;
  }

  int64_t count = merge_sparse(a_idx, a_val, a_nnz, b_idx, b_val, b_nnz, out_idx, out_val, out_cap);
  if (count < 0) {
    snprintf(err, SPARCML_ERRLEN,
             "merge: the union of a (nnz=%lld) and b (nnz=%lld) exceeds out_capacity=%lld; raise the capacity",
             (long long)a_nnz, (long long)b_nnz, (long long)out_cap);
    return 1;
  }
  if (count >= dense_threshold && out_cap >= n) {
    sparcml_densify_inplace(out_idx, out_val, count, n);
    count = n;
  }
  sparcml_pad_tail(out_idx, out_val, count, out_cap, n);
  *out_nnz = count;
  return 0;
}
