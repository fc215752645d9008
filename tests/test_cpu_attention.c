/*
 * test_cpu_attention.c — causal attention (kernels/cpu/attention.c) against a naive double version: forward, causality,
 * backward against finite differences, and bf16's roundings.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_attention, .init = cpu_test_setup, .fini = cpu_test_teardown);

/* ---- attention --------------------------------------------------------------------------------- */

static double round_to(double x, enum dtype d)
{
    return d == DT_FP32 ? x : (double)dtype_round((float)x, d);
}

/* Naive causal attention in double. With d lowp, rounds where the backend stores (scores, probs, out). */
static void attn_naive(const double *qkv, int64_t B, int64_t T, int64_t C, int64_t H, enum dtype d, double *out,
                       double *probs)
{
    int64_t D = C / H;
    double scale = d == DT_FP32 ? 1.0 / sqrt((double)D) : (double)(1.0f / sqrtf((float)D));
    double s[64], p[64];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++) {
                const double *q = qkv + (b * T + t) * 3 * C + h * D;
                double mx = -INFINITY, sum = 0;
                for (int64_t j = 0; j <= t; j++) {
                    const double *k = qkv + (b * T + j) * 3 * C + C + h * D;
                    double acc = 0;
                    for (int64_t e = 0; e < D; e++)
                        acc += q[e] * k[e];
                    s[j] = round_to(acc * scale, d);
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int64_t j = 0; j <= t; j++)
                    sum += exp(s[j] - mx);
                for (int64_t j = 0; j < T; j++) {
                    p[j] = j <= t ? round_to(exp(s[j] - mx) / sum, d) : 0.0;
                    if (probs)
                        probs[((b * H + h) * T + t) * T + j] = p[j];
                }
                for (int64_t e = 0; e < D; e++) {
                    double acc = 0;
                    for (int64_t j = 0; j <= t; j++)
                        acc += p[j] * qkv[(b * T + j) * 3 * C + 2 * C + h * D + e];
                    out[(b * T + t) * C + h * D + e] = acc;
                }
            }
}

Test(cpu_attention, attention_forward_matches_naive)
{
    seed(17);
    int64_t B = 2, T = 5, C = 8, H = 2;
    size_t nq = (size_t)(B * T * 3 * C), no = (size_t)(B * T * C), np = (size_t)(B * H * T * T);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    for (int d = 0; d < 3; d++) {
        float *hq;
        struct tensor *qkv = trand(dts[d], nq, -2, 2, &hq);
        struct tensor *out = tnew(dts[d], no), *probs = tnew(dts[d], np);
        be->attention_forward(be, out, probs, qkv, B, T, C, H);
        double *wo = dalloc(no), *wp = dalloc(np);
        attn_naive(to_d(hq, nq), B, T, C, H, dts[d], wo, wp);
        if (dts[d] == DT_FP32) {
            check_f32(out, wo, no, 1e-5, 1e-6, "attention out");
            check_f32(probs, wp, np, 1e-5, 1e-7, "attention probs");
        } else {
            /* an fp32-order difference may tip one intermediate rounding: allow 2 ulps */
            check_lowp(out, wo, no, 2, 1e-4, "attention out");
            check_lowp(probs, wp, np, 2, 1e-4, "attention probs");
        }
        const float *pp = thost(probs);
        for (int64_t r = 0; r < B * H * T; r++)
            for (int64_t j = r % T + 1; j < T; j++)
                cr_assert_eq(pp[r * T + j], 0.0f, "masked probability must be exactly 0");
    }
}

Test(cpu_attention, attention_is_causal)
{
    seed(18);
    int64_t B = 2, T = 5, C = 8, H = 2, tp = 3;
    size_t nq = (size_t)(B * T * 3 * C), no = (size_t)(B * T * C), np = (size_t)(B * H * T * T);
    float *hq;
    struct tensor *qkv = trand(DT_FP32, nq, -2, 2, &hq);
    struct tensor *o1 = tnew(DT_FP32, no), *p1 = tnew(DT_FP32, np), *o2 = tnew(DT_FP32, no), *p2 = tnew(DT_FP32, np);
    be->attention_forward(be, o1, p1, qkv, B, T, C, H);
    for (int64_t j = 0; j < 3 * C; j++) /* perturb q, k and v of token tp in batch 0 */
        ((float *)qkv->data)[tp * 3 * C + j] += 0.5f;
    be->attention_forward(be, o2, p2, qkv, B, T, C, H);
    const float *a = o1->data, *b = o2->data;
    size_t changed = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < C; j++) {
            if (t < tp)
                cr_assert_eq(a[t * C + j], b[t * C + j], "out at t=%lld depends on token %lld", (long long)t,
                             (long long)tp);
            else
                changed += a[t * C + j] != b[t * C + j];
        }
    cr_assert_gt(changed, 0);
    cr_assert_eq(memcmp(a + T * C, b + T * C, (size_t)(T * C) * sizeof(float)), 0, "batch 1 untouched");
}

struct attn_ctx {
    int64_t B, T, C, H;
    const double *gy;
};

static double attn_loss(const double *qkv, void *vctx)
{
    struct attn_ctx *c = vctx;
    size_t no = (size_t)(c->B * c->T * c->C);
    double *out = malloc(no * sizeof(double));
    attn_naive(qkv, c->B, c->T, c->C, c->H, DT_FP32, out, NULL);
    double s = dot(out, c->gy, no);
    free(out);
    return s;
}

/* One attention case of (B, T, C, H) in dtype dt, forward then backward: qkv and dout random in [-1.5, 1.5) and
 * [-1, 1), or (q_from, do_from non-NULL) those values rounded to dt; hq and hdo hold the stored values. */
