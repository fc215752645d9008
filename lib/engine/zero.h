/*
 * zero.h — ZeRO stage 1 (dist.zero: 1, docs/distributed.md "ZeRO-1"): the optimizer's moments sharded over the
 * ranks.
 *
 * One partition (struct zero_plan) decides which elements each rank reduces, holds and updates. Where the backend
 * reports partial gradient statistics (backend.h, grad_stats_parts: the CPU's and CUDA's) and the communicator has
 * collectives on blocks (comm.h: mpi on host memory, through a host copy for a CUDA backend, and nccl on device
 * memory), each bucket of the flat gradient buffer (dist_overlap.h; one bucket, the whole buffer, with dist.bucket_mb
 * 0) is cut into N contiguous blocks at the boundaries of the statistics' parts (a part: grad_part_numel elements of a
 * parameter from its start, the last part of a tensor shorter), balanced by elements; rank r owns block r of every
 * bucket, and its block of a parameter is that parameter's intersection with it (a whole tensor, a range of whole
 * parts, or nothing: any size works). Elsewhere (a backend without parts) a parameter's blocks are comm_shard's,
 * ceil(numel / N) elements in rank order. Rank r holds AdamW's m and v (SGD's momentum buffer) for its block of every
 * parameter only (lib/engine/optim.h, optim_create_sharded) and updates only that block of the weights and their
 * low-precision copy. Where the ops read only the copy, the master itself is sharded too (zero_shard_masters:
 * param.master_block), and the step gathers the copies' blocks alone; where the ops read the master (fp32 mode, fp32
 * biases and norm gains, embedding tables, fp8 and tied weights) it stays whole and its blocks are gathered too.
 *
 * The step (zero_reduce_gradients, zero_grad_stats), exact partial statistics: the gradients are only reduce-scattered
 * onto the blocks (comm.h, reduce_scatter_blocks and reduce_scatter_start: each element summed in rank order, as at
 * dist.zero 0; NCCL's order with nccl), each rank computes the statistics of the parts it owns (the squares' sums in
 * double, the max magnitude, the Inf and NaN counts: 88 bytes a part), the parts' results are all-gathered (in backend
 * memory: on GPUs they never reach the host with nccl), and every rank combines all of them in part order with the code
 * grad_stats runs (grad_stats_combine, reading each part where the all-gather left it). So the sum of squares, the max,
 * the overflow verdict and the per-tensor counts have the bits of dist.zero 0 on the same backend, and skips, the loss
 * scale and the clip coefficient with them; the gradients themselves are never all-gathered. Where the parts do not
 * apply (a backend without them; run.numerics_every, whose probe reads rank 0's whole reduced gradient) the reduce is
 * dist.zero 0's all-reduce and the statistics grad_stats over the whole gradient. What else differs is combined
 * exactly:
 *  - the trial of an update (step_rule_propose's check) runs on each rank's block; its verdict, the smallest
 *    parameter index whose update would store a non-finite value, is the minimum over the ranks
 *    (zero_after_trial): the index one rank trying every element finds;
 *  - the bound on the optimizer state (struct state_bound) each rank raises over its block is the maximum over
 *    the ranks (zero_after_update): the bound one rank storing every element raises;
 *  - AdamW updates each element from its own values alone, and stochastic rounding draws by the element's index
 *    in the parameter (optim_update_args.sr_offset), so a block updates to the bits the whole tensor would.
 * Checkpoints hold the whole state, as at dist.zero 0 (zero_gather_begin gathers the moments and the sharded masters
 * to rank 0 for a save; zero_load_begin/end give each rank its block of loaded moments; the masters are loaded whole
 * and sharded afterwards), so a checkpoint resumes at any world size and with either dist.zero.
 *
 * Every function here is a collective where the optimizer is sharded and a no-op (or dist.zero 0's step) where it is
 * not.
 */
#ifndef AMP_ZERO_H
#define AMP_ZERO_H

#include "dist.h"         /* struct dist */
#include "dist_overlap.h" /* struct dist_overlap: the buckets the partition cuts */
#include "model.h"        /* struct model */
#include "optim.h"        /* struct optimizer */

/* dist.zero 1's partition (above) and the buffers of its step. */
struct zero_plan {
    bool sharded;         /* dist.zero 1 over several ranks: the rest is meaningful */
    bool aligned;         /* the blocks lie on the statistics' parts (else comm_shard's) */
    bool exact;           /* aligned, and the step reduce-scatters and combines the parts: no gradient all-gather */
    int world, rank;
    int nbuckets;         /* the gradients' buckets (dist_overlap's order; without it one, the whole grad_flat): */
    size_t *bucket_at;    /* bucket i starts at float bucket_at[i] of grad_flat, and its blocks are */
    size_t *buckets;      /* buckets[i (world + 1) ..] (comm.h's bounds: from 0 to the bucket's length) */
    size_t *blocks;       /* nparams x (world + 1): parameter i's rank q block is [blocks[i (world + 1) + q], .. + 1) */
    int nparams;
    /* exact: the step's statistics */
    struct backend *be;   /* whose memory `gathered` is */
    int64_t *first;       /* nparams + 1: parameter i's parts are parts first[i] .. first[i + 1] - 1 */
    struct grad_part *gathered; /* the ranks' parts, rank by rank: the all-gather's buffer (backend memory) */
    struct grad_part *staged; /* its host copy where the communicator takes host memory and the backend's is a
                               * device's (d->stage); NULL otherwise */
    size_t *part_bounds;  /* world + 1: each rank's parts in `gathered` */
    int64_t *at;          /* part c (parameter and part order) is gathered[at[c]] */
    struct tensor *views; /* this rank's block of each parameter's gradient */
    const struct tensor **view_ptrs;
};

