/*
 * loss.c — the CPU backend's losses: softmax cross-entropy (per-sample loss, correct flags and dlogits, in
 * place or not) and mean squared error, threaded by rows, and the loss sum (double, in order).
 *
 * The cross-entropy row is first computed by the vectorised path (xent_row_fast: a double exp of the whole row,
 * with an error bound proving each gradient element is the formula's); where the bound cannot prove it, the row
 * falls back to the plain formula (xent_row_formula), which is the reference either way.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers */

#include "vecmath.h" /* exp_f64: the cross-entropy's row */

/* Both losses are threaded by rows (rows_per_chunk samples a chunk): a sample's loss, prediction and
 * gradient row depend on its own row alone. */
struct loss_job {
    struct cpu_backend *cb;
    float *losses;                          /* (N) fp32, or NULL */
    int32_t *correct;                       /* xent: (N), or NULL */
    struct tensor *grad;                    /* (N, K) dlogits or dy, or NULL */
    const struct tensor *x, *target;        /* (N, K) logits or y; mse: target */
    const int32_t *labels;                  /* xent: (N) */
    int64_t N, K, rows_per;
    int64_t S;                              /* xent: elements between rows, >= K (padding: K..S-1) */
    float g;                                /* the gradient's factor */
};

/*
 * Cross-entropy's bits are those of its scalar formula (xent_row_formula): libm's double exp over the row,
 * log of the sum, then each probability as fp32 of exp(x - lse). xent_row_fast gets the same bits in a
 * fraction of the time, or says it cannot: it sums vectorised exp_f64 (vecmath.h, within EXP_F64_ERR units)
 * instead of libm's, so its lse is a little off the formula's, by at most
 *   d_lse = 2u (2K + 80 + 4|L| + 3|lse|),   u = 2^-53, L = log(sum),
 * twice what these add up to, with libm's exp and log taken within 1 ulp (2u; glibc's are within 0.52):
 * each sum within (K + 2)u resp. (K + EXP_F64_ERR)u of the exact one (positive terms, any order), so the
 * logs within about (2K + 66)u of each other, log's rounding 2u|L| in each, lse's own u|lse| in each.
 * Then the loss (lse - x[label]) is within 2 d_lse + 4u|loss|. Each probability is taken as the sum's own term
 * times exp(-L) (libm), e^(x - m) e^-L, against the formula's e^fl(x - fl(m + L)): the exponents differ by the
 * logs' difference and the roundings of x - m, m + L and x - lse (at most d_lse / 2 + u (|x - m| + |x - lse|)), the
 * factors by exp_f64's 64u, libm's 2u twice and the product's u, so it is within a relative
 * 2 (d_lse + 2u (|x - m| + |x - lse|)) + 140u (the ends' roundings in the margin): wherever that whole
 * interval rounds to one fp32 (f32_of_interval) it is the formula's fp32. Where one does not (about one
 * value in 10^6 at K = 256, one in 10^3 at K = 50257; losses near 0, whose fp32 is finer than d_lse), or anything
 * is not finite (NaN, +-Inf reach the check as NaN), xent_row_formula takes the row from the formula's own lse.
 * Only bits the formula gives are written.
 */

/* e[k] = exp(x[k] - m) (a vector loop) and their sum, in eight running sums side by side. */
HOT_LOOP static double xent_exp_sum(double *e, const float *x, float m, int64_t K)
{
    for (int64_t k = 0; k < K; k++)
        e[k] = exp_f64((double)x[k] - (double)m);
    double acc[8] = { 0 };
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int i = 0; i < 8; i++)
            acc[i] += e[k + i];
    for (; k < K; k++)
        acc[k & 7] += e[k];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* The gradient row d[k] = (p_k - [k == label]) g, p_k the fp32 that the whole interval around e[k] exp(-L) (= exp(x[k]
 * - m - L)) rounds to; whether every p_k had one. E = exp(-L) from libm. */
HOT_LOOP static bool xent_fast_grad(float *d, const double *e, const float *x, float m, double lse, double E,
                                    double d_lse, int64_t K, int32_t label, float g)
{
    const double u = 0x1p-53;
    int ok = 1;
    for (int64_t k = 0; k < K; k++) {
        const double p = e[k] * E, a = fabs((double)x[k] - (double)m) + fabs((double)x[k] - lse);
        float pf;
        ok &= f32_of_interval(p, p * (2.0 * (d_lse + 2.0 * u * a) + 140.0 * u), &pf);
        d[k] = (pf - (k == label ? 1.0f : 0.0f)) * g;
    }
    return ok;
}

/* The gradient row from the formula's own lse: each p as exp_f64 of the formula's exponent, kept where its interval
 * (exp_f64's 64u, libm's 2u, the ends) rounds to one fp32; whether every one did. */
