/*
 * test_cpu_elementwise.c — the elementwise ops (kernels/cpu/elementwise.c): activations forward and backward (known values, a
 * dense GELU sweep, every 16-bit ReLU input, finite differences), add, and dropout's documented mask.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

#include "rng.h" /* rng_uniform: the documented dropout mask */

static const double PI = 3.14159265358979323846;

TestSuite(cpu_elementwise, .init = cpu_test_setup, .fini = cpu_test_teardown);

/* ---- activations, add, dropout ----------------------------------------------------------------- */

static double act_d(enum act_kind kind, double x)
{
    switch (kind) {
    case ACT_RELU: return x > 0 ? x : 0;
    case ACT_GELU_TANH: return 0.5 * x * (1 + tanh(sqrt(2 / PI) * (x + 0.044715 * x * x * x)));
    case ACT_GELU_ERF: return 0.5 * x * (1 + erf(x / sqrt(2.0)));
    }
    return NAN;
}

Test(cpu_elementwise, act_known_values)
{
    float hx[4] = { -1, 0, 1, 2 };
    struct tensor *x = tfrom(DT_FP32, 4, hx), *y = tnew(DT_FP32, 4);
    be->act_forward(be, ACT_RELU, y, x);
    check_f32(y, (double[]){ 0, 0, 1, 2 }, 4, 0, 0, "relu");
    be->act_forward(be, ACT_GELU_TANH, y, x);
    check_f32(y, (double[]){ -0.15880800939172324, 0, 0.8411919906082768, 1.9545976940871322 }, 4, 1e-6, 1e-7,
              "gelu tanh");
    be->act_forward(be, ACT_GELU_ERF, y, x);
    check_f32(y, (double[]){ -0.15865525393145707, 0, 0.8413447460685429, 1.9544997361036416 }, 4, 1e-6, 1e-7,
              "gelu erf");
    float hn[1] = { NAN };
    struct tensor *xn = tfrom(DT_FP32, 1, hn), *yn = tnew(DT_FP32, 1);
    ((float *)yn->data)[0] = 0;
    be->act_forward(be, ACT_RELU, yn, xn);
    cr_assert(isnan(((float *)yn->data)[0]), "relu must not hide a NaN");
}

/* GELU (tanh) over a dense sweep of [-12, 12] and special values, against the formula in double:
 * the backend's own tanh (kernels/cpu/vecmath.h, tanh_f32) must be as good as libm's. Bound per element:
 * 0.5 |x| (4 ulp of 1) for tanh and the 1 + t, plus 2 ulp of the result. */
Test(cpu_elementwise, gelu_tanh_dense_sweep)
{
    const size_t n = 240001;
    float *hx = falloc(n + 4);
    for (size_t i = 0; i < n; i++)
        hx[i] = -12.0f + 24.0f * (float)i / (float)(n - 1);
    hx[n] = 1e-30f, hx[n + 1] = -1e-30f, hx[n + 2] = INFINITY, hx[n + 3] = NAN;
    struct tensor *x = tfrom(DT_FP32, n + 4, hx), *y = tnew(DT_FP32, n + 4);
    be->act_forward(be, ACT_GELU_TANH, y, x);
    const float *hy = y->data;
    for (size_t i = 0; i < n + 2; i++) {
        double v = hx[i], want = act_d(ACT_GELU_TANH, v);
        float wf = (float)fabs(want);
        double bound = 0.5 * fabs(v) * 4 * 0x1p-24 + 2 * ((double)nextafterf(wf, INFINITY) - wf);
        cr_assert(fabs(hy[i] - want) <= bound, "gelu_tanh(%.9g) = %.9g, want %.9g (bound %.3g)", v, (double)hy[i],
                  want, bound);
    }
    cr_assert(isinf(hy[n + 2]) && hy[n + 2] > 0, "gelu_tanh(inf) = %g", (double)hy[n + 2]);
    cr_assert(isnan(hy[n + 3]), "gelu_tanh must not hide a NaN, got %g", (double)hy[n + 3]);
}

