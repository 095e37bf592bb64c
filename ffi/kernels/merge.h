/* Merge-sum of two streams: the reduction step of every SSAR/DSAR algorithm (SparCML §4). */
#ifndef SPARCML_MERGE_H
#define SPARCML_MERGE_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out = a + b over a length-n vector. Either input may be dense (nnz == n).
 * The result switches to the dense representation when its actual count reaches
 * dense_threshold and the output capacity can hold n values; otherwise it stays sparse.
 * Output tail is padded (see common.h). A union larger than out_cap is not an error here (see
 * sparcml_from_dense): the first out_cap pairs are stored and *out_nnz is the true count, an
 * invalid stream that every consumer rejects. The return is nonzero (with err) for invalid inputs. */
int sparcml_merge(const int32_t *a_idx, const float *a_val, int64_t a_nnz, int64_t a_cap,
                  const int32_t *b_idx, const float *b_val, int64_t b_nnz, int64_t b_cap,
                  int64_t n, int64_t dense_threshold,
                  int32_t *out_idx, float *out_val, int64_t out_cap, int64_t *out_nnz, char *err);

/* Rewrites a sparse stream held in buffers of capacity >= n into the dense representation,
 * in place. */
void sparcml_densify_inplace(int32_t *idx, float *val, int64_t nnz, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
