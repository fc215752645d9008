/*
 * numerics.h — what fp16, bf16 and fp8 do to this model's tensors (`ampTrain numerics`, docs/precision.md).
 *
 * For a sampled step, after the step's own first micro-batch has run forward and backward in the run's
 * precision, an FP32 shadow model runs the same micro-batch (the same weights, batch, dropout masks and
 * loss scale) on its own tensors; the step then goes on untouched. For every layer's output activation, every activation gradient (at the
 * loss scale in effect) and every weight gradient it records, from the FP32 shadow's values: absmax, RMS,
 * the smallest nonzero magnitude, and for each format the fractions that would overflow (round beyond
 * the largest finite value), flush to zero, or land in subnormals; and the relative L2 error of the run's
 * tensor against the shadow. Rows go to numerics.csv; the report turns them into headroom per layer, the
 * loss-scale window, and one verdict per precision mode.
 */
#ifndef AMP_NUMERICS_H
#define AMP_NUMERICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "error.h"
#include "model.h"
#include "train.h"

enum num_format { NF_FP16, NF_BF16, NF_E4M3, NF_E5M2, NF_COUNT };

struct num_format_info {
    const char *name;      /* "fp16", "bf16", "e4m3", "e5m2" */
    int mant_bits;         /* stored mantissa bits */
    int emin;              /* exponent of the smallest normal: 2^emin */
    double max;            /* largest finite value */
};

const struct num_format_info *num_format(enum num_format f);

/* x rounded to nearest even in format f, with subnormals; +-INFINITY where it rounds beyond the largest
 * finite value (E4M3 has no Inf: there it stands for NaN, what a non-saturating cast gives). */
double num_round(double x, enum num_format f);

#define NUM_HIST_MIN (-160) /* floor(log2 |x|) bins of nonzero magnitudes, clamped to [MIN, MAX] */
#define NUM_HIST_MAX 160

enum num_kind { NK_ACTIVATION, NK_ACT_GRAD, NK_WEIGHT_GRAD, NK_COUNT };

/* Figures of one tensor (summed over the steps measured). */
struct num_stats {
    int64_t n, nonzero;
    double absmax, sumsq, min_nonzero;                  /* of the FP32 shadow's values */
    int64_t overflow[NF_COUNT], flush[NF_COUNT], subnormal[NF_COUNT];
    int64_t hist[NUM_HIST_MAX - NUM_HIST_MIN + 1];      /* nonzero |x| by floor(log2) */
    int64_t pow2[NUM_HIST_MAX - NUM_HIST_MIN + 1];      /* those that are exact powers of two (the window's
                                                           flush counts are exact with them) */
    double err_sumsq, ref_sumsq;                        /* |run - shadow|^2, |shadow|^2 */
};

/* Add n values: ref the FP32 shadow's, run the run's own (NULL: the same, error 0). */
void num_stats_add(struct num_stats *s, const float *ref, const float *run, size_t n);

/* The report of a measured run. */
struct numerics {
    struct model shadow;       /* the FP32 shadow, on the run's backend */
    bool built;
    int ntensors;
    struct num_tensor {
        char name[128];        /* "fc1" (its output activation / gradient) or "fc1/weight" */
        enum num_kind kind;
        int layer;             /* index in the model */
        int param;             /* NK_WEIGHT_GRAD: index among the layer's parameters */
        struct num_stats total;
    } *tensors;
    int64_t steps;
    double seconds;            /* wall time spent measuring (scripts/bench/bench_numerics.sh) */
    double scale;              /* the loss scale of the last measured step (1 without loss scaling) */
    FILE *csv;                 /* numerics.csv, or NULL */
    float *host_ref, *host_run;
    size_t host_len;
    /* precision.mode fp8: the run's own casts at its per-tensor scales (lib/base/fp8.h), counted by the backend in
     * the measured micro-batch: per fp8 tensor (the forward group's, then the backward's) the elements that
     * saturate, the nonzero ones that flush to zero, the nonzero ones, all of them */
    int nfp8;
    int64_t *fp8_counts;       /* backend memory, 4 per tensor */
    int64_t *fp8_total;        /* host: summed over the steps measured */
    float *fp8_scale;          /* host: the scale each tensor was cast with at the last measured step */
    char (*fp8_names)[96];     /* host: the tensors' names ("fc2/input", ...) */
    int fp8_nfwd;              /* the first fp8_nfwd are E4M3 (forward), the rest E5M2 */
};

/* Build the shadow of t's model (FP32 policy, the same layers) and open DIR/NAME: a run's numerics.csv
 * (run.numerics_every) is appended to when it exists; the `numerics` command's own file (fresh) is written
 * anew. dir NULL: no file. */
enum amp_status numerics_open(struct numerics *nm, struct trainer *t, const char *dir, const char *name, bool fresh,
                              struct amp_error *err);

/* trainer_step, measuring the step's first micro-batch against the shadow on the way: the step itself runs
 * as it would without (the shadow has its own tensors), so the run stays bit-identical. */
enum amp_status numerics_step(struct numerics *nm, struct trainer *t, struct amp_error *err);

/* Headroom per layer, the loss-scale window (at most `underflow` of nonzero activation-gradient elements
 * flushed), and one verdict per precision mode, to `out`. `cfg` gives the static scale and the dynamic init. */
void numerics_report(const struct numerics *nm, const struct config *cfg, double underflow, FILE *out);

void numerics_close(struct numerics *nm);

/* run.numerics_every's measurement, for train_run and train_resume (lib/engine/train.h): numerics_open on DIR/numerics.csv
 * (appended to), numerics_step on each step given, and at a good end numerics_report with 0.001 of activation-gradient
 * elements allowed to flush. */
extern const struct train_probe numerics_probe;

/* `ampTrain numerics`: set up the run of `cfg` (from `checkpoint` when not NULL), measure and train `steps`
 * steps in memory, write run.out_dir/numerics.csv and print the report. */
enum amp_status numerics_run(const struct config *cfg, const char *checkpoint, int64_t steps, double underflow,
                             struct amp_error *err);

/* The loss-scale window from activation-gradient figures measured at `scale`: [*lo, *hi] as powers of two
 * (log2); *hi is the largest 2^k at which no element overflows fp16, *lo the smallest at which at most
 * `underflow` of the nonzero elements flush to zero. *lo > *hi when no scale satisfies both. */
void num_scale_window(const struct num_stats *g, double scale, double underflow, int *lo, int *hi);

#endif
