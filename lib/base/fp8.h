/*
 * fp8.h — per-tensor scaling for precision.mode fp8 (Transformer Engine's HYBRID recipe, docs/precision.md).
 *
 * Every fp8 tensor of a layer (its input and weight in E4M3, the gradient of its output in E5M2) is a slot of
 * the model's fp8 state: a scale (codes = saturate(round(value * scale))), its reciprocal scale_inv (what a
 * product multiplies its fp32 sum by) and, with recipe delayed, an amax history. All of them live in backend
 * memory, so a step never waits for the host:
 *
 *   delayed (TE DelayedScaling): a cast uses the scale as it is and raises this step's history entry to the
 *     tensor's amax (max |x|; NaN elements are ignored, as by TE's fmaxf, Inf counts). After the step (taken or
 *     skipped), fp8_update sets scale = (fmax / amax) / 2^margin with amax the max over the history's
 *     amax_history_len steps (`max`) or this step's entry (`most_recent`), keeping the old scale when that amax
 *     is 0 or not finite; then it clears the entry the next step writes. The history is a ring: the step
 *     numbered t writes row t mod len, so a resumed run needs only the rows and the step.
 *   current (torchao tensorwise): a cast first takes the amax of its tensor now and sets the scale from it
 *     (the same formula, in double, amax clamped to at least 1e-12 as torchao does; a non-finite amax keeps the
 *     old scale), then casts. There is no history.
 *   blockwise (DeepSeek-V3's, Transformer Engine's Float8BlockScaling): no per-tensor scale at all. Each operand
 *     of a product is cast with one scale per tile along the product's contraction dimension K: an input or an
 *     output gradient in 1x128 tiles (one scale per row for each 128 consecutive K elements), a weight in
 *     128x128 blocks; E4M3 everywhere, gradients too. The scale of a tile is fp8_block_scale(its amax), a power
 *     of two. Nothing carries over from one cast to the next: no history, no scale state in a checkpoint.
 *
 * The arithmetic below is shared by the CPU backend and the CUDA kernels (AMP_HD), so both compute the same
 * scale from the same amax. Scales start at 1.
 */
#ifndef AMP_FP8_H
#define AMP_FP8_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "amp_hd.h" /* AMP_HD */

#ifndef __CUDACC__
#include "dtype.h"  /* enum dtype */
#include "error.h"  /* struct amp_error */
struct backend;
#endif

#define FP8_AMAX_FLOOR 1e-12 /* torchao's EPS: an all-zero tensor gets fmax / 1e-12, not Inf */

/* The new scale from amax. delayed: TE's _default_sf_compute, in fp32 as TE computes it (an amax so small that
 * the scale would overflow gives FLT_MAX where TE would give Inf); current: torchao's amax_to_scale, in double
 * from max(amax, 1e-12), then rounded to fp32. A non-finite amax keeps the old scale; so does 0 with `delayed`. */
AMP_HD static inline float fp8_scale_from_amax(float amax, float fmax, int margin, float old_scale, bool current)
{
    const float flt_max = 3.402823466e38f;
    if (!(amax <= flt_max)) /* Inf or NaN */
        return old_scale;
    if (current) {
        double a = amax < FP8_AMAX_FLOOR ? FP8_AMAX_FLOOR : (double)amax;
        double s = (double)fmax / a / ldexp(1.0, margin);
        return s > (double)flt_max ? flt_max : (float)s;
    }
    if (amax == 0.0f)
        return old_scale;
    float s = fmax / amax;
    s = ldexpf(s, -margin);
    return s > flt_max ? flt_max : s;
}

/* |x| folded into a running amax: NaN ignored (fmaxf), Inf kept. */
AMP_HD static inline float fp8_amax_fold(float amax, float x)
{
    return fmaxf(amax, fabsf(x));
}

/* The delayed recipe's amax of tensor i from its history (len rows of n): the max over the rows (NaN, which only a
 * file could hold, propagates), or row `row` alone with most_recent. */
AMP_HD static inline float fp8_history_amax(const float *history, int n, int len, int row, int i, bool most_recent)
{
    float amax = history[(size_t)row * (size_t)n + (size_t)i];
    if (!most_recent)
        for (int r = 0; r < len; r++) {
            float h = history[(size_t)r * (size_t)n + (size_t)i];
            amax = h > amax || h != h ? h : amax;
        }
    return amax;
}

/* ---- recipe blockwise -------------------------------------------------------------------------------------- */

