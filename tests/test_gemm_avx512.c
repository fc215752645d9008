/*
 * test_gemm_avx512.c — GEMM on the CPU backend for fp32, fp16 and bf16 inputs: the AVX-512 path
 * (kernels/cpu/gemm_avx512.c) and the portable path (cblas_sgemm, 16-bit operands widened first; forced by
 * AMPTRAIN_GEMM_PORTABLE=1), each against a naive double reference on fresh random inputs, against each
 * other, and for determinism; and how each treats subnormals. bf16 has two fast paths: AVX512-BF16
 * vdpbf16ps, and AMX tdpbf16ps, the default where the CPU has AMX (AMPTRAIN_GEMM_AMX=0 keeps vdpbf16ps); both
 * are held to the same tolerance, and vdpbf16ps to its documented summation order bit for bit.
 *
 * Tolerance per element: with S = |alpha| sum_k |a||b| + |beta c_old| + |bias|, an fp32 result is
 * within 1e-5 S of the exact value (fp32 accumulation over these k), a 16-bit result within that plus
 * half an ulp of its dtype (2^-8 relative for bf16, 2^-11 for fp16). The fast-path tests skip on CPUs
 * without the instructions (AVX-512F/BW/VL; AVX512-BF16 too for bf16).
 */
#define _POSIX_C_SOURCE 200112L /* setenv, unsetenv */

#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "testrand.h" /* seed, urand */
#include "testmem.h"  /* talloc, tracked_tensor, tracked_free_to */
#include "backend.h"
#include "gemm_avx512.h" /* gemm_avx512_supported, gemm_avx512_amx_supported: which fast paths this CPU takes */

/* default backend (fast path where supported: AMX for bf16 where present), AMPTRAIN_GEMM_PORTABLE=1, AMPTRAIN_GEMM_AMX=0 */
static struct backend *fast, *port, *dp;
static struct backend *under; /* the fast-path backend the case functions run: fast or dp */

static void setup(void)
{
    unsetenv("AMPTRAIN_GEMM_PORTABLE");
    unsetenv("AMPTRAIN_GEMM_AMX");
    fast = backend_cpu_create();
    setenv("AMPTRAIN_GEMM_PORTABLE", "1", 1);
    port = backend_cpu_create();
    unsetenv("AMPTRAIN_GEMM_PORTABLE");
    setenv("AMPTRAIN_GEMM_AMX", "0", 1);
    dp = backend_cpu_create();
    unsetenv("AMPTRAIN_GEMM_AMX");
    cr_assert(fast && port && dp);
    under = fast;
}

static void teardown(void)
{
    tracked_free_all();
    backend_close(fast);
    backend_close(port);
    backend_close(dp);
}

TestSuite(gemm_avx512, .init = setup, .fini = teardown);

static struct tensor *tnew(struct backend *be, enum dtype dt, size_t n)
{
    return tracked_tensor(be, dt, n);
}

/* n random values in [-1, 1) rounded to dt; *h gets the stored values. */
static struct tensor *trand(struct backend *be, enum dtype dt, size_t n, float **h)
{
    float *v = talloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        v[i] = (float)(2.0 * urand() - 1.0);
    struct tensor *t = tnew(be, dt, n);
    tensor_from_host_f32(t, v);
    tensor_to_host_f32(t, v);
    *h = v;
    return t;
}

static void poison(struct tensor *t)
{
    if (t->dtype == DT_FP32)
        for (size_t i = 0; i < t->numel; i++)
            ((float *)t->data)[i] = NAN;
    else
        for (size_t i = 0; i < t->numel; i++)
            ((uint16_t *)t->data)[i] = t->dtype == DT_BF16 ? 0x7FC0 : 0x7E00;
}

struct gshape {
    bool ta, tb;
    int64_t m, n, k, batch;
    int64_t pad;       /* extra elements between batch matrices (strides = size + pad) */
    float alpha, beta;
    bool bias;
    bool c16;          /* C in the inputs' 16-bit dtype (fp32 inputs: C stays fp32) */
};

struct gcase {
    struct gshape sh;
    enum dtype in;     /* A and B */
    enum dtype c_dt;   /* from in and sh.c16 */
};

static struct gcase gcase_of(struct gshape sh, enum dtype in)
{
    return (struct gcase){ .sh = sh, .in = in, .c_dt = sh.c16 ? in : DT_FP32 };
}

struct prepared {
    struct gemm_args g;
    float *ha, *hb, *hc0, *hbias; /* host copies of the stored inputs */
    struct tensor *c0;            /* C's initial contents, to restore between runs */
};

