/*
 * dist_overlap.h — reducing a step's gradients over the ranks while backward still runs (docs/distributed.md,
 * "Overlap"), as PyTorch DDP's gradient buckets do.
 *
 * On the last micro-batch of a step, the flat gradient buffer (model.h, grad_flat) is reduced in buckets:
 * contiguous ranges of it, each covering whole parameters, taken from its end (the last layers, whose backward
 * finishes first) to its start. A bucket holds at least dist.bucket_mb MiB of fp32 gradients, or what is left
 * (a parameter is never split: one larger than that is a bucket of its own); the first holds at least
 * min(1 MiB, dist.bucket_mb), PyTorch's first bucket, so that the first reduce starts after the last layer or
 * two rather than after a quarter of the backward. The buckets cover grad_flat exactly once, padding included.
 *
 * The backward tells the hook (layer.h, struct backward_hook, through step_ctx.hook) each time the gradients from a
 * parameter's to grad_flat's end are final: after each layer, and inside a transformer block after each of its
 * linears and ln2; the hook starts every bucket that then lies wholly in the final part (comm.h, reduce_start) and
 * lets the started ones progress (reduce_progress). dist_overlap_finish, right after backward, waits for what is
 * still in flight; on GPUs it only orders the backend's stream after the reduces (no host wait).
 *
 * Each element of grad_flat is still summed over the ranks exactly once, elementwise, in rank order whatever the
 * bucket (comm.h, the association): the bits equal dist.bucket_mb 0's (one reduce after backward) at any world size,
 * and N ranks' equal one rank's with N micro-batches.
 *
 * It uses the communicator (comm.h) and the dist binding (dist.h) only; the model (model.h) only for the layout
 * of grad_flat and the hook's type.
 */
#ifndef AMP_DIST_OVERLAP_H
#define AMP_DIST_OVERLAP_H

#include <stdbool.h>

#include "dist.h"  /* struct dist */
#include "error.h" /* enum amp_status, struct amp_error */
#include "model.h" /* struct model, struct backward_hook (layer.h) */

/* PyTorch DDP's first bucket: 1 MiB (or dist.bucket_mb where that is smaller). */
#define DIST_FIRST_BUCKET_MB 1.0

struct dist_overlap;

/* The buckets of m's gradients for d, or *out NULL where nothing overlaps and the trainer reduces grad_flat after
 * backward as before: bucket_mb 0, d not reducing (one rank), reducing through the host staging buffer (a CUDA
 * backend with the mpi transport), a communicator without a non-blocking reduce, or no gradients. */
enum amp_status dist_overlap_new(struct dist_overlap **out, struct dist *d, const struct model *m, double bucket_mb,
                                 struct amp_error *err);
void dist_overlap_free(struct dist_overlap *o);

/* The hook for the backward of a step's last micro-batch (step_ctx.hook); NULL where o is NULL. */
const struct backward_hook *dist_overlap_hook(struct dist_overlap *o);

/* After that backward: starts any bucket not started yet, then waits for every started one. Returns whether the
 * gradients were reduced here: false where o is NULL (the caller reduces grad_flat itself). */
bool dist_overlap_finish(struct dist_overlap *o);

/* From now on each bucket i is reduce-scattered only, onto the blocks bounds[i (world + 1) ..] (comm.h,
 * reduce_scatter_start; relative to the bucket's start), with no all-gather after it (dist.zero 1's exact partial
 * statistics, lib/engine/zero.h). bounds stays the caller's. */
void dist_overlap_scatter_only(struct dist_overlap *o, const size_t *bounds, int world);

/* The number of buckets a step reduces (0 where o is NULL), and bucket i's range of grad_flat in floats. */
int dist_overlap_buckets(const struct dist_overlap *o);
void dist_overlap_bucket(const struct dist_overlap *o, int i, size_t *begin, size_t *end);

#endif