Test(cpu_elementwise, act_forward_all_dtypes)
{
    seed(5);
    enum dtype dts[3] = { DT_FP32, DT_FP16, DT_BF16 };
    enum act_kind kinds[3] = { ACT_RELU, ACT_GELU_TANH, ACT_GELU_ERF };
    for (int di = 0; di < 3; di++)
        for (int dout = 0; dout < 3; dout++)
            for (int k = 0; k < 3; k++) {
                size_t n = 2500; /* more than one block */
                float *hx;
                struct tensor *x = trand(dts[di], n, -5, 5, &hx), *y = tnew(dts[dout], n);
                be->act_forward(be, kinds[k], y, x);
                double *want = dalloc(n);
                for (size_t i = 0; i < n; i++)
                    want[i] = act_d(kinds[k], hx[i]);
                check_out(y, want, n, 2e-6, 1e-6, "act_forward");
            }
}

/* ReLU and its gradient on 16-bit tensors (all bf16 or all fp16) work on the bits without widening: every one of
 * the 65536 inputs, and 65536 gradients against them, must give the bits of widening to fp32, x <= 0 ? 0 : x
 * (dy for the gradient) and rounding back, NaN payloads, signed zeros and infinities included. */
Test(cpu_elementwise, relu_on_16_bit_tensors_gives_the_bits_of_the_fp32_round_trip)
{
    const size_t n = 65536;
    enum dtype dts[2] = { DT_BF16, DT_FP16 };
    float *xf = falloc(n), *gf = falloc(n), *want = falloc(n);
    uint16_t *want16 = talloc(n * sizeof *want16);
    for (int d = 0; d < 2; d++) {
        enum dtype dt = dts[d];
        struct tensor *x = tnew(dt, n), *dy = tnew(dt, n), *y = tnew(dt, n), *dx = tnew(dt, n);
        uint16_t *hx = x->data, *hdy = dy->data;
        for (size_t i = 0; i < n; i++) {
            hx[i] = (uint16_t)i;
            /* odd multiplier: every pattern once, against another x; x = +0 meets a gradient of 1.0 in bf16 */
            hdy[i] = (uint16_t)(i * 40503u + 0x3F80u);
        }
        dtype_convert(xf, DT_FP32, hx, dt, n);
        dtype_convert(gf, DT_FP32, hdy, dt, n);
        be->act_forward(be, ACT_RELU, y, x);
        for (size_t i = 0; i < n; i++)
            want[i] = xf[i] <= 0.0f ? 0.0f : xf[i];
        dtype_convert(want16, dt, want, DT_FP32, n);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(((uint16_t *)y->data)[i], want16[i], "%s relu(0x%04zx) = 0x%04x, want 0x%04x",
                         dtype_name(dt), i, ((uint16_t *)y->data)[i], want16[i]);
        be->act_backward(be, ACT_RELU, dx, dy, x);
        for (size_t i = 0; i < n; i++)
            want[i] = xf[i] <= 0.0f ? 0.0f : gf[i];
        dtype_convert(want16, dt, want, DT_FP32, n);
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(((uint16_t *)dx->data)[i], want16[i], "%s relu'(0x%04zx) * 0x%04x = 0x%04x, want 0x%04x",
                         dtype_name(dt), i, hdy[i], ((uint16_t *)dx->data)[i], want16[i]);
    }
}

struct act_ctx {
    enum act_kind kind;
    const double *w;
};

static double act_loss(const double *x, void *vctx)
{
    struct act_ctx *c = vctx;
    double s = 0;
    for (size_t i = 0; i < 64; i++)
        s += c->w[i] * act_d(c->kind, x[i]);
    return s;
}