static struct prepared prepare(const struct gcase *c)
{
    struct prepared p = { 0 };
    int64_t sa = c->sh.m * c->sh.k + c->sh.pad, sb = c->sh.k * c->sh.n + c->sh.pad, sc = c->sh.m * c->sh.n + c->sh.pad;
    struct tensor *a = trand(fast, c->in, (size_t)(c->sh.batch * sa), &p.ha);
    struct tensor *b = trand(fast, c->in, (size_t)(c->sh.batch * sb), &p.hb);
    struct tensor *out = tnew(fast, c->c_dt, (size_t)(c->sh.batch * sc));
    p.c0 = trand(fast, c->c_dt, (size_t)(c->sh.batch * sc), &p.hc0);
    struct tensor *bias = c->sh.bias ? trand(fast, DT_FP32, (size_t)c->sh.n, &p.hbias) : NULL;
    p.g = (struct gemm_args){ .a = a, .b = b, .c = out, .bias = bias, .trans_a = c->sh.ta, .trans_b = c->sh.tb,
                              .m = c->sh.m, .n = c->sh.n, .k = c->sh.k, .alpha = c->sh.alpha, .beta = c->sh.beta,
                              .batch = c->sh.batch, .stride_a = sa, .stride_b = sb, .stride_c = sc };
    return p;
}

/* Run the product on `be` into p->g.c, starting from C0 (beta != 0) or from NaN (beta 0: must not be read). */
static void run(struct backend *be, struct prepared *p)
{
    if (p->g.beta != 0.0f)
        memcpy(p->g.c->data, p->c0->data, tensor_bytes(p->c0));
    else
        poison(p->g.c);
    be->gemm(be, &p->g);
    struct amp_error err;
    cr_assert_eq(be->status(be, &err), AMP_OK, "%s", err.msg);
}

static float get(const struct tensor *t, size_t i)
{
    if (t->dtype == DT_FP32)
        return ((const float *)t->data)[i];
    uint16_t h = ((const uint16_t *)t->data)[i];
    return t->dtype == DT_BF16 ? bf16_to_fp32(h) : fp16_to_fp32(h);
}

static const char *desc(const struct gcase *c)
{
    static char s[160];
    snprintf(s, sizeof s, "in=%s ta=%d tb=%d m=%lld n=%lld k=%lld batch=%lld alpha=%g beta=%g bias=%d C=%s",
             dtype_name(c->in), c->sh.ta, c->sh.tb,
             (long long)c->sh.m, (long long)c->sh.n, (long long)c->sh.k, (long long)c->sh.batch, (double)c->sh.alpha,
             (double)c->sh.beta, c->sh.bias, dtype_name(c->c_dt));
    return s;
}

/* The exact value of output element (bi, i, j) and the tolerance of an fp32 result around it:
 * 1e-5 (|alpha| sum_k |a b| + |beta c_old| + |bias|). */
static double reference(const struct gcase *c, const struct prepared *p, int64_t bi, int64_t i, int64_t j,
                        double *bound)
{
    const struct gemm_args *g = &p->g;
    const float *a = p->ha + bi * g->stride_a, *b = p->hb + bi * g->stride_b;
    double s = 0.0, sabs = 0.0;
    for (int64_t q = 0; q < c->sh.k; q++) {
        double x = c->sh.ta ? a[q * c->sh.m + i] : a[i * c->sh.k + q];
        double y = c->sh.tb ? b[j * c->sh.k + q] : b[q * c->sh.n + j];
        s += x * y;
        sabs += fabs(x * y);
    }
    size_t ci = (size_t)(bi * g->stride_c + i * c->sh.n + j);
    double extra = (c->sh.beta != 0.0f ? (double)c->sh.beta * p->hc0[ci] : 0.0) + (c->sh.bias ? p->hbias[j] : 0.0);
    *bound = 1e-5 * (fabs((double)c->sh.alpha) * sabs + fabs(extra));
    return (double)c->sh.alpha * s + extra;
}

/* Every written element of out against the double reference (a 16-bit result may be off by half an
 * ulp of its dtype more: 2^-8 relative for bf16, 2^-11 for fp16); the pad between batch matrices must be left alone (NaN / C0).
 * With `other`, out is compared with it instead, at twice the tolerance (each is within 1x). */
static void check(const struct gcase *c, const struct prepared *p, const struct tensor *out,
                  const struct tensor *other, const char *path)
{
    const struct gemm_args *g = &p->g;
    for (int64_t bi = 0; bi < c->sh.batch; bi++) {
        for (int64_t i = 0; i < c->sh.m; i++)
            for (int64_t j = 0; j < c->sh.n; j++) {
                double bound, want = reference(c, p, bi, i, j, &bound);
                size_t ci = (size_t)(bi * g->stride_c + i * c->sh.n + j);
                if (other) {
                    want = get(other, ci);
                    bound *= 2.0;
                }
                if (c->c_dt != DT_FP32)
                    bound += (other ? 2.0 : 1.0) * (c->c_dt == DT_BF16 ? 0x1p-8 : 0x1p-11) * (fabs(want) + bound);
                double got = get(out, ci);
                cr_assert(fabs(got - want) <= bound, "%s %s: C[%lld][%lld][%lld] = %.9g, want %.9g (bound %.3g)", path,
                          desc(c), (long long)bi, (long long)i, (long long)j, got, want, bound);
            }
        for (int64_t e = c->sh.m * c->sh.n; e < g->stride_c && bi + 1 < c->sh.batch; e++) {
            size_t ci = (size_t)(bi * g->stride_c + e);
            float got = get(out, ci);
            if (c->sh.beta != 0.0f)
                cr_assert_eq(got, p->hc0[ci], "%s %s: pad element %zu written", path, desc(c), ci);
            else
                cr_assert(isnan(got), "%s %s: pad element %zu written", path, desc(c), ci);
        }
    }
}