/* The partition for d and m: dist.zero `zero` (0 or 1) over d's ranks, the gradients' buckets o (NULL: one, the
 * whole grad_flat). The blocks of a bucket are balanced by what a rank holds for its elements: two moments each, and
 * the master of those that zero_shard_masters will shard (`masters_sharded`: it will run). `whole_gradient`: a
 * reader of the whole reduced gradient (run.numerics_every) keeps the all-gather. Not sharded (dist.zero 0, one
 * rank): z->sharded false, nothing allocated. Also tells o to reduce-scatter only, where the plan is exact.
 * AMP_ERR_INTERNAL out of memory. Not a collective. */
enum amp_status zero_plan_init(struct zero_plan *z, struct dist *d, const struct model *m, struct dist_overlap *o,
                               int zero, bool whole_gradient, bool masters_sharded, struct amp_error *err);
void zero_plan_free(struct zero_plan *z);

/* The step's gradient reduce where the buckets did not make it during backward: exact, the reduce-scatter onto the
 * blocks; otherwise dist_reduce_sum of grad_flat (dist.zero 0's). */
void zero_reduce_gradients(struct zero_plan *z, struct dist *d, struct model *m);

/* The step's gradient statistics (backend->grad_stats' contract) of the reduced gradients: exact, this rank's parts,
 * all-gathered and combined; otherwise grad_stats over grads. */
void zero_grad_stats(struct zero_plan *z, struct dist *d, const struct tensor *const *grads, int n,
                     struct grad_check *out, int64_t *counts);

/* After the trial updates (optim_step with a trial): check->update_nonfinite (backend memory) becomes the
 * smallest nonzero value of any rank's, 0 where none has one. */
void zero_after_trial(struct dist *d, const struct optimizer *o, struct grad_check *check);

/* After the update: every rank's block of every parameter's weights and copy to every rank, and the state's bound
 * (backend memory) the maximum over the ranks. */
void zero_after_update(struct dist *d, const struct optimizer *o, struct model *m, struct state_bound *bound);

/* Once the weights are set (initialised, read by model.init_from or from a resumed checkpoint) and before the first
 * step: every parameter whose ops read only its copy (param_master_private: the low-precision copy of a bf16, fp16
 * or bf16-kept fp8 product's weight; the fp32 copy of a bf16 master) keeps only this rank's block of its master
 * (param.master_block), the whole one freed. The others stay whole on every rank: the ops read them (all of them in
 * fp32, where the masters are the weights; fp32 biases, norm gains and embedding tables; fp8 products' and tied
 * weights). AMP_ERR_INTERNAL out of memory. Not a collective: every rank shards the same parameters. */
enum amp_status zero_shard_masters(struct optimizer *o, struct model *m, struct amp_error *err);

/* The sharded blocks set aside while the optimizer holds whole-size moments (for a save or a load), and for a save
 * the sharded masters' blocks while the parameters hold the whole masters. */
struct zero_swap {
    struct optim_state *shards; /* NULL: nothing set aside */
    struct tensor *masters;     /* a save: per parameter, its master's block where it was sharded (data NULL if not) */
    struct model *model;
    int n;
};

/* Before rank 0 saves a checkpoint: on rank 0 the optimizer's moments and the sharded masters become whole-size
 * tensors gathered from every rank's block, its own set aside in *sw; the other ranks send theirs and keep them. AMP_ERR_INTERNAL on rank 0
 * where the whole tensors cannot be allocated (the gathers are still made; the save must not run). */
enum amp_status zero_gather_begin(struct dist *d, struct optimizer *o, struct model *m, struct zero_swap *sw,
                                  struct amp_error *err);
/* After the save: the blocks back (moments and masters), the whole tensors freed. Not a collective. */
void zero_gather_end(struct optimizer *o, struct zero_swap *sw);

/* Before a checkpoint is loaded into the trainer: every rank's moments become whole-size zeroed tensors, its
 * blocks set aside in *sw. Not a collective. */
enum amp_status zero_load_begin(struct optimizer *o, struct model *m, struct zero_swap *sw, struct amp_error *err);
/* After the load (ok: it succeeded): each rank keeps its block of the loaded moments, the whole tensors freed
 * (AMP_ERR_INTERNAL where a host copy for that cannot be had; ok false: the blocks stay as they were). Not a
 * collective. */
enum amp_status zero_load_end(struct optimizer *o, struct zero_swap *sw, bool ok, struct amp_error *err);

#endif