Test(cpu_elementwise, act_backward_matches_finite_differences)
{
    seed(6);
    enum act_kind kinds[3] = { ACT_RELU, ACT_GELU_TANH, ACT_GELU_ERF };
    for (int k = 0; k < 3; k++) {
        size_t n = 64;
        float *hx, *hw;
        struct tensor *x = trand(DT_FP32, n, -4, 4, &hx), *w = trand(DT_FP32, n, -1, 1, &hw);
        for (size_t i = 0; i < n; i++)
            if (fabsf(hx[i]) < 1e-3f) /* keep relu's kink away from the difference stencil */
                hx[i] = ((float *)x->data)[i] = 0.5f;
        struct tensor *dx = tnew(DT_FP32, n);
        be->act_backward(be, kinds[k], dx, w, x);
        struct act_ctx c = { kinds[k], to_d(hw, n) };
        double *want = dalloc(n);
        fd_grad(act_loss, &c, to_d(hx, n), n, 1e-5, want);
        check_grad(dx->data, want, n, 1e-5, 1e-6, "act_backward");
        /* 16-bit output: the same gradient rounded once */
        struct tensor *dx16 = tnew(DT_BF16, n);
        be->act_backward(be, kinds[k], dx16, w, x);
        double *exact = to_d(dx->data, n);
        check_lowp(dx16, exact, n, 1, 0, "act_backward bf16");
    }
    /* large |x|: the derivative saturates cleanly instead of 0 * Inf */
    float big[2] = { 1e20f, -1e20f }, ones[2] = { 1, 1 };
    struct tensor *xb = tfrom(DT_FP32, 2, big), *g = tfrom(DT_FP32, 2, ones), *d = tnew(DT_FP32, 2);
    be->act_backward(be, ACT_GELU_TANH, d, g, xb);
    check_f32(d, (double[]){ 1, 0 }, 2, 0, 0, "gelu tanh' at +-1e20");
    be->act_backward(be, ACT_GELU_ERF, d, g, xb);
    check_f32(d, (double[]){ 1, 0 }, 2, 0, 0, "gelu erf' at +-1e20");
}

Test(cpu_elementwise, add_mixed_dtypes)
{
    seed(7);
    size_t n = 3000;
    float *ha, *hb;
    struct tensor *a = trand(DT_FP16, n, -100, 100, &ha), *b = trand(DT_FP32, n, -1, 1, &hb);
    enum dtype outs[3] = { DT_FP32, DT_FP16, DT_BF16 };
    double *want = dalloc(n);
    for (size_t i = 0; i < n; i++)
        want[i] = (double)(ha[i] + hb[i]); /* the fp32 sum, rounded once to y */
    for (int o = 0; o < 3; o++) {
        struct tensor *y = tnew(outs[o], n);
        be->add(be, y, a, b);
        if (outs[o] == DT_FP32)
            check_f32(y, want, n, 0, 0, "add fp32");
        else
            check_lowp(y, want, n, 0, 0, "add lowp");
    }
}

Test(cpu_elementwise, dropout_mask_is_a_pure_function_of_key)
{
    seed(8);
    size_t n = 100000;
    float p = 0.25f, scale = 1.0f / (1.0f - p);
    float *hx = falloc(n);
    for (size_t i = 0; i < n; i++)
        hx[i] = frand(0.5f, 2.0f); /* never zero, so y == 0 means dropped */
    struct tensor *x = tfrom(DT_FP32, n, hx);
    struct rng_key key = { .seed = 1234, .stream = 3, .counter = 77 };
    struct tensor *y1 = tnew(DT_FP32, n), *y2 = tnew(DT_FP32, n), *y3 = tnew(DT_FP32, n), *y4 = tnew(DT_FP32, n);
    be->dropout_forward(be, y1, x, p, key);
    be->dropout_forward(be, y2, x, p, key);
    cr_assert_eq(memcmp(y1->data, y2->data, n * sizeof(float)), 0, "same key, same mask");
    struct rng_key key_c = key, key_s = key;
    key_c.counter++;
    key_s.stream++;
    be->dropout_forward(be, y3, x, p, key_c);
    be->dropout_forward(be, y4, x, p, key_s);
    const float *a = y1->data, *c = y3->data, *s = y4->data;
    size_t kept = 0, diff_c = 0, diff_s = 0;
    uint64_t stream = (key.stream << 20) + (key.counter >> 32);
    for (size_t i = 0; i < n; i++) {
        bool k = a[i] != 0.0f;
        kept += k;
        diff_c += k != (c[i] != 0.0f);
        diff_s += k != (s[i] != 0.0f);
        /* the documented mask, which the CUDA backend reproduces */
        bool expect = rng_uniform(key.seed, stream, (key.counter << 32) | i) >= p;
        cr_assert_eq(k, expect, "mask[%zu] differs from the documented formula", i);
        cr_assert_eq(a[i], k ? hx[i] * scale : 0.0f);
    }
    double frac = (double)kept / (double)n;
    cr_assert(fabs(frac - 0.75) < 0.01, "kept fraction %.4f, want 0.75", frac);
    /* independent masks disagree on about 2 p (1-p) = 37.5% of elements */
    cr_assert(fabs((double)diff_c / (double)n - 0.375) < 0.02, "counter+1 mask differs on %zu", diff_c);
    cr_assert(fabs((double)diff_s / (double)n - 0.375) < 0.02, "stream+1 mask differs on %zu", diff_s);

    /* backward: the forward's mask and scale */
    float *hdy;
    struct tensor *dy = trand(DT_FP32, n, 0.5f, 2.0f, &hdy), *dx = tnew(DT_FP32, n);
    be->dropout_backward(be, dx, dy, p, key);
    const float *d = dx->data;
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(d[i], a[i] != 0.0f ? hdy[i] * scale : 0.0f, "dropout backward [%zu]", i);

    /* p = 0: a copy, converting */
    struct tensor *y16 = tnew(DT_BF16, n);
    be->dropout_forward(be, y16, x, 0.0f, key);
    for (size_t i = 0; i < n; i += 997)
        cr_assert_eq(((uint16_t *)y16->data)[i], bf16_from_fp32(hx[i]));
}