static const struct gshape CASES[] = {
    /* ta, tb, m, n, k, batch, pad, alpha, beta, bias, C 16-bit */
    { 0, 0, 1, 1, 1, 1, 0, 1.0f, 0.0f, false, false },
    { 0, 0, 7, 31, 33, 1, 0, 1.0f, 0.0f, false, false },
    { 0, 0, 33, 7, 129, 1, 0, 0.5f, 0.0f, false, true },
    { 0, 0, 31, 33, 7, 2, 3, 1.0f, 1.0f, false, false },
    { 0, 0, 13, 129, 31, 3, 5, 2.0f, 1.0f, false, true },
    { 0, 0, 12, 32, 2, 1, 0, 1.0f, 0.0f, true, true },
    { 0, 0, 25, 65, 1, 1, 0, 1.0f, 0.0f, true, false },
    { 0, 0, 129, 33, 784, 1, 0, 1.0f, 0.0f, true, true },   /* 3 k blocks, partials in scratch */
    { 0, 0, 129, 33, 784, 1, 0, 1.0f, 0.0f, false, false },  /* 3 k blocks, partials in C */
    { 0, 0, 37, 45, 785, 2, 7, 1.0f, 1.0f, false, false },   /* odd k over blocks, beta 1, batch */
    { 0, 0, 19, 50, 785, 1, 0, 1.0f, 0.5f, false, true },
    { 0, 0, 200, 40, 17, 1, 0, 1.0f, 0.0f, false, false },   /* two m blocks */
    { 0, 0, 3, 2085, 9, 1, 0, 1.0f, 0.0f, true, true },     /* two n blocks */
    { 0, 0, 5, 2100, 400, 1, 0, 1.0f, 1.0f, false, false },  /* n and k blocks */
    { 0, 0, 14, 20, 15, 1, 0, 1.0f, 0.0f, true, true },      /* partial 16 x 16 transposes */
    /* the edge kernels' limits: 4 and 8 rows left (16, 20: 4- and 8-row kernels, exactly full), 16 and 17
     * columns left (48: the 16-column kernel, exactly full; 49: one column past it, the 32-column kernel) */
    { 0, 0, 16, 48, 40, 1, 0, 1.0f, 0.0f, false, false },
    { 0, 0, 20, 49, 40, 1, 0, 1.0f, 0.0f, true, false },
    { 0, 0, 20, 49, 40, 2, 3, 1.0f, 1.0f, false, false },
    { 0, 0, 17, 17, 9, 1, 0, 1.0f, 0.0f, false, true },
};

static void for_each_case(enum dtype in, void (*fn)(const struct gcase *c))
{
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++)
        for (int t = 0; t < 4; t++) {
            struct gcase c = gcase_of(CASES[i], in);
            c.sh.ta = t & 1;
            c.sh.tb = t >> 1;
            int t0 = n_t, m0 = n_mem;
            fn(&c);
            tracked_free_to(t0, m0); /* each case frees what it allocated */
        }
}

static void require_fast_path(enum dtype in)
{
    if (!gemm_avx512_supported(in))
        cr_skip_test("this CPU lacks AVX-512F/BW/VL%s: only the portable %s GEMM runs here",
                     in == DT_BF16 ? " or AVX512-BF16" : "", dtype_name(in));
}

static void case_fast_reference(const struct gcase *c)
{
    struct prepared p = prepare(c);
    run(under, &p);
    check(c, &p, p.g.c, NULL, under == dp ? "avx512 (AMPTRAIN_GEMM_AMX=0)" : "avx512");
}

static void case_portable_reference(const struct gcase *c)
{
    struct prepared p = prepare(c);
    run(port, &p);
    check(c, &p, p.g.c, NULL, "portable");
}

/* Both paths within twice the reference tolerance of each other (each is within 1x of exact). */
static void case_fast_vs_portable(const struct gcase *c)
{
    struct prepared p = prepare(c);
    run(under, &p);
    struct tensor *f = tnew(fast, c->c_dt, p.g.c->numel);
    memcpy(f->data, p.g.c->data, tensor_bytes(f));
    run(port, &p);
    check(c, &p, f, p.g.c, "avx512 vs portable");
}