HOT_LOOP static bool xent_exact_grad(float *d, const float *x, double lse, int64_t K, int32_t label, float g)
{
    const double u = 0x1p-53;
    int ok = 1;
    for (int64_t k = 0; k < K; k++) {
        const double p = exp_f64((double)x[k] - lse);
        float pf;
        ok &= f32_of_interval(p, p * (140.0 * u), &pf);
        d[k] = (pf - (k == label ? 1.0f : 0.0f)) * g;
    }
    return ok;
}

/* One row by the formula, the bits every other path must give: libm's sum and log, so the formula's lse itself, then
 * the probabilities through xent_exact_grad, libm's exp only for those whose interval still straddles a rounding
 * boundary. For rows the fast path could not settle, rows of large K (GPT-2's 50257, where the sum's bound of K
 * roundings would send most rows here: one libm pass a row instead of two) and labels outside [0, K) (ok false: a
 * NaN loss, no one-hot term). */
static void xent_row_formula(const float *x, float mx, int64_t K, int32_t label, bool ok, float *loss, float *d,
                             float g)
{
    const double u = 0x1p-53;
    double sum = 0.0;
    for (int64_t k = 0; k < K; k++)
        sum += exp((double)x[k] - (double)mx);
    const double lse = (double)mx + log(sum);
    if (loss)
        *loss = ok ? (float)(lse - (double)x[label]) : NAN;
    if (!d || xent_exact_grad(d, x, lse, K, label, g))
        return;
    for (int64_t k = 0; k < K; k++) {
        const double a = (double)x[k] - lse, p = exp_f64(a);
        float pf;
        if (!f32_of_interval(p, p * (140.0 * u), &pf))
            d[k] = ((float)exp(a) - (k == label ? 1.0f : 0.0f)) * g;
    }
}

/* One row by exp_f64 and the bound above; false (outputs partly written) where the formula must decide. e: K
 * doubles of scratch. */
static bool xent_row_fast(double *e, const float *x, float mx, int64_t K, int32_t label, float *loss, float *d, float g)
{
    const double u = 0x1p-53;
    const double L = log(xent_exp_sum(e, x, mx, K));
    const double lse = (double)mx + L;
    const double d_lse = 2.0 * u * (2.0 * (double)K + 80.0 + 4.0 * fabs(L) + 3.0 * fabs(lse));
    const double lv = lse - (double)x[label];
    float lf;
    if (!f32_of_interval(lv, 2.0 * d_lse + 4.0 * u * fabs(lv), &lf))
        return false;
    if (loss)
        *loss = lf;
    return !d || xent_fast_grad(d, e, x, mx, lse, exp(-L), d_lse, K, label, g);
}

/* Rows longer than this go straight to xent_row_formula: d_lse grows with K, and from about 8 Ki logits a row
 * expects one probability or more whose interval straddles a rounding boundary (about K^2 / 2^26 of them), so the
 * fast attempt would mostly be wasted work. */
#define XENT_FAST_MAX_K 8192

/* A label outside [0, K) is a programming error (the data module validates labels): debug builds
 * abort; release builds give that sample a NaN loss, correct 0 and no one-hot term, so the non-finite
 * check reports it instead of the backend reading out of bounds (by the formula, not the fast row). */
static void xent_chunk(void *arg, int64_t chunk, int worker)
{
    const struct loss_job *j = arg;
    int64_t K = j->K, S = j->S, i0 = chunk * j->rows_per, i1 = i0 + j->rows_per < j->N ? i0 + j->rows_per : j->N;
    float *xb = wscratch(j->cb, worker, WSCR_TMP0), *db = wscratch(j->cb, worker, WSCR_TMP1);
    double *e = (double *)(void *)wscratch(j->cb, worker, WSCR_TMP2);
    struct tensor *dlogits = j->grad;
    /* dlogits over the logits (models/loss.c): an fp32 row is read in place, so it is copied first (a 16-bit one is
     * widened into xb anyway, and its gradient staged in db). A padded row (S > K) is read as its first K
     * elements, and its gradient row is written whole, the padding's S - K elements as 0. */
    bool in_place = dlogits && dlogits->data == j->x->data && j->x->dtype == DT_FP32;
    for (int64_t i = i0; i < i1; i++) {
        const float *x = in_place ? memcpy(xb, (const float *)j->x->data + i * S, (size_t)K * sizeof *xb)
                                  : load_f32(j->x->data, j->x->dtype, (size_t)(i * S), (size_t)K, xb);
        float mx = x[0];
        int64_t arg_max = 0;
        for (int64_t k = 1; k < K; k++)
            if (x[k] > mx) {
                mx = x[k];
                arg_max = k;
            }
        int32_t label = j->labels[i];
        assert(label >= 0 && label < K);
        bool ok = label >= 0 && label < K;
        if (j->correct)
            j->correct[i] = ok && arg_max == label;
        float *loss = j->losses ? &j->losses[i] : NULL;
        float *d = dlogits ? out_f32(dlogits->data, dlogits->dtype, (size_t)(i * S), db) : NULL;
        if (!ok || K > XENT_FAST_MAX_K || !xent_row_fast(e, x, mx, K, label, loss, d, j->g))
            xent_row_formula(x, mx, K, label, ok, loss, d, j->g);
        if (!d)
            continue;
        for (int64_t k = K; k < S; k++)
            d[k] = 0.0f;
        store_f32(dlogits->data, dlogits->dtype, (size_t)(i * S), (size_t)S, d);
    }
}

