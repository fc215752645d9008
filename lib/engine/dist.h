/*
 * dist.h — what a data-parallel step needs besides one rank's step
 * (docs/distributed.md): reducing backend buffers over the communicator, agreeing on errors and stop
 * signals, comparing replicas, sharding evaluation, and checking that every rank runs one config.
 *
 * It knows the communicator (comm.h) and the backend (backend.h) only through their tables. Where the
 * communicator reduces host memory (MPI) and the backend's memory is not the host's (CUDA without
 * NCCL), a reduce goes through a host staging buffer: download, MPI, upload.
 *
 * Every function here is a collective: all ranks call it at the same point of the run, whatever
 * happened on them, and all return the same answer.
 */
#ifndef AMP_DIST_H
#define AMP_DIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h" /* struct backend */
#include "comm.h"    /* struct comm */
#include "config.h"  /* struct config, struct dist_config */
#include "error.h"

struct dataset; /* data.h */

struct model;
struct scaler;

struct dist {
    struct comm *comm;
    struct backend *be;
    bool active;              /* a step reduces: several ranks, or NCCL asked for on one (scripts/gpu/gpu-check.sh) */
    bool stage;               /* reduce through the host staging buffer below */
    void *stage_buf;
    size_t stage_cap;
    int64_t reduces;          /* reduce calls made (tests count them per step) */
};

/* Bind the communicator to the backend as cfg->backend says (auto: NCCL where there are several ranks,
 * the backend is CUDA and NCCL is built, else MPI; nccl on one rank: a one-rank NCCL communicator, which
 * checks the NCCL path on one GPU). none with more than one rank, or nccl without NCCL or on the CPU, is
 * AMP_ERR_CONFIG. */
enum amp_status dist_init(struct dist *d, struct comm *c, struct backend *be, const struct dist_config *cfg,
                          struct amp_error *err);
void dist_free(struct dist *d);

/* The host staging buffer (stage_buf), grown to at least `bytes` and returned; NULL where it cannot grow (the old
 * buffer stays). Every collective that goes through host memory shares it (the reduce, the replica check, ZeRO-1's
 * gathers). */
void *dist_stage(struct dist *d, size_t bytes);

/* buf[0..count) (backend memory, f32 or f64) = its sum over the ranks. */
void dist_reduce_sum(struct dist *d, void *buf, size_t count, enum comm_dtype dt);
/* The elementwise max of a small fp32 buffer in backend memory over the ranks (fp8 amaxes), through the host
 * where the backend's memory is not the host's (one download and upload of `count` floats). */
void dist_reduce_max_f32(struct dist *d, float *buf, size_t count);

/* Where a rank runs. */
struct dist_place {
    char host[64];   /* gethostname, cut to 63 bytes */
    char device[32]; /* the backend's name: "cpu", "cuda:3" */
};

/* Rank 0's line naming the job's hosts and each rank's device, into buf (every rank gets it): "hosts: node1 (ranks
 * 0-7: cuda:0-7), node2 (ranks 8-15: cuda:0-7)". `device` is this rank's (the backend's name). A collective: an
 * all-gather of one struct dist_place a rank, then dist_format_hosts. */
void dist_describe_hosts(struct comm *c, const char *device, char *buf, size_t len);

/* The line of dist_describe_hosts from every rank's place all[0..world): hosts in the order of their first rank, each
 * with its ranks; consecutive ranks of one host on one kind of device with consecutive indices (or none) make one
 * range ("ranks 0-7: cuda:0-7", "ranks 0-1: cpu"), others are listed one by one. A line longer than buf ends in
 * "...". */
void dist_format_hosts(const struct dist_place *all, int world, char *buf, size_t len);

/* Every rank learns the outcome of a step that may have failed on some: the lowest failing rank's
 * status, with its error (message prefixed "rank R: " when R is not 0) copied into err on every rank,
 * err->agreed set (rank 0 prints it). Returns AMP_OK where none failed. */
enum amp_status comm_agree(struct comm *c, enum amp_status st, struct amp_error *err);

/* The same, also agreeing on a stop signal: *sig becomes the first nonzero signal of any rank (lowest
 * rank first), so all stop at the same step. */
enum amp_status comm_agree_stop(struct comm *c, enum amp_status st, int *sig, struct amp_error *err);

/* The CPU backend's thread count for this rank: run.threads where it is a number; for auto, the CPUs the rank
 * has to itself (comm.h, cpus), so that ranks sharing a host's CPUs (mpirun --bind-to none) do not start a
 * pool each over all of them; 0 (the backend's auto, every CPU it may run on) where no rank shares them.
 * Results do not depend on it. */
int dist_threads(const struct comm *c, const struct run_config *run);

/* Ranks whose resolved configs differ (per-rank overrides, different files): AMP_ERR_CONFIG on every
 * rank, naming the ranks. Compares a hash of the resolved YAML. Where they agree, the communicator takes
 * the config's dist.timeout_s from here on. */
enum amp_status dist_check_config(struct comm *c, const struct config *cfg, struct amp_error *err);

/* Ranks given different inputs that the job needs one of (the command, the checkpoint a resume or an eval reads,
 * eval's options, the data): `h` is this rank's digest of it (digest.h); `code` on every rank where any rank's
 * differs from rank 0's (the exit code of the input at fault: AMP_ERR_CONFIG, AMP_ERR_DATA, AMP_ERR_CKPT),
 * "<what>: rank(s) R differ(s) from rank 0: ...", with `hint`. */
enum amp_status dist_check_same(struct comm *c, uint64_t h, enum amp_status code, const char *what, const char *hint,
                                struct amp_error *err);

/* Ranks that loaded different data (a host's copy of a file differs, a relative path read from another working
 * directory): dist_check_same of data_fingerprint, the message naming `source` (the config) and rank 0's sample
 * counts. Before any step: a rank training on other samples is otherwise silent. */
enum amp_status dist_check_data(struct comm *c, const struct dataset *ds, const char *source, struct amp_error *err);

/* Replicas never diverge silently: hash every parameter's master (its copy where the master is sharded, dist.zero
 * 1: what the ranks hold alike) and the scaler state and step,
 * gather the hashes, and on any difference fail with AMP_ERR_UNSTABLE naming the first differing tensor
 * and the ranks that differ from rank 0. `loaded_from` (else NULL): the check before the first step of weights
 * each rank read from that file (model.init_from), where a difference is the file's, AMP_ERR_CKPT naming it. */
enum amp_status dist_check_replicas(struct dist *d, const struct model *m, const struct scaler *s, int64_t step,
                                    int64_t opt_step, const char *loaded_from, struct amp_error *err);

/* Batchnorm running statistics are per rank during training; before an evaluation and a checkpoint
 * every rank takes rank 0's (PyTorch DDP's broadcast_buffers rule). */
void dist_broadcast_buffers(struct dist *d, struct model *m);

/* Test-only (docs/distributed.md): AMPTRAIN_TEST_PERTURB=R:S adds 1e-3 to the first weight of rank R
 * after step S (flips the last bit of its 16-bit copy where the master is sharded), so that the replica check has
 * something to find. */
void dist_test_perturb(struct dist *d, struct model *m, int64_t step);

#endif