static void case_deterministic(const struct gcase *c)
{
    struct prepared p = prepare(c);
    run(under, &p);
    struct tensor *f = tnew(fast, c->c_dt, p.g.c->numel);
    memcpy(f->data, p.g.c->data, tensor_bytes(f));
    run(under, &p);
    cr_assert(memcmp(f->data, p.g.c->data, tensor_bytes(f)) == 0, "%s: two runs differ", desc(c));
}

/* The four checks over every case for one input dtype. */
static void fast_reference(enum dtype in, unsigned s)
{
    require_fast_path(in);
    seed(s);
    for_each_case(in, case_fast_reference);
}

static void fast_vs_portable(enum dtype in, unsigned s)
{
    require_fast_path(in);
    seed(s);
    for_each_case(in, case_fast_vs_portable);
}

static void deterministic(enum dtype in, unsigned s)
{
    require_fast_path(in);
    seed(s);
    for_each_case(in, case_deterministic);
}

Test(gemm_avx512, fp32_fast_path_matches_double_reference) { fast_reference(DT_FP32, 21); }
Test(gemm_avx512, fp16_fast_path_matches_double_reference) { fast_reference(DT_FP16, 31); }
Test(gemm_avx512, bf16_fast_path_matches_double_reference) { fast_reference(DT_BF16, 11); }

Test(gemm_avx512, portable_path_matches_double_reference)
{
    const enum dtype ins[] = { DT_FP32, DT_FP16, DT_BF16 };
    for (int i = 0; i < 3; i++) {
        seed(12 + 10 * (unsigned)i);
        for_each_case(ins[i], case_portable_reference);
    }
}

Test(gemm_avx512, fp32_fast_path_matches_portable_path) { fast_vs_portable(DT_FP32, 23); }
Test(gemm_avx512, fp16_fast_path_matches_portable_path) { fast_vs_portable(DT_FP16, 33); }
Test(gemm_avx512, bf16_fast_path_matches_portable_path) { fast_vs_portable(DT_BF16, 13); }

Test(gemm_avx512, fp32_fast_path_is_deterministic) { deterministic(DT_FP32, 24); }
Test(gemm_avx512, fp16_fast_path_is_deterministic) { deterministic(DT_FP16, 34); }
Test(gemm_avx512, bf16_fast_path_is_deterministic) { deterministic(DT_BF16, 14); }

/* The same three for bf16 with AMPTRAIN_GEMM_AMX=0: vdpbf16ps, which is the default path only where the CPU has no
 * AMX (there these repeat the tests above). */
Test(gemm_avx512, bf16_vdpbf16ps_path_matches_double_reference) { under = dp; fast_reference(DT_BF16, 16); }
Test(gemm_avx512, bf16_vdpbf16ps_path_matches_portable_path) { under = dp; fast_vs_portable(DT_BF16, 17); }
Test(gemm_avx512, bf16_vdpbf16ps_path_is_deterministic) { under = dp; deterministic(DT_BF16, 18); }

/* Elements of a (5, 7, k 301) bf16 product on `be` whose bits differ from vdpbf16ps's order: within one k
 * block (301 < 384) each element starts from 0 and, for each pair of k (2q, 2q+1), adds a[2q+1] b[2q+1], then
 * a[2q] b[2q], each sum rounded to fp32 (a product of two bf16 is exact in fp32; values in [-1, 1), so no
 * subnormals). */
static int64_t vdpbf16ps_order_mismatches(struct backend *be)
{
    const int64_t m = 5, n = 7, k = 301;
    float *ha, *hb;
    struct tensor *a = trand(be, DT_BF16, (size_t)(m * k), &ha), *b = trand(be, DT_BF16, (size_t)(k * n), &hb);
    struct tensor *c = tnew(be, DT_FP32, (size_t)(m * n));
    struct gemm_args g = { .a = a, .b = b, .c = c, .m = m, .n = n, .k = k, .alpha = 1, .batch = 1 };
    be->gemm(be, &g);
    int64_t bad = 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float s = 0.0f;
            for (int64_t q = 0; 2 * q < k; q++) {
                if (2 * q + 1 < k)
                    s = s + ha[i * k + 2 * q + 1] * hb[(2 * q + 1) * n + j];
                s = s + ha[i * k + 2 * q] * hb[2 * q * n + j];
            }
            float got = ((const float *)c->data)[i * n + j];
            bad += memcmp(&s, &got, sizeof s) != 0;
        }
    return bad;
}

Test(gemm_avx512, bf16_vdpbf16ps_path_sums_in_its_documented_order)
{
    require_fast_path(DT_BF16);
    seed(19);
    int64_t bad = vdpbf16ps_order_mismatches(dp);
    cr_assert_eq(bad, 0, "%lld of 35 elements differ from vdpbf16ps's order", (long long)bad);
}