/* A training step names its step through backend memory (backend.h struct rng_key: counter + *step * per_step, the
 * step read when the op runs), so that one recorded launch serves every step on a GPU: the CPU reads it from its
 * memory the same way. The mask is that of the plain key with the whole counter, and writing another step into the
 * memory, with the same key, gives the next step's mask (a counter above 2^32 too: its high half moves the stream). */
Test(cpu_elementwise, dropout_reads_the_step_from_backend_memory)
{
    seed(10);
    size_t n = 5000;
    float p = 0.3f;
    float *hx, *hdy;
    struct tensor *x = trand(DT_BF16, n, 0.5f, 2.0f, &hx), *dy = trand(DT_FP32, n, -1.0f, 1.0f, &hdy);
    int64_t *step = be->alloc(be, sizeof *step);
    cr_assert_not_null(step);
    const uint64_t per_step = 6, within = 4;
    struct rng_key dev = { .seed = 99, .stream = 2, .counter = within, .step = step, .per_step = per_step };
    const int64_t steps[3] = { 5, 6, INT64_C(3000000000) };
    uint16_t *before = NULL;
    for (int k = 0; k < 3; k++) {
        be->upload(be, step, &steps[k], sizeof *step);
        struct rng_key plain = { .seed = 99, .stream = 2, .counter = (uint64_t)steps[k] * per_step + within };
        struct tensor *y_dev = tnew(DT_BF16, n), *y_plain = tnew(DT_BF16, n);
        struct tensor *dx_dev = tnew(DT_FP32, n), *dx_plain = tnew(DT_FP32, n);
        be->dropout_forward(be, y_dev, x, p, dev);
        be->dropout_forward(be, y_plain, x, p, plain);
        be->dropout_backward(be, dx_dev, dy, p, dev);
        be->dropout_backward(be, dx_plain, dy, p, plain);
        cr_assert_eq(memcmp(y_dev->data, y_plain->data, n * 2), 0, "step %lld: forward", (long long)steps[k]);
        cr_assert_eq(memcmp(dx_dev->data, dx_plain->data, n * 4), 0, "step %lld: backward", (long long)steps[k]);
        if (before) { /* the same key, another step in memory: another mask */
            size_t differ = 0;
            for (size_t i = 0; i < n; i++)
                differ += (before[i] == 0) != (((uint16_t *)y_dev->data)[i] == 0);
            cr_assert_gt(differ, n / 5, "step %lld: the mask did not follow the step in memory (%zu differ)",
                         (long long)steps[k], differ);
        }
        before = y_dev->data;
    }
    be->free(be, step);
}

Test(cpu_elementwise, dropout_lowp_rounds_scaled_values)
{
    seed(9);
    size_t n = 4096;
    float *hx;
    struct tensor *x = trand(DT_FP16, n, 0.5f, 2.0f, &hx), *y = tnew(DT_FP16, n);
    float p = 0.1f, scale = 1.0f / (1.0f - p);
    struct rng_key key = { .seed = 5, .stream = 0, .counter = 1 };
    be->dropout_forward(be, y, x, p, key);
    const uint16_t *yb = y->data;
    for (size_t i = 0; i < n; i++)
        cr_assert(yb[i] == 0 || yb[i] == fp16_from_fp32(hx[i] * scale), "[%zu]", i);
}