#define FP8_BLOCK 128 /* the tile's length along K, and the weight block's side */

/* How a 2-D (rows, cols) fp8 operand's scales are laid out, one fp32 scale_inv per tile (the factor that turns
 * its codes into values). A tile at the edge of a matrix whose side is not a multiple of 128 holds the elements
 * there are (as if padded with zeros: a zero changes neither its amax nor its sums).
 *   FP8_TILES_ROWS:   1x128 tiles along each row: scales (rows, ceil(cols / 128)). K is the stored columns.
 *   FP8_TILES_COLS:   128x1 tiles down each column: scales (ceil(rows / 128), cols). K is the stored rows (the
 *                     1x128 tiles of the transposed matrix).
 *   FP8_BLOCKS:       128x128 blocks: scales (ceil(rows / 128), ceil(cols / 128)), row-major. Either side is K. */
enum fp8_tiling { FP8_TILES_ROWS, FP8_TILES_COLS, FP8_BLOCKS };

AMP_HD static inline int64_t fp8_tiles(int64_t n)
{
    return (n + FP8_BLOCK - 1) / FP8_BLOCK;
}

/* The number of scales of a (rows, cols) operand. */
AMP_HD static inline int64_t fp8_tiling_scales(enum fp8_tiling t, int64_t rows, int64_t cols)
{
    return t == FP8_TILES_ROWS ? rows * fp8_tiles(cols)
         : t == FP8_TILES_COLS ? fp8_tiles(rows) * cols
                               : fp8_tiles(rows) * fp8_tiles(cols);
}

/* The index of element (r, c)'s scale in a (rows, cols) operand's scales. */
AMP_HD static inline int64_t fp8_tiling_index(enum fp8_tiling t, int64_t cols, int64_t r, int64_t c)
{
    return t == FP8_TILES_ROWS ? r * fp8_tiles(cols) + c / FP8_BLOCK
         : t == FP8_TILES_COLS ? (r / FP8_BLOCK) * cols + c
                               : (r / FP8_BLOCK) * fp8_tiles(cols) + c / FP8_BLOCK;
}

/* A tile's scale from its amax: the largest power of two 2^e with amax * 2^e <= 448 (E4M3's max), as Transformer
 * Engine's Float8BlockScaling computes it by default (power_2_scale): the scale and its inverse are exact, so a
 * code times its scale_inv is the value it stands for, exactly, on any device. e is found from 448 / amax in
 * double, which lands on a power of two only when the exact quotient is one. An amax of 0, Inf or NaN gives 1 (a
 * NaN casts to NaN and an Inf saturates to 448, as in every recipe; the step's check sees the non-finite
 * gradients). e is kept within [-126, 126] so that both the scale and its inverse are normal fp32 numbers: a tile
 * whose amax is below 448 * 2^-126 has its tiny values flushed toward zero. */
AMP_HD static inline float fp8_block_scale(float amax)
{
    const float flt_max = 3.402823466e38f;
    if (!(amax > 0.0f && amax <= flt_max))
        return 1.0f;
    int e;
    frexp(448.0 / (double)amax, &e); /* 448 / amax = f * 2^e, f in [0.5, 1): floor(log2) is e - 1 */
    e -= 1;
    e = e < -126 ? -126 : e > 126 ? 126 : e;
    return ldexpf(1.0f, e);
}

#ifndef __CUDACC__

enum fp8_recipe { FP8_DELAYED, FP8_CURRENT, FP8_BLOCKWISE };

/* The tensors of one format: the forward's (E4M3: inputs and weights) or the backward's (E5M2: output
 * gradients; E4M3 with recipe blockwise). Each array is in backend memory; with recipe blockwise, where the scales
 * belong to the tiles of each cast (struct linear_op), scale and scale_inv stay 1 and only the names and the
 * numerics counters use the slots. */
struct fp8_group {
    enum dtype dt;
    int n;
    float *scale;      /* n */
    float *scale_inv;  /* n */
    float *history;    /* delayed: len rows of n (row r holds the amaxes of the steps t with t mod len == r) */
    float *pending;    /* delayed: n, the running step's amaxes (the casts raise it; fp8_step_end folds it into the
                        * step's row and zeroes it), so the casts write one place every step */
    char (*names)[96]; /* host: "fc2/input", "fc2/weight", "fc2/grad_output" (checkpoint and `check`) */
};

