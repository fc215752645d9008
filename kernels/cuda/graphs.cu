/*
 * graphs.cu — window_store, the op that ends every training step: the step's log row and counts, written at one
 * fixed place, filed into the log window at the slot kept in device memory (backend.h struct window_store_args).
 */
#include "backend_cuda_internal.h"

/* ---- window_store ------------------------------------------------------------------------------------------ */

/* One block: the row by thread 0 (a struct copy), the counts grid-strided over the block, then, after every thread
 * has read the row, its zeroing and the slot's advance by thread 0. */
__global__ void window_store_kernel(struct step_row *row, const int64_t *counts, struct step_row *rows,
                                    int64_t *window_counts, int64_t ncounts, int64_t *slot)
{
    int64_t s = *slot;
    if (threadIdx.x == 0)
        rows[s] = *row;
    for (int64_t i = threadIdx.x; i < ncounts; i += blockDim.x)
        window_counts[s * ncounts + i] = counts[i];
    __syncthreads(); /* every thread read *slot and thread 0 the row before either changes */
    if (threadIdx.x == 0) {
        memset(row, 0, sizeof *row);
        *slot = s + 1;
    }
}

void cuda_window_store(struct backend *be, const struct window_store_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    window_store_kernel<<<1, kThreads, 0, cb->stream>>>(a->row, a->counts, a->rows, a->window_counts, a->ncounts,
                                                        a->slot);
    CB_LAUNCHED(cb, "window_store_kernel");
}