/* Where the CPU has AMX the default bf16 path is tdpbf16ps, whose sums are not in that order: the same
 * product differs in some elements (the tolerance tests above hold it to the exact value). */
Test(gemm_avx512, bf16_amx_path_is_the_default_where_the_cpu_has_amx)
{
    require_fast_path(DT_BF16);
    if (!gemm_avx512_amx_supported())
        cr_skip_test("this CPU has no AMX-BF16 (or Linux does not grant its tile data): bf16 runs on vdpbf16ps");
    seed(19);
    int64_t bad = vdpbf16ps_order_mismatches(fast);
    cr_assert_gt(bad, 0, "the default bf16 product summed exactly as vdpbf16ps does: AMX was not used");
}

/* AMX reads A's tiles in place where A's rows are contiguous in k, every panel has its 32 rows and the k block
 * is whole tiles (a_direct in gemm_avx512.c); the same op(A) stored transposed is always packed. Both give the
 * same bits: with k 784 two k blocks are read in place and the third (208, half a tile) packed; 512 is two
 * blocks in place; m 100 and a k of 70 are packed throughout. On one thread and on two (columns shared out). */
Test(gemm_avx512, bf16_amx_reads_a_in_place_as_it_packs_it)
{
    require_fast_path(DT_BF16);
    if (!gemm_avx512_amx_supported())
        cr_skip_test("this CPU has no AMX-BF16 (or Linux does not grant its tile data): bf16 runs on vdpbf16ps");
    struct amp_error err;
    struct backend *two = backend_cpu_create();
    cr_assert_not_null(two);
    cr_assert_eq(two->set_threads(two, 2, &err), AMP_OK, "%s", err.msg);
    const int64_t shapes[][3] = { { 128, 512, 784 }, { 64, 40, 512 }, { 100, 33, 512 }, { 32, 10, 70 } };
    seed(41);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
        float *ha, *hb;
        struct tensor *a = trand(fast, DT_BF16, (size_t)(m * k), &ha), *b = trand(fast, DT_BF16, (size_t)(n * k), &hb);
        struct tensor *at = tnew(fast, DT_BF16, (size_t)(m * k)); /* A^T: (k, m) */
        for (int64_t i = 0; i < m; i++)
            for (int64_t p = 0; p < k; p++)
                ((uint16_t *)at->data)[p * m + i] = ((const uint16_t *)a->data)[i * k + p];
        struct tensor *c[2][2];
        for (int t = 0; t < 2; t++)
            for (int packed = 0; packed < 2; packed++) {
                c[t][packed] = tnew(fast, DT_FP32, (size_t)(m * n));
                struct gemm_args g = { .a = packed ? at : a, .b = b, .c = c[t][packed], .trans_a = packed == 1,
                                       .trans_b = true, .m = m, .n = n, .k = k, .alpha = 1, .batch = 1 };
                (t ? two : fast)->gemm(t ? two : fast, &g);
            }
        for (int t = 0; t < 2; t++)
            cr_assert(memcmp(c[t][0]->data, c[t][1]->data, (size_t)(m * n) * sizeof(float)) == 0,
                      "(%lld x %lld x %lld) on %d thread(s): A read in place differs from A packed", (long long)m,
                      (long long)n, (long long)k, t + 1);
        cr_assert(memcmp(c[0][0]->data, c[1][0]->data, (size_t)(m * n) * sizeof(float)) == 0);
    }
    backend_close(two);
}

/* The ReLU epilogues (backend.h GEMM_EPI_RELU, GEMM_EPI_RELU_MASK) give the bits of the plain product followed by
 * the ReLU op over C in place: in gemm_avx512's epilogue (fp32, fp16, bf16 on AMX and on vdpbf16ps) and on the
 * portable path (the op after the product), one thread and two, one k block and several, with a bias. Rows of A
 * holding a NaN or an infinity give NaN and infinite results; the mask holds +0, -0, negatives, subnormals of
 * both signs, infinities and NaNs. */
static uint16_t mask_bits16(enum dtype dt, int v)
{
    const bool bf = dt == DT_BF16;
    switch (v % 9) {
    case 0: return 0x0000;                 /* +0 */
    case 1: return 0x8000;                 /* -0 */
    case 2: return 0x0001;                 /* the least subnormal */
    case 3: return 0x8001;
    case 4: return bf ? 0x7F80 : 0x7C00;   /* +inf */
    case 5: return bf ? 0xFF80 : 0xFC00;   /* -inf */
    case 6: return bf ? 0x7FC1 : 0x7E01;   /* a NaN */
    case 7: return bf ? 0xFFA0 : 0xFD00;   /* a NaN, sign set, quiet bit clear */
    default: return (uint16_t)(v % 2 ? 0x3C00 : 0xBC00); /* +-1 in fp16, +-2^-7 in bf16 */
    }
}