/* A linear product of a layer that may run in fp8 (not kept in bf16 by name): its weight's shape and whether it is
 * large enough (fp8_state_large). Recorded for `ampTrain check`. */
struct fp8_product {
    char name[96]; /* "fc2", "block0/attn/qkv" */
    int64_t k, n;  /* the weight is (n out, k in) */
    bool fp8;
};

struct fp8_state {
    enum fp8_recipe recipe;
    int len;           /* amax_history_len (delayed) */
    bool most_recent;  /* amax_compute: most_recent (else max) */
    int margin;
    int64_t min_k, min_n; /* precision.fp8.min_size: a product runs in fp8 when k > min_k or n > min_n */
    struct fp8_product *products; /* host: every product that may run in fp8, in build order */
    int nproducts;
    struct fp8_group fwd, bwd;
    struct backend *be;
    /* The version of the weights that training passes read: fp8_pass_of raises it at every optimizer step, and a
     * linear op casts its weight to E4M3 only when the codes it keeps were cast for another version (below). */
    uint64_t weights;
    bool recast_weights; /* tests only (tests/test_fp8.c): every pass casts its weights, the reference */
};

/* A layer's handle on one of its fp8 tensors. */
struct fp8_slot {
    struct fp8_group *g;
    int index;
};

/* What a pass records: with recipe delayed in training, where this step's amaxes go (the groups' `pending`, folded
 * into the step's history row by fp8_step_end; NULL otherwise: eval and `current` record nothing).
 *
 * Weights are cast once per optimizer step (Transformer Engine's is_first_microbatch): the first micro-batch of a
 * step casts each fp8 layer's weight and the layer keeps the codes, with their scale, for the step's other
 * micro-batches (and a recomputed forward). They are valid for exactly that: the weights change only at the
 * optimizer update, and a weight's scale only at a cast of that weight (recipe current: from the weight, which has
 * not changed) or at fp8_step_end (delayed), both after the step's first micro-batch or after the step. So the
 * codes kept are the codes a cast would make again, and the run's bits are those of a cast per micro-batch; the
 * weight's amax, recorded by the first cast, is the one every later cast would record. */
struct fp8_pass {
    float *amax_fwd, *amax_bwd;
    int64_t *counts_fwd, *counts_bwd; /* ampTrain numerics: 4 counters per tensor (backend.h fp8_cast_args), or NULL */
    uint64_t weights; /* the weights' version (fp8_state.weights) this step reads; 0 outside training (every pass
                       * casts its weights) */
};

/* Building: register a slot (host only; nothing allocated yet). AMP_ERR_INTERNAL on out of memory. */
enum amp_status fp8_add_slot(struct fp8_state *st, bool backward, const char *name, struct fp8_slot *out,
                             struct amp_error *err);
/* Whether a product of weight (n out, k in) is large enough to run in fp8 (precision.fp8.min_size; torchao's
 * tensorwise rule by default: smaller products lose more to the casts than the fp8 product gains). */
static inline bool fp8_state_large(const struct fp8_state *st, int64_t k, int64_t n)
{
    return k > st->min_k || n > st->min_n;
}
/* Record a product that may run in fp8 and whether it does (host only). AMP_ERR_INTERNAL on out of memory. */
enum amp_status fp8_add_product(struct fp8_state *st, const char *name, int64_t k, int64_t n, bool fp8,
                                struct amp_error *err);
/* Allocate the backend arrays once every slot is registered: scales 1, histories 0. */
enum amp_status fp8_alloc(struct fp8_state *st, struct backend *be, struct amp_error *err);
void fp8_free(struct fp8_state *st);

/* The pass of optimizer step `step` (training: once per step, before its first micro-batch; it raises
 * st->weights, so the step casts the weights anew) or of an evaluation (training false). */
struct fp8_pass fp8_pass_of(struct fp8_state *st, int64_t step, bool training);
/* After optimizer step `step`: delayed recipe's scale update (a no-op for `current`), the pending amaxes folded into
 * the step's row first; both groups in one backend call (fp8_update; one launch on a GPU). dev_step (or NULL): the step in backend memory, read when the update runs instead of `step`
 * (the trainer's step_state.step, before step_finish advances it), so the same launch serves every step. */
void fp8_step_end(const struct fp8_state *st, int64_t step, const int64_t *dev_step);

/* The group's largest finite value (448 or 57344). */
float fp8_group_max(const struct fp8_group *g);

#endif /* !__CUDACC__ */

#endif
