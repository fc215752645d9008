/*
 * export.h — a checkpoint's weights as a safetensors file: `ampTrain export` (docs/checkpoint.md, "export").
 *
 * What is written: every tensor under the checkpoint's /model (parameters and batchnorm running statistics), named
 * as o->names says (lib/base/weight_names.h; with --names pytorch a tied table under both of its names), in o->dtype,
 * in name order, with the metadata format, producer, checkpoint, step, names and dtype. Before anything is written
 * the checkpoint's tensors must be exactly the model its config builds, names and shapes (the check eval makes,
 * lib/engine/setup.h), and no two may get one name. Errors: AMP_ERR_CONFIG for OUT or the names asked, AMP_ERR_CKPT for a
 * corrupt or mismatched checkpoint, AMP_ERR_INTERNAL for a failed write (lib/base/safetensors.h: nothing is left at OUT).
 */
#ifndef AMP_EXPORT_H
#define AMP_EXPORT_H

#include <stddef.h>
#include <stdint.h>

#include "config.h" /* enum weight_names */
#include "dtype.h"  /* enum dtype */
#include "error.h"  /* enum amp_status, struct amp_error */

struct export_opts {
    const char *ckpt;        /* the checkpoint file (ckpt_resolve has turned a run directory into its file) */
    const char *out;         /* OUT.safetensors */
    enum dtype dtype;        /* DT_FP32, DT_BF16 or DT_FP16 */
    enum weight_names names; /* whose names the tensors get */
};

struct export_result {
    int ntensors;   /* entries written (tied copies included) */
    size_t bytes;   /* of tensor data */
    int64_t step;   /* the checkpoint's */
};

/* OUT must be absent or an earlier export: export replaces nothing else. AMP_ERR_CONFIG naming what OUT is (the
 * checkpoint itself, a run directory's file, a directory, a device, a FIFO, a symbolic link, another file), checked
 * before any work, so a mistyped argument costs nothing. */
enum amp_status export_check_out(const char *out, const char *ckpt, struct amp_error *err);

/* Write o->ckpt's weights to o->out as above; *r says what was written (on success). */
enum amp_status export_checkpoint(const struct export_opts *o, struct export_result *r, struct amp_error *err);

#endif
