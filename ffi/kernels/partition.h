/* Stream construction from a dense vector, scatter back into one, and SparCML's split phase
 * (the first step of SSAR_Split_allgather and DSAR_Split_allgather, paper §4). */
#ifndef SPARCML_PARTITION_H
#define SPARCML_PARTITION_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The count of x != 0 over x[0..n) (NaN counts, -0.0 does not), as sparcml_from_dense counts;
 * once it reaches limit, the count so far (at least limit, less than limit + 4096). */
int64_t sparcml_count_nonzeros(const float *x, int64_t n, int64_t limit);

/* One pass: the first min(count, out_cap) nonzeros of x as pairs (never the dense form), and
 * the true count, so that callers can detect an overflow collectively instead of failing. */
void sparcml_from_dense_counted(const float *x, int64_t n, int32_t *out_idx, float *out_val, int64_t out_cap,
                                int64_t *out_nnz, int64_t *count);

/* The nonzeros of x[0..n) (x != 0: NaN counts, -0.0 does not) in index order.
 * The result is the dense representation when the count reaches dense_threshold and
 * out_cap >= n. Output tail is padded (see common.h).
 * A count above out_cap does not fail here: the first out_cap nonzeros are kept and *out_nnz is
 * the true count, an invalid stream that every consumer rejects (sparcml_check_stream). A failure
 * here would stop this rank before a collective that its peers have entered; the stream instead
 * reaches the collective's validation, which makes every rank raise. */
void sparcml_from_dense(const float *x, int64_t n, int64_t dense_threshold, int32_t *out_idx, float *out_val,
                        int64_t out_cap, int64_t *out_nnz);

/* The stream of sum_i val[i] e_{idx[i]} over a length-n vector: pairs in any order, duplicate
 * indices summed (in input order), index n marks a pair to drop (padding). Dense representation
 * and capacity as in sparcml_from_dense, counting distinct indices. This is how naturally sparse
 * gradients (embedding rows, sparse features) become streams without a pass over the dense vector.
 * Bad input yields an invalid stream, for the reason given at sparcml_from_dense: more distinct
 * indices than out_cap keep the first out_cap with *out_nnz the true count; an index outside
 * [0, n] becomes the one-pair stream (that index, its value). The return is nonzero (with err)
 * only when scratch memory cannot be had. */
int sparcml_coalesce(const int32_t *idx, const float *val, int64_t m, int64_t n, int64_t dense_threshold,
                     int32_t *out_idx, float *out_val, int64_t out_cap, int64_t *out_nnz, char *err);

/* out = dense + stream over a length-n vector; the stream may be dense (nnz == n).
 * out may equal dense (in place). */
int sparcml_scatter_add(const int32_t *idx, const float *val, int64_t nnz, int64_t cap, const float *dense,
                        int64_t n, float *out, char *err);

/* out = the stream as a length-n vector in one pass over memory: each block of out is zero-filled
 * and then takes its pairs while it is still in cache (a memset of the whole vector followed by a
 * scatter writes it twice). The stream must be valid (see sparcml_check_stream); it may be dense
 * (nnz == n). */
void sparcml_densify(const int32_t *idx, const float *val, int64_t nnz, int64_t n, float *out);

/* sparcml_densify of a stream that is checked first (nonzero on error, message in err). */
int sparcml_to_dense(const int32_t *idx, const float *val, int64_t nnz, int64_t cap, int64_t n, float *out,
                     char *err);

/* The count byte ranges parts[i][0..bytes[i]) laid end to end in out: the fused buffer of a
 * gradient's leaves. One memcpy per leaf, on the calling thread (XLA:CPU emits a concatenation
 * of reshaped leaves element by element, and splits larger loops across its thread pool). */
void sparcml_pack(const void *const *parts, const int64_t *bytes, int64_t count, void *out);

/* The inverse of sparcml_pack: in cut into the count ranges parts[i][0..bytes[i]). */
void sparcml_unpack(const void *in, void *const *parts, const int64_t *bytes, int64_t count);

/* The stream (over a length-n vector, n = sum of sizes) written as the count consecutive
 * pieces parts[i][0..sizes[i]): sparcml_densify into the leaves themselves, without the
 * length-n vector in between. The stream is checked first (nonzero on error, message in err). */
int sparcml_to_dense_parts(const int32_t *idx, const float *val, int64_t nnz, int64_t cap, int64_t n,
                           float *const *parts, const int64_t *sizes, int64_t count, char *err);

/* First index of part r when [0, n) is split into parts ranges: part r covers
 * [r * (n / parts), (r + 1) * (n / parts)), the last part also takes the remainder.
 * Defined for 0 <= r <= parts (r == parts gives n). */
int64_t sparcml_part_start(int64_t n, int64_t parts, int64_t r);

/* offsets[0..parts] into the stream's pairs: pairs offsets[r]..offsets[r+1] fall in part r
 * (see sparcml_part_start). For a dense stream the offsets equal the part bounds. */
int sparcml_split(const int32_t *idx, int64_t nnz, int64_t cap, int64_t n, int64_t parts, int32_t *offsets,
                  char *err);

/* The stream of pairs (indices[i], dense[indices[i]]) for i < nnz, in buffers of capacity cap.
 * indices must be a valid stream support (sorted, unique, in [0, n)); nnz == n gives the
 * dense representation. Output tail is padded. */
int sparcml_gather(const float *dense, int64_t n, const int32_t *indices, int64_t nnz, int64_t cap,
                   int32_t *out_idx, float *out_val, char *err);

#ifdef __cplusplus
}
#endif
#endif
