/*
 * zero.h — ZeRO stage 1 (dist.zero: 1, docs/distributed.md "ZeRO-1"): the optimizer's moments sharded over the
 * ranks.
 *
 * Every parameter's elements are split into the ranks' blocks (comm_shard: blocks of ceil(numel / N), the last
 * ones shorter or empty, so any size works). Rank r holds AdamW's m and v (SGD's momentum buffer) for its block
 * of every parameter only (lib/engine/optim.h, optim_create_sharded) and updates only that block of the weights and
 * their low-precision copy. Where the ops read only the copy, the master itself is sharded too (zero_shard_masters:
 * param.master_block), and the step gathers the copies' blocks alone; where the ops read the master (fp32 mode, fp32
 * biases and norm gains, embedding tables, fp8 and tied weights) it stays whole and its blocks are gathered too.
 *
 * The step's other parts are those of dist.zero 0, so the bits are too: the same reduce of the gradients (a
 * reduce-scatter, each rank's block summed in rank order, then an all-gather of the blocks: comm.h), the same
 * gradient statistics over the whole reduced gradient (norm, overflow check, clipping), the same step rule. The
 * all-gather of the gradients stays because the norm is one sum over the whole gradient in the backend's chunk order,
 * which partial sums over this rank's blocks (not aligned to the chunks) cannot give bit for bit. What differs is
 * combined exactly:
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
 * Every function here is a collective where the optimizer is sharded and a no-op where it is not.
 */
#ifndef AMP_ZERO_H
#define AMP_ZERO_H

#include "dist.h"  /* struct dist */
#include "model.h" /* struct model */
#include "optim.h" /* struct optimizer */

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
