/* Shared conventions of the SparCML kernels.
 *
 * A stream is a count plus sorted (index, value) pairs in buffers of a fixed capacity:
 *   indices[0..nnz) strictly increasing in [0, n), values[0..nnz) the matching values,
 *   tail [nnz, capacity) padded with index n and value 0 so that buffers are deterministic.
 * A stream with nnz == n is the dense representation: indices are 0..n-1, values[i] is entry i.
 *
 * Kernels return 0 on success, or non-zero after writing a message naming the bad argument
 * into err (callers supply SPARCML_ERRLEN bytes). They never abort. */
#ifndef SPARCML_COMMON_H
#define SPARCML_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SPARCML_ERRLEN 256

/* Fills the tail [nnz, capacity) with index n and value 0. */
void sparcml_pad_tail(int32_t *indices, float *values, int64_t nnz, int64_t capacity, int64_t n);

/* Checks 0 <= nnz <= capacity, indices strictly increasing and inside [0, n). A negative
 * capacity marks a stream without indices whose nnz is not n (such a stream must be dense).
 * name is the argument's name used in the message. */
int sparcml_check_stream(const char *name, const int32_t *indices, int64_t nnz, int64_t capacity,
                         int64_t n, char *err);

#ifdef __cplusplus
}
#endif
#endif