Test(gemm_avx512, relu_epilogues_are_the_product_then_the_relu_op)
{
    struct amp_error err;
    struct backend *two = backend_cpu_create();
    cr_assert_not_null(two);
    cr_assert_eq(two->set_threads(two, 2, &err), AMP_OK, "%s", err.msg);
    struct backend *bes[4] = { fast, dp, port, two };
    const char *names[4] = { "fast", "vdpbf16ps", "portable", "fast, 2 threads" };
    const int64_t shapes[][3] = { { 128, 96, 600 }, { 37, 50, 33 }, { 64, 130, 1 } };
    const enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    seed(43);
    for (int d = 0; d < 3; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const enum dtype dt = dts[d];
            const int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
            float *ha, *hb, *hbias;
            struct tensor *a = trand(fast, dt, (size_t)(m * k), &ha), *b = trand(fast, dt, (size_t)(n * k), &hb);
            struct tensor *bias = trand(fast, DT_FP32, (size_t)n, &hbias);
            const float specials[3] = { NAN, INFINITY, -INFINITY };
            for (int r = 0; r < 3; r++) { /* rows 3, 7, 11: one special value each */
                float v = specials[r];
                struct tensor one = *a;
                one.numel = 1;
                one.data = (char *)a->data + (size_t)((4 * r + 3) * k) * dtype_size(dt);
                tensor_from_host_f32(&one, &v);
            }
            struct tensor *mask = tnew(fast, dt, (size_t)(m * n));
            for (int64_t i = 0; i < m * n; i++) {
                if (dt == DT_FP32) {
                    const uint32_t w[9] = { 0, 0x80000000u, 1, 0x80000001u, 0x7F800000u, 0xFF800000u, 0x7FC00001u,
                                            0xFFA00000u, (uint32_t)(i % 2 ? 0x3F800000u : 0xBF800000u) };
                    ((uint32_t *)mask->data)[i] = w[(i * 7 + i / 5) % 9];
                } else {
                    ((uint16_t *)mask->data)[i] = mask_bits16(dt, (int)((i * 7 + i / 5) % 9));
                }
            }
            for (int e = 0; e < 2; e++) {
                const enum gemm_epilogue epi = e ? GEMM_EPI_RELU_MASK : GEMM_EPI_RELU;
                for (int w = 0; w < 4; w++) {
                    struct backend *be = bes[w];
                    struct tensor *want = tnew(fast, dt, (size_t)(m * n)), *got = tnew(fast, dt, (size_t)(m * n));
                    struct gemm_args g = { .a = a, .b = b, .c = want, .bias = bias, .trans_b = true, .m = m, .n = n,
                                           .k = k, .alpha = 1, .batch = 1 };
                    be->gemm(be, &g);
                    if (e)
                        be->act_backward(be, ACT_RELU, want, want, mask);
                    else
                        be->act_forward(be, ACT_RELU, want, want);
                    g.c = got;
                    g.epilogue = epi;
                    g.aux = e ? mask : NULL;
                    be->gemm(be, &g);
                    size_t bytes = (size_t)(m * n) * dtype_size(dt);
                    for (size_t i = 0; i < bytes; i++)
                        cr_assert_eq(((const unsigned char *)got->data)[i], ((const unsigned char *)want->data)[i],
                                     "%s %s (%lld x %lld x %lld) on %s: byte %zu of C differs from the product then "
                                     "the ReLU op", e ? "GEMM_EPI_RELU_MASK" : "GEMM_EPI_RELU", dtype_name(dt),
                                     (long long)m, (long long)n, (long long)k, names[w], i);
                }
            }
        }
    backend_close(two);
}

/* The training shapes of fashion_mlp (batch 128): forward X W^T, dX = dY W, dW = dY^T X, in each
 * input dtype. */
Test(gemm_avx512, fashion_mlp_shapes)
{
    const struct gshape cases[] = {
        { 0, 1, 128, 512, 784, 1, 0, 1.0f, 0.0f, true, true },
        { 0, 0, 128, 784, 512, 1, 0, 1.0f, 0.0f, false, true },
        { 1, 0, 512, 784, 128, 1, 0, 1.0f, 1.0f, false, false },
        { 0, 1, 128, 10, 512, 1, 0, 1.0f, 0.0f, true, true },
    };
    const enum dtype ins[] = { DT_FP32, DT_FP16, DT_BF16 };
    for (int d = 0; d < 3; d++) {
        require_fast_path(ins[d]);
        seed(15 + 10 * (unsigned)d);
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            struct gcase c = gcase_of(cases[i], ins[d]);
            case_fast_reference(&c);
            case_fast_vs_portable(&c);
        }
    }
}

