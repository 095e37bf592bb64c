/* Top-k magnitude selection: the sparsifier in front of every sparse collective
 * (SparCML §5, top-k sparsification with error feedback). */
#ifndef SPARCML_TOPK_H
#define SPARCML_TOPK_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the k entries of x[0..n) of largest magnitude, sorted by index:
 * out_idx[0..k) strictly increasing, out_val[j] = x[out_idx[j]] (the original signed value).
 *
 * Magnitude order is the order of the uint32 key  bits(x) & 0x7fffffff,  so
 *   -0.0 ties with 0.0, +-inf rank above every finite value, and NaN ranks above +-inf:
 *   NaN entries are selected before any number (a NaN gradient is sent, not hidden); NaNs
 *   among themselves rank by payload bits.
 * Ties are exact and deterministic: among equal keys the lower index wins.
 *
 * Radix selection, never a sort: histograms of the key bits locate the exact threshold key, and
 * one scan in index order emits the entries above it plus the lowest-index ties. x is read about
 * once when a sampled guess of the threshold holds (typical gradients), a few times otherwise.
 * Extra memory: 0.5 MB of histograms and a candidate buffer of about k (at most n/4) entries.
 * Requires 0 <= k <= n <= INT32_MAX; returns non-zero with a message in err otherwise. */
int sparcml_topk(const float *x, int64_t n, int64_t k, int32_t *out_idx, float *out_val, char *err);

#ifdef __cplusplus
}
#endif
#endif