void cpu_xent_forward_backward(struct backend *be, struct tensor *losses, int32_t *correct,
                                      struct tensor *dlogits, const struct tensor *logits, const int32_t *labels,
                                      int64_t N, int64_t K, const float *grad_seed)
{
    struct cpu_backend *cb = cpu_of(be);
    const int64_t S = N > 0 ? (int64_t)logits->numel / N : K; /* the row stride: K, or the padded vocabulary */
    assert(N > 0 && (int64_t)logits->numel == N * S && S >= K && K >= 1);
    assert(!losses || (losses->dtype == DT_FP32 && (int64_t)losses->numel >= N));
    assert(!dlogits || (int64_t)dlogits->numel == N * S);
    if (!cpu_wscratch_reserve(cb, WSCR_TMP0, (size_t)K * sizeof(float)) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP1, (size_t)S * sizeof(float)) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP2, (size_t)K * sizeof(double)))
        return;
    assert(!dlogits || grad_seed);
    struct loss_job j = { .cb = cb, .losses = losses ? (float *)losses->data : NULL, .correct = correct,
                          .grad = dlogits, .x = logits, .labels = labels, .N = N, .K = K, .S = S,
                          .rows_per = rows_per_chunk(K),
                          .g = dlogits ? (float)((double)*grad_seed / (double)N) : 0.0f };
    parallel_for(cb->pool, div_up(N, j.rows_per), xent_chunk, &j);
}

static void mse_chunk(void *arg, int64_t chunk, int worker)
{
    const struct loss_job *j = arg;
    int64_t K = j->K, i0 = chunk * j->rows_per, i1 = i0 + j->rows_per < j->N ? i0 + j->rows_per : j->N;
    float *yb = wscratch(j->cb, worker, WSCR_TMP0), *tb = wscratch(j->cb, worker, WSCR_TMP1);
    float *db = wscratch(j->cb, worker, WSCR_TMP2);
    struct tensor *dy = j->grad;
    for (int64_t i = i0; i < i1; i++) {
        size_t off = (size_t)(i * K);
        const float *yr = load_f32(j->x->data, j->x->dtype, off, (size_t)K, yb);
        const float *tr = load_f32(j->target->data, j->target->dtype, off, (size_t)K, tb);
        double s = 0.0;
        for (int64_t k = 0; k < K; k++) {
            double e = (double)yr[k] - (double)tr[k];
            s += e * e;
        }
        if (j->losses)
            j->losses[i] = (float)(s / (double)K);
        if (!dy)
            continue;
        float *d = out_f32(dy->data, dy->dtype, off, db);
        for (int64_t k = 0; k < K; k++)
            d[k] = (yr[k] - tr[k]) * j->g;
        store_f32(dy->data, dy->dtype, off, (size_t)K, d);
    }
}

void cpu_mse_forward_backward(struct backend *be, struct tensor *losses, struct tensor *dy,
                                     const struct tensor *y, const struct tensor *target, int64_t N, int64_t K,
                                     const float *grad_seed)
{
    struct cpu_backend *cb = cpu_of(be);
    assert((int64_t)y->numel == N * K && (int64_t)target->numel == N * K);
    assert(!dy || grad_seed);
    assert(!dy || (int64_t)dy->numel == N * K);
    size_t row_bytes = (size_t)K * sizeof(float);
    if (!cpu_wscratch_reserve(cb, WSCR_TMP0, row_bytes) || !cpu_wscratch_reserve(cb, WSCR_TMP1, row_bytes) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP2, row_bytes))
        return;
    struct loss_job j = { .cb = cb, .losses = losses ? (float *)losses->data : NULL, .grad = dy, .x = y,
                          .target = target, .N = N, .K = K, .rows_per = rows_per_chunk(K),
                          .g = dy ? (float)(2.0 * (double)*grad_seed / ((double)N * (double)K)) : 0.0f };
    parallel_for(cb->pool, div_up(N, j.rows_per), mse_chunk, &j);
}

/* The mean of the first n losses. Not threaded: one double sum in index order, which fixed-chunk partials
 * would reorder (the logged loss would move in its last bits), over a handful of values per sample. */
void cpu_loss_sum(struct backend *be, double *acc, const struct tensor *losses, int64_t n, bool accumulate)
{
    (void)be;
    assert(losses->dtype == DT_FP32 && (int64_t)losses->numel >= n && n > 0);
    const float *l = (const float *)losses->data;
    double s = 0;
    for (int64_t i = 0; i < n; i++)
        s += l[i];
    *acc = (accumulate ? *acc : 0.0) + s / (double)n;
}