/* Whether the upper halves of ymm0-15 / zmm0-15 are in use (XINUSE, xgetbv with ecx 1: bits 2 and 6); -1 where
 * the CPU cannot say. With them in use, every legacy-SSE instruction the baseline-compiled engine runs afterwards
 * waits on a merge with them (glibc's exp took 6x longer in the loss after an AMX product left them so). */
static int upper_halves_in_use(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0xD), "c"(1));
    if (!(eax & (1u << 2))) /* XGETBV with ecx 1 */
        return -1;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
    (void)hi;
    return (lo & ((1u << 2) | (1u << 6))) != 0;
#else
    return -1;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx"))) static void clear_upper_halves(void)
{
    __builtin_ia32_vzeroupper();
}
#else
static void clear_upper_halves(void) {}
#endif

/* Every fast path returns with the vector registers' upper halves clean (vzeroupper), on one thread and on the
 * pool: fp32, fp16, bf16 on AMX (the default where the CPU has it) and on vdpbf16ps, C fp32 and 16-bit, with a
 * bias, several k blocks. */
Test(gemm_avx512, products_return_with_the_vector_upper_halves_clean)
{
    if (upper_halves_in_use() < 0)
        cr_skip_test("this CPU does not report XINUSE (xgetbv 1)");
    const struct gshape shapes[] = {
        { 0, 1, 37, 45, 300, 1, 0, 1.0f, 0.0f, true, true },
        { 1, 0, 256, 300, 700, 1, 0, 1.0f, 1.0f, false, false },
    };
    const enum dtype ins[] = { DT_FP32, DT_FP16, DT_BF16 };
    struct backend *const bes[] = { fast, dp };
    int tried = 0;
    for (int d = 0; d < 3; d++) {
        if (!gemm_avx512_supported(ins[d]))
            continue;
        for (int b = 0; b < 2; b++)
            for (int threads = 1; threads <= 2; threads++) {
                struct amp_error err;
                cr_assert_eq(backend_set_threads(bes[b], threads, &err), AMP_OK);
                for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
                    struct gcase c = gcase_of(shapes[i], ins[d]);
                    struct prepared p = prepare(&c);
                    clear_upper_halves();
                    bes[b]->gemm(bes[b], &p.g);
                    int dirty = upper_halves_in_use();
                    cr_assert_eq(dirty, 0, "%s product (%s, %d thread(s), shape %zu) returned with upper halves in use",
                                 dtype_name(ins[d]), bes[b] == fast ? "default path" : "AMPTRAIN_GEMM_AMX=0", threads, i);
                    tried++;
                }
            }
    }
    if (!tried)
        cr_skip_test("no AVX-512 product on this CPU");
}

/* A 2 x 2 product of the raw bit patterns a[0..1], b[0..1] (k 1, dtype dt) on `be`: out[0] is
 * a[0] * b[0], out[1] is a[1] * b[1]. This also shows which path each backend takes. */
static void raw_products(struct backend *be, enum dtype dt, const void *ha, const void *hb, float out[2])
{
    struct tensor *a = tnew(be, dt, 2), *b = tnew(be, dt, 2), *c = tnew(be, DT_FP32, 4);
    memcpy(a->data, ha, 2 * dtype_size(dt));
    memcpy(b->data, hb, 2 * dtype_size(dt));
    struct gemm_args g = { .a = a, .b = b, .c = c, .m = 2, .n = 2, .k = 1, .alpha = 1, .batch = 1 };
    be->gemm(be, &g);
    out[0] = ((float *)c->data)[0];
    out[1] = ((float *)c->data)[3];
}

/* bf16: row 0: 2^-133 (the smallest bf16 subnormal, 0x0001) * 2^100 = 2^-33; row 1: 2^-70 * 2^-70 = 2^-140 */
static const uint16_t BF16_A[2] = { 0x0001, 0x1C80 }, BF16_B[2] = { 0x7180, 0x1C80 };

/* The documented deviation: vdpbf16ps reads bf16 subnormals as zero (DAZ) and flushes subnormal fp32
 * results (FTZ); the portable path keeps both. */
/* An odd k leaves the last pair of every packed line half empty; its partner must be a zero, never the element
 * after op(A)'s or op(B)'s last k (past the matrix, or the next row's). Here NaN follows each matrix (the pad of a
 * one-matrix batch) and every element must still match the reference: a NaN read and multiplied by a zero of the
 * other side would poison the sum. k 17 (one block) and 785 (an odd last block after full ones), every transpose,
 * on each fast path (fp32, fp16, bf16 on AMX where the CPU has it, and bf16 on vdpbf16ps). */