struct attn_case {
    size_t nq, no, np;
    float *hq, *hdo;
    struct tensor *probs, *dqkv;
};

static struct attn_case attn_case_run(enum dtype dt, int64_t B, int64_t T, int64_t C, int64_t H, const float *q_from,
                                      const float *do_from)
{
    struct attn_case a = { (size_t)(B * T * 3 * C), (size_t)(B * T * C), (size_t)(B * H * T * T), NULL, NULL, NULL,
                           NULL };
    struct tensor *qkv, *dout;
    if (q_from && do_from) {
        a.hq = memcpy(falloc(a.nq), q_from, a.nq * sizeof(float));
        a.hdo = memcpy(falloc(a.no), do_from, a.no * sizeof(float));
        qkv = tfrom(dt, a.nq, a.hq);
        dout = tfrom(dt, a.no, a.hdo);
    } else {
        qkv = trand(dt, a.nq, -1.5f, 1.5f, &a.hq);
        dout = trand(dt, a.no, -1, 1, &a.hdo);
    }
    a.probs = tnew(dt, a.np);
    a.dqkv = tnew(dt, a.nq);
    be->attention_forward(be, tnew(dt, a.no), a.probs, qkv, B, T, C, H);
    be->attention_backward(be, a.dqkv, dout, qkv, a.probs, B, T, C, H);
    return a;
}

Test(cpu_attention, attention_backward_matches_finite_differences)
{
    seed(19);
    int64_t B = 2, T = 5, C = 8, H = 2;
    const struct attn_case f = attn_case_run(DT_FP32, B, T, C, H, NULL, NULL);
    const size_t nq = f.nq;
    struct attn_ctx c = { B, T, C, H, to_d(f.hdo, f.no) };
    double *want = dalloc(nq);
    fd_grad(attn_loss, &c, to_d(f.hq, nq), nq, 1e-6, want);
    check_f32(f.dqkv, want, nq, 1e-4, 1e-5, "attention dqkv");

    /* bf16: same gradients within bf16's precision (intermediates are rounded to bf16) */
    const struct attn_case h = attn_case_run(DT_BF16, B, T, C, H, f.hq, f.hdo);
    const float *g16 = thost(h.dqkv), *g32 = f.dqkv->data;
    double gmax = 0;
    for (size_t i = 0; i < nq; i++)
        gmax = fmax(gmax, fabs(g32[i]));
    for (size_t i = 0; i < nq; i++)
        cr_assert(fabs(g16[i] - g32[i]) <= 0.05 * gmax, "bf16 dqkv[%zu] = %g, fp32 %g", i, (double)g16[i],
                  (double)g32[i]);
}

/* bf16 backward against the chain rule in double over the backend's own bf16 values and roundings: with
 * qkv, dout and the stored probabilities P (the forward's) all bf16, dP = round(dO V^T), dS = round(P (dP -
 * rowsum(P dP))), dV = round(P^T dO), dQ = round(dS K / sqrt(D)), dK = round(dS^T Q / sqrt(D)). The products
 * then read the bf16 tensors in place (gemm_avx512's bf16 product where the CPU has it): a wrong block,
 * stride or transpose there is off by far more than the 2 ulps an fp32-order difference may tip. */
Test(cpu_attention, attention_backward_bf16_matches_its_roundings)
{
    seed(23);
    int64_t B = 2, T = 6, C = 8, H = 2, D = C / H;
    const struct attn_case a = attn_case_run(DT_BF16, B, T, C, H, NULL, NULL);
    const size_t nq = a.nq;
    const float *P = thost(a.probs), *hq = a.hq, *hdo = a.hdo;
    const double scale = (double)(1.0f / sqrtf((float)D));
    double *want = dalloc(nq), ds[64];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const float *p = P + (b * H + h) * T * T;
#define Q_(t, e) ((double)hq[(b * T + (t)) * 3 * C + h * D + (e)])
#define K_(t, e) ((double)hq[(b * T + (t)) * 3 * C + C + h * D + (e)])
#define V_(t, e) ((double)hq[(b * T + (t)) * 3 * C + 2 * C + h * D + (e)])
#define DO_(t, e) ((double)hdo[(b * T + (t)) * C + h * D + (e)])
            for (int64_t t = 0; t < T; t++) {
                double dot = 0;
                for (int64_t k = 0; k < T; k++) {
                    double acc = 0;
                    for (int64_t e = 0; e < D; e++)
                        acc += DO_(t, e) * V_(k, e);
                    ds[t * T + k] = round_to(acc, DT_BF16);
                }
                for (int64_t k = 0; k <= t; k++)
                    dot += (double)p[t * T + k] * ds[t * T + k];
                for (int64_t k = 0; k < T; k++)
                    ds[t * T + k] = k <= t ? round_to(p[t * T + k] * (ds[t * T + k] - (double)(float)dot), DT_BF16) : 0;
            }
            for (int64_t t = 0; t < T; t++)
                for (int64_t e = 0; e < D; e++) {
                    double dq = 0, dk = 0, dv = 0;
                    for (int64_t k = 0; k < T; k++) {
                        dq += ds[t * T + k] * K_(k, e);
                        dk += ds[k * T + t] * Q_(k, e);
                        dv += (double)p[k * T + t] * DO_(k, e);
                    }
                    size_t at = (size_t)((b * T + t) * 3 * C + h * D + e);
                    want[at] = dq * scale;
                    want[at + (size_t)C] = dk * scale;
                    want[at + 2 * (size_t)C] = dv;
                }
#undef Q_
#undef K_
#undef V_
#undef DO_
        }
    check_lowp(a.dqkv, want, nq, 2, 1e-4, "attention dqkv bf16");
}