static void case_nan_past_k(const struct gcase *c)
{
    struct prepared p = prepare(c);
    struct tensor *ab[2] = { (struct tensor *)p.g.a, (struct tensor *)p.g.b };
    const int64_t size[2] = { c->sh.m * c->sh.k, c->sh.k * c->sh.n };
    for (int t = 0; t < 2; t++)
        for (size_t e = (size_t)size[t]; e < ab[t]->numel; e++) {
            if (c->in == DT_FP32)
                ((float *)ab[t]->data)[e] = NAN;
            else
                ((uint16_t *)ab[t]->data)[e] = c->in == DT_BF16 ? 0x7FC0 : 0x7E00;
        }
    run(under, &p);
    check(c, &p, p.g.c, NULL, "avx512, NaN past k");
}

Test(gemm_avx512, odd_k_never_reads_past_the_last_k)
{
    const enum dtype ins[3] = { DT_FP32, DT_FP16, DT_BF16 };
    const int64_t ks[2] = { 17, 785 };
    for (int d = 0; d < 3; d++) {
        if (!gemm_avx512_supported(ins[d]))
            continue;
        for (int path = 0; path < (ins[d] == DT_BF16 ? 2 : 1); path++) {
            under = path ? dp : fast;
            seed(41 + (unsigned)(3 * d + path));
            for (int ki = 0; ki < 2; ki++)
                for (int t = 0; t < 4; t++) {
                    /* pad: more than a row or column of either matrix, all NaN */
                    struct gshape sh = { t & 1, t >> 1, 40, 33, ks[ki], 1, 64, 1.0f, 0.0f, false, ins[d] != DT_FP32 };
                    struct gcase c = gcase_of(sh, ins[d]);
                    int t0 = n_t, m0 = n_mem;
                    case_nan_past_k(&c);
                    tracked_free_to(t0, m0);
                }
        }
    }
    under = fast;
}

Test(gemm_avx512, portable_path_keeps_subnormals)
{
    float out[2];
    raw_products(port, DT_BF16, BF16_A, BF16_B, out);
    cr_assert_eq(out[0], ldexpf(1.0f, -33));
    cr_assert_eq(out[1], ldexpf(1.0f, -140));
}

Test(gemm_avx512, bf16_fast_path_flushes_subnormals)
{
    require_fast_path(DT_BF16);
    struct backend *bes[2] = { fast, dp }; /* AMX where present; vdpbf16ps */
    for (int i = 0; i < 2; i++) {
        float out[2];
        raw_products(bes[i], DT_BF16, BF16_A, BF16_B, out);
        cr_assert_eq(out[0], 0.0f, "a bf16 subnormal input counts as zero on the %s path, got %g",
                     i ? "vdpbf16ps" : "default", (double)out[0]);
        cr_assert_eq(out[1], 0.0f, "a subnormal fp32 product is flushed on the %s path, got %g",
                     i ? "vdpbf16ps" : "default", (double)out[1]);
    }
}

/* The FMA path is plain IEEE fp32: subnormal inputs and results are kept. */
Test(gemm_avx512, fp32_fast_path_keeps_subnormals)
{
    require_fast_path(DT_FP32);
    const float a[2] = { ldexpf(1.0f, -140), ldexpf(1.0f, -70) }, b[2] = { ldexpf(1.0f, 100), ldexpf(1.0f, -70) };
    float out[2];
    raw_products(fast, DT_FP32, a, b, out);
    cr_assert_eq(out[0], ldexpf(1.0f, -40), "a subnormal fp32 input is kept, got %g", (double)out[0]);
    cr_assert_eq(out[1], ldexpf(1.0f, -140), "a subnormal fp32 product is kept, got %g", (double)out[1]);
}

Test(gemm_avx512, fp16_fast_path_keeps_subnormals)
{
    require_fast_path(DT_FP16);
    /* row 0: 2^-24 (the smallest fp16 subnormal, 0x0001) * 2^10; row 1: 2^-20 (subnormal, 0x0010) * 2^-20 */
    const uint16_t a[2] = { 0x0001, 0x0010 }, b[2] = { 0x6400, 0x0010 };
    float out[2];
    raw_products(fast, DT_FP16, a, b, out);
    cr_assert_eq(out[0], ldexpf(1.0f, -14), "an fp16 subnormal input is widened exactly, got %g", (double)out[0]);
    cr_assert_eq(out[1], ldexpf(1.0f, -40), "got %g", (double)out[1]);
}

Test(gemm_avx512, amp_gemm_portable_0_keeps_the_fast_path)
{
    require_fast_path(DT_BF16);
    setenv("AMPTRAIN_GEMM_PORTABLE", "0", 1);
    struct backend *be = backend_cpu_create();
    unsetenv("AMPTRAIN_GEMM_PORTABLE");
    cr_assert_not_null(be);
    float out[2];
    raw_products(be, DT_BF16, BF16_A, BF16_B, out);
    tracked_free_to(n_t - 3, n_mem); /* its three tensors, before the backend goes */
    backend_close(be);
    cr_assert_eq(out[0], 0.0f);
}
