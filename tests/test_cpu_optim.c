/*
 * test_cpu_optim.c — the optimizer updates (kernels/cpu/optim.c): AdamW against PyTorch's formula (subnormal moments to
 * the bit), SGD with momentum and Nesterov, skipped steps, many tensors a call, bf16 masters and moments (to
 * nearest and stochastic), and the trial that finds an update that would go non-finite.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

#include "sround.h" /* sr_seed: bf16 master weights */

TestSuite(cpu_optim, .init = cpu_test_setup, .fini = cpu_test_teardown);

/* ---- optimizers -------------------------------------------------------------------------------- */

Test(cpu_optim, adamw_matches_pytorch_formula)
{
    seed(23);
    size_t n = 1500;
    float *hp, *hg;
    struct tensor *p = trand(DT_FP32, n, -1, 1, &hp), *g = trand(DT_FP32, n, -1000, 1000, &hg);
    struct tensor *m = tnew(DT_FP32, n), *v = tnew(DT_FP32, n), *lowp = tnew(DT_BF16, n);
    be->zero(be, m);
    be->zero(be, v);
    struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.1f };
    struct step_scalars sc;
    float lr_f = 1e-2f, gm = 1.0f / 1024;
    struct optim_update_args a = { .master = p, .grad = g, .m = m, .v = v, .copy = lowp, .sc = &sc,
                                   .weight_decay = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f };
    double *wp = to_d(hp, n), *wm = dalloc(n), *wv = dalloc(n);
    for (int64_t step = 1; step <= 2; step++) {
        step_rule_scalars(&sc, &sp, lr_f, step, gm);
        be->adamw_update(be, &a, 1);
        double b1 = a.beta1, b2 = a.beta2, lr = lr_f, wd = a.weight_decay;
        double bc1 = 1 - pow(b1, (double)step), bc2 = 1 - pow(b2, (double)step);
        for (size_t i = 0; i < n; i++) {
            double gi = (double)hg[i] * gm;
            wp[i] *= 1 - lr * wd;
            wm[i] = b1 * wm[i] + (1 - b1) * gi;
            wv[i] = b2 * wv[i] + (1 - b2) * gi * gi;
            wp[i] -= lr / bc1 * wm[i] / (sqrt(wv[i]) / sqrt(bc2) + a.eps);
        }
        check_f32(p, wp, n, 1e-6, 1e-7, "adamw master");
        check_f32(m, wm, n, 1e-5, 1e-9, "adamw m");
        check_f32(v, wv, n, 1e-5, 1e-12, "adamw v");
        const uint16_t *lb = lowp->data;
        const float *pm = p->data;
        for (size_t i = 0; i < n; i++)
            cr_assert_eq(lb[i], bf16_from_fp32(pm[i]), "lowp copy is the new master rounded once");
    }
    /* the first step moves each weight by about lr against the gradient's sign (plus decay) */
    struct optim_update_args b = a;
    float hp1 = 0.5f, hg1 = -3.0f;
    b.master = tfrom(DT_FP32, 1, &hp1);
    b.grad = tfrom(DT_FP32, 1, &hg1);
    b.m = tnew(DT_FP32, 1);
    b.v = tnew(DT_FP32, 1);
    be->zero(be, b.m);
    be->zero(be, b.v);
    b.copy = NULL;
    step_rule_scalars(&sc, &sp, lr_f, 1, 1.0f);
    be->adamw_update(be, &b, 1);
    check_f32(b.master, (double[]){ 0.5 * (1 - 1e-3) + 1e-2 * 3.0 / (3.0 + 1e-8) }, 1, 1e-6, 0, "adamw step 1");
}

/* A value of class `cls` for the subnormal test below: 0, -0, a subnormal (often one of the few smallest, where
 * a first moment that keeps shrinking stops), a normal number just above fp32's subnormals, or an ordinary one. */
static float subnormal_case_value(int cls, float ordinary)
{
    float sign = urand() < 0.5 ? -1.0f : 1.0f;
    switch (cls) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: { /* k * 2^-149 */
        uint32_t k = urand() < 0.5 ? 1 + (uint32_t)(urand() * 8) : 1 + (uint32_t)(urand() * 0x7FFFFE);
        float f;
        memcpy(&f, &k, sizeof f);
        return sign * f;
    }
    case 3: return sign * (float)ldexp(1.0 + urand(), -126 + (int)(urand() * 80)); /* 2^-126 .. 2^-46 */
    default: return sign * ordinary * (float)(0.25 + urand());
    }
}

/* AdamW's bits where moments, gradients or weights are subnormal (or about to be): the backend against the fp32
 * formula run plainly here, every bit of p, m and v, over several steps, with and without weight decay. Subnormals
 * slow the update (docs/perf.md, "Subnormal moments"); whatever a faster path does about them (flush them, set
 * MXCSR's FTZ/DAZ, compute them another way) must keep these bits. The first part of the tensor has ordinary second
 * moments and gradients (first moments alone near the subnormals, the common case); the rest mixes every class. */
Test(cpu_optim, adamw_subnormal_moments_have_the_fp32_formulas_bits)
{
    seed(29);
    const size_t n = 4096 + 13, split = 2048;
    float *hp = malloc(n * sizeof *hp), *hm = malloc(n * sizeof *hm), *hv = malloc(n * sizeof *hv),
          *hg = malloc(n * sizeof *hg);
    cr_assert(hp && hm && hv && hg);
    for (size_t i = 0; i < n; i++) {
        bool mixed = i >= split;
        int mcls = urand() < 0.25 ? 2 : (int)(urand() * 5);
        int vcls = mixed ? (int)(urand() * 5) : (urand() < 0.2 ? 0 : 4);
        int gcls = mixed ? (int)(urand() * 5) : (urand() < 0.5 ? (int)(urand() * 2) : 4);
        int pcls = mixed && urand() < 0.1 ? (int)(urand() * 4) : 4;
        hm[i] = subnormal_case_value(mcls, 1e-3f);
        hv[i] = fabsf(subnormal_case_value(vcls, 1e-6f));
        hg[i] = subnormal_case_value(gcls, urand() < 0.5 ? 1e3f : 1e-3f);
        hp[i] = subnormal_case_value(pcls, 0.1f);
    }
    struct tensor *p = tfrom(DT_FP32, n, hp), *m = tfrom(DT_FP32, n, hm), *v = tfrom(DT_FP32, n, hv),
                  *g = tfrom(DT_FP32, n, hg);
    struct step_scalars sc;
    const float wds[2] = { 0.0f, 0.01f }, gms[2] = { 1.0f / 65536, 1.0f };
    int64_t subnormal_m = 0;
    for (int step = 1; step <= 6; step++) {
        float wd = wds[step % 2], gm = gms[step / 4];
        struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = wd };
        step_rule_scalars(&sc, &sp, step == 3 ? 1e-30f : 1e-3f, step, gm);
        struct optim_update_args a = { .master = p, .grad = g, .m = m, .v = v, .sc = &sc, .weight_decay = wd,
                                       .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8f };
        be->adamw_update(be, &a, 1);
        float neg_step = sc.adam_neg_step, bc2_sqrt = sc.adam_bc2_sqrt, decay = sc.adam_decay;
        float b1 = 0.9f, b2 = 0.999f, omb1 = (float)(1.0 - 0.9), omb2 = (float)(1.0 - 0.999), eps = 1e-8f;
        for (size_t i = 0; i < n; i++) {
            float gi = hg[i] * sc.grad_mul;
            float pi = wd != 0.0f ? hp[i] * decay : hp[i];
            float mi = b1 * hm[i] + omb1 * gi;
            float vi = b2 * hv[i] + omb2 * gi * gi;
            float denom = sqrtf(vi) / bc2_sqrt + eps;
            hp[i] = pi + neg_step * mi / denom;
            hm[i] = mi;
            hv[i] = vi;
            subnormal_m += mi != 0.0f && fabsf(mi) < 0x1p-126f;
        }
        const char *names[3] = { "p", "m", "v" };
        const float *got[3] = { p->data, m->data, v->data }, *want[3] = { hp, hm, hv };
        for (int t = 0; t < 3; t++)
            for (size_t i = 0; i < n; i++) {
                uint32_t gb, wb;
                memcpy(&gb, &got[t][i], sizeof gb);
                memcpy(&wb, &want[t][i], sizeof wb);
                cr_assert_eq(gb, wb, "step %d, %s[%zu]: 0x%08x (%a), the fp32 formula gives 0x%08x (%a)", step,
                             names[t], i, gb, (double)got[t][i], wb, (double)want[t][i]);
            }
    }
    cr_assert_gt(subnormal_m, 1000, "the case holds subnormal first moments (%lld)", (long long)subnormal_m);
    free(hp), free(hm), free(hv), free(hg);
}

/* 1 - beta is computed in double and then rounded, as PyTorch passes the Python float 1 - beta2 to
 * addcmul_: for beta2 = 0.999 the factor is 0.001f, not 1.0f - 0.999f = 0.00099998713.
 * One step from v = 0 with g = 1 makes v exactly that factor. */
Test(cpu_optim, adamw_one_minus_beta_is_rounded_from_double_as_pytorch_does)
{
    float hp = 0.5f, hg = 1.0f;
    struct tensor *p = tfrom(DT_FP32, 1, &hp), *g = tfrom(DT_FP32, 1, &hg), *m = tnew(DT_FP32, 1),
                  *v = tnew(DT_FP32, 1);
    be->zero(be, m);
    be->zero(be, v);
    struct step_params sp = {.beta1 = 0.9, .beta2 = 0.999};
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 1e-3f, 1, 1.0f);
    struct optim_update_args a = {.master = p, .grad = g, .m = m, .v = v, .sc = &sc, .beta1 = 0.9, .beta2 = 0.999,
                                  .eps = 1e-8f};
    be->adamw_update(be, &a, 1);
    float got_m = ((const float *)m->data)[0], got_v = ((const float *)v->data)[0];
    cr_assert_eq(got_v, (float)(1.0 - 0.999), "v = %.9g, want (float)(1 - 0.999) = %.9g (1.0f - 0.999f is %.9g)",
                 (double)got_v, (double)(float)(1.0 - 0.999), (double)(1.0f - 0.999f));
    cr_assert_eq(got_m, (float)(1.0 - 0.9), "m = %.9g, want %.9g", (double)got_m, (double)(float)(1.0 - 0.9));
}

static void sgd_reference(double *p, double *buf, const float *g, size_t n, double gm, double lr, double wd,
                          double mom, bool nesterov, bool first)
{
    for (size_t i = 0; i < n; i++) {
        double gi = g[i] * gm + wd * p[i];
        buf[i] = first ? gi : mom * buf[i] + gi;
        gi = nesterov ? gi + mom * buf[i] : buf[i];
        p[i] -= lr * gi;
    }
}

Test(cpu_optim, sgd_momentum_and_nesterov_two_steps)
{
    seed(24);
    size_t n = 1100;
    for (int nesterov = 0; nesterov < 2; nesterov++) {
        float *hp, *hg;
        struct tensor *p = trand(DT_FP32, n, -1, 1, &hp), *g = trand(DT_FP32, n, -4, 4, &hg);
        struct tensor *buf = tnew(DT_FP32, n), *lowp = tnew(DT_FP16, n);
        struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f };
        struct step_scalars sc;
        struct optim_update_args a = { .master = p, .grad = g, .m = buf, .copy = lowp, .sc = &sc,
                                       .weight_decay = 0.01f, .momentum = 0.9f, .nesterov = nesterov };
        double *wp = to_d(hp, n), *wb = dalloc(n);
        for (int step = 0; step < 2; step++) {
            /* the poisoned buffer must not be read on the first step (sc.first_step) */
            step_rule_scalars(&sc, &sp, 0.1f, step + 1, 0.5f);
            cr_assert_eq(sc.first_step, step == 0);
            be->sgd_update(be, &a, 1);
            sgd_reference(wp, wb, hg, n, sc.grad_mul, sc.lr, a.weight_decay, a.momentum, nesterov, step == 0);
            check_f32(p, wp, n, 1e-6, 1e-7, nesterov ? "sgd nesterov master" : "sgd momentum master");
            check_f32(buf, wb, n, 1e-6, 1e-7, "sgd momentum buffer");
            const uint16_t *lb = lowp->data;
            for (size_t i = 0; i < n; i++)
                cr_assert_eq(lb[i], fp16_from_fp32(((float *)p->data)[i]));
        }
    }
    /* plain SGD: no buffer */
    float hp = 1.0f, hg = 2.0f;
    struct step_scalars sc = { .grad_mul = 1, .lr = 0.25f };
    struct optim_update_args s = { .master = tfrom(DT_FP32, 1, &hp), .grad = tfrom(DT_FP32, 1, &hg), .sc = &sc };
    be->sgd_update(be, &s, 1);
    check_f32(s.master, (double[]){ 0.5 }, 1, 0, 0, "p - lr g");
}

/* A skipped step (sc->skip, written by step_finish on non-finite gradients) leaves the master, the
 * moments and the low-precision copy exactly as they were, even with Inf/NaN in the gradient. */
Test(cpu_optim, optimizer_updates_leave_everything_on_a_skipped_step)
{
    seed(25);
    size_t n = 600;
    float *hp, *hg;
    struct tensor *p = trand(DT_FP32, n, -1, 1, &hp), *g = trand(DT_FP32, n, -1, 1, &hg);
    ((float *)g->data)[5] = INFINITY;
    ((float *)g->data)[9] = NAN;
    struct tensor *m = trand(DT_FP32, n, -1, 1, NULL), *v = trand(DT_FP32, n, 0, 1, NULL), *lowp = tnew(DT_BF16, n);
    be->convert(be, lowp, p);
    struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.1f };
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 1e-2f, 3, 0.5f);
    sc.skip = 1;
    struct tensor *ts[4] = { p, m, v, lowp };
    void *before[4];
    for (int k = 0; k < 4; k++) {
        before[k] = malloc(tensor_bytes(ts[k]));
        memcpy(before[k], ts[k]->data, tensor_bytes(ts[k]));
    }
    struct optim_update_args a = { .master = p, .grad = g, .m = m, .v = v, .copy = lowp, .sc = &sc,
                                   .weight_decay = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f,
                                   .momentum = 0.9f };
    be->adamw_update(be, &a, 1);
    for (int k = 0; k < 4; k++)
        cr_assert_eq(memcmp(before[k], ts[k]->data, tensor_bytes(ts[k])), 0, "adamw wrote tensor %d on a skip", k);
    a.v = NULL;
    be->sgd_update(be, &a, 1);
    for (int k = 0; k < 4; k++)
        cr_assert_eq(memcmp(before[k], ts[k]->data, tensor_bytes(ts[k])), 0, "sgd wrote tensor %d on a skip", k);
    sc.skip = 0; /* and the same call without the flag does move them: the check above can fail */
    be->sgd_update(be, &a, 1);
    cr_assert_neq(memcmp(before[0], p->data, tensor_bytes(p)), 0);
    for (int k = 0; k < 4; k++)
        free(before[k]);
}

/* One call with several parameters (what optim_step makes) is the same as one call for each, bit for bit:
 * different sizes, decay on some, lowp copies on some, SGD with and without a momentum buffer. */
Test(cpu_optim, optimizer_updates_of_many_tensors_in_one_call_equal_one_at_a_time)
{
    seed(26);
    size_t sizes[4] = { 1, 7, 1000, 4097 };
    for (int kind = 0; kind < 2; kind++) {
        struct tensor *t[2][4][5], *init[4]; /* [pass][tensor][master, grad, m, v, lowp] */
        struct optim_update_args args[2][4];
        for (int i = 0; i < 4; i++) {
            float *h;
            struct tensor *p = init[i] = trand(DT_FP32, sizes[i], -1, 1, &h), *g = trand(DT_FP32, sizes[i], -1, 1, NULL);
            struct tensor *m = trand(DT_FP32, sizes[i], -1, 1, NULL), *v = trand(DT_FP32, sizes[i], 0, 1, NULL);
            for (int pass = 0; pass < 2; pass++) {
                t[pass][i][0] = tfrom(DT_FP32, sizes[i], p->data);
                t[pass][i][1] = g;
                t[pass][i][2] = tfrom(DT_FP32, sizes[i], m->data);
                t[pass][i][3] = tfrom(DT_FP32, sizes[i], v->data);
                t[pass][i][4] = i % 2 ? tnew(i == 1 ? DT_BF16 : DT_FP16, sizes[i]) : NULL;
            }
        }
        struct step_params sp = { .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f };
        struct step_scalars sc;
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; i < 4; i++)
                args[pass][i] = (struct optim_update_args){
                    .master = t[pass][i][0], .grad = t[pass][i][1], .m = kind == 1 && i == 2 ? NULL : t[pass][i][2],
                    .v = kind == 0 ? t[pass][i][3] : NULL, .copy = t[pass][i][4], .sc = &sc,
                    .weight_decay = i < 2 ? 0.1f : 0.0f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f,
                    .momentum = 0.9f, .nesterov = true,
                };
        for (int step = 1; step <= 2; step++) {
            step_rule_scalars(&sc, &sp, 1e-2f, step, 0.5f);
            if (kind == 0) {
                be->adamw_update(be, args[0], 4);
                for (int i = 0; i < 4; i++)
                    be->adamw_update(be, &args[1][i], 1);
            } else {
                be->sgd_update(be, args[0], 4);
                for (int i = 0; i < 4; i++)
                    be->sgd_update(be, &args[1][i], 1);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int k = 0; k < 5; k++)
                if (t[0][i][k] && k != 1)
                    cr_assert_eq(memcmp(t[0][i][k]->data, t[1][i][k]->data, tensor_bytes(t[0][i][k])), 0,
                                 "%s tensor %d part %d", kind ? "sgd" : "adamw", i, k);
        for (int i = 0; i < 4; i++) /* and the weights did move, so the comparison means something */
            cr_assert_neq(memcmp(t[0][i][0]->data, init[i]->data, tensor_bytes(init[i])), 0, "tensor %d moved", i);
    }
}

/* loss_sum: the mean of n fp32 rows in double, added to the accumulator or replacing it. */
/* ---- bf16 master weights and moments ------------------------------------------------------------ */

/* The same AdamW step with bf16 master, m and v (from bf16-representable values): to nearest, every stored
 * value is the fp32 update's value rounded once; stochastically, one of its two bf16 neighbours (the value
 * itself where representable); the fp32 copy is the stored master widened. */
static void adamw_bf16_case(bool stochastic)
{
    seed(41);
    size_t n = 3000;
    float *hp, *hg, *hm, *hv;
    struct tensor *p16 = trand(DT_BF16, n, -1, 1, &hp), *g = trand(DT_FP32, n, -10, 10, &hg);
    struct tensor *m16 = trand(DT_BF16, n, -0.1f, 0.1f, &hm), *v16 = trand(DT_BF16, n, 0, 0.5f, &hv);
    struct tensor *p32 = tfrom(DT_FP32, n, hp), *m32 = tfrom(DT_FP32, n, hm), *v32 = tfrom(DT_FP32, n, hv);
    struct tensor *wide = tnew(DT_FP32, n);
    struct step_params sp = {.beta1 = 0.9, .beta2 = 0.999, .weight_decay = 0.1f};
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 3e-2f, 4, 0.5f);
    struct optim_update_args ref = {.master = p32, .grad = g, .m = m32, .v = v32, .sc = &sc, .weight_decay = 0.1f,
                                    .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8f};
    struct optim_update_args a = ref;
    a.master = p16;
    a.m = m16;
    a.v = v16;
    a.copy = wide;
    a.stochastic = stochastic;
    a.sr_seed = sr_seed(7);
    a.sr_param = 3;
    be->adamw_update(be, &ref, 1);
    be->adamw_update(be, &a, 1);
    const struct tensor *t16[3] = {p16, m16, v16}, *t32[3] = {p32, m32, v32};
    size_t moved_up = 0, inexact = 0;
    for (int k = 0; k < 3; k++) {
        const uint16_t *h = t16[k]->data;
        const float *f = t32[k]->data;
        for (size_t i = 0; i < n; i++) {
            uint16_t near = bf16_from_fp32(f[i]);
            if (!stochastic) {
                cr_assert_eq(h[i], near, "tensor %d [%zu]: 0x%04x, want 0x%04x", k, i, h[i], near);
                continue;
            }
            uint32_t u;
            memcpy(&u, &f[i], sizeof u);
            uint16_t down = (uint16_t)(u >> 16);
            bool exact = (u & 0xFFFF) == 0;
            cr_assert(h[i] == down || (!exact && h[i] == down + 1), "tensor %d [%zu]: 0x%04x not a neighbour of %a", k,
                      i, h[i], (double)f[i]);
            /* and exactly the neighbour the element's draw picks (lib/base/sround.h), whatever clone stored it */
            const int shift[3] = {SR_WEIGHT, SR_M, SR_V};
            uint16_t want = bf16_round_stochastic(f[i], (uint32_t)(sr_bits(sr_key(a.sr_seed, sc.t, 3), i) >> shift[k]));
            cr_assert_eq(h[i], want, "tensor %d [%zu]: 0x%04x, the draw gives 0x%04x", k, i, h[i], want);
            inexact += !exact;
            moved_up += h[i] == (uint16_t)(down + 1);
        }
    }
    if (stochastic) /* both directions happen (about half of the inexact values go up) */
        cr_assert(moved_up > inexact / 4 && moved_up < inexact * 3 / 4, "%zu of %zu rounded up", moved_up, inexact);
    const uint16_t *h = p16->data;
    const float *w = wide->data;
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(w[i], bf16_to_fp32(h[i]), "the fp32 copy is the stored bf16 master");
}

Test(cpu_optim, adamw_bf16_master_and_moments_round_to_nearest) { adamw_bf16_case(false); }
Test(cpu_optim, adamw_bf16_master_and_moments_round_stochastically) { adamw_bf16_case(true); }

/* Updates below half a bf16 ulp: nearest rounding drops every one of them (the weights never move);
 * stochastic rounding moves the weights by the update on average. SGD, lr * g = 2^-12 against weights in
 * [1, 2), whose bf16 ulp is 2^-7: each weight moves one ulp down with probability 2^-5. */
Test(cpu_optim, sgd_bf16_master_small_updates_survive_only_stochastically)
{
    size_t n = 1 << 16;
    float *hp = malloc(n * sizeof *hp), *hg = malloc(n * sizeof *hg);
    for (size_t i = 0; i < n; i++) {
        hp[i] = 1.0f + (float)(i % 128) * 0x1p-7f; /* bf16 values in [1, 2) */
        hg[i] = 1.0f;
    }
    struct step_params sp = {0};
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, 0x1p-12f, 1, 1.0f);
    double moved[2] = {0, 0};
    for (int stochastic = 0; stochastic < 2; stochastic++) {
        float *h0 = malloc(n * sizeof *h0);
        memcpy(h0, hp, n * sizeof *h0);
        struct tensor *p = tfrom(DT_BF16, n, h0), *g = tfrom(DT_FP32, n, hg);
        struct optim_update_args a = {.master = p, .grad = g, .sc = &sc, .stochastic = stochastic,
                                      .sr_seed = sr_seed(1234), .sr_param = 0};
        be->sgd_update(be, &a, 1);
        float *after = malloc(n * sizeof *after);
        tensor_to_host_f32(p, after);
        for (size_t i = 0; i < n; i++)
            moved[stochastic] += (double)after[i] - (double)hp[i];
        free(after);
        free(h0);
    }
    double want = -(double)n * 0x1p-12; /* what fp32 weights would move in total */
    cr_assert_eq(moved[0], 0.0, "nearest rounding drops every update below half an ulp");
    /* ups ~ Binomial(n, 2^-5): sd = sqrt(n p (1-p)) ulps; allow 6 sd */
    double sd = sqrt((double)n * 0x1p-5 * (1 - 0x1p-5)) * 0x1p-7;
    cr_assert(fabs(moved[1] - want) < 6 * sd, "stochastic rounding moved %g in total, want %g +- %g", moved[1], want,
              6 * sd);
    free(hp);
    free(hg);
}

/* The trial of an update (optim_update_args.trial) stores nothing and reports, as 1 + its index in the call, the
 * first parameter with a new weight or moment that would be stored non-finite: a learning rate that overflows
 * the weight, a gradient whose square overflows v, a finite fp32 value that bf16 storage rounds to Inf (to
 * nearest and stochastically), SGD's momentum buffer. A clean trial reports 0. (Before, lr 1e38 wrote Inf
 * weights and an unloadable checkpoint.) */
struct trial_case {
    const char *what;
    float p, g, lr;
    enum dtype master, state;
    bool stochastic;
    int64_t want; /* *trial after the call over entries {clean, this} */
};

static void run_trial_case(const struct trial_case *c, bool adamw)
{
    size_t n = 300;
    struct tensor *t[2][4]; /* [entry][master, grad, m, v] */
    struct optim_update_args a[2];
    struct step_params sp = { .beta1 = 0.9, .beta2 = 0.999 };
    struct step_scalars sc;
    step_rule_scalars(&sc, &sp, c->lr, 2, 1.0f);
    sc.check = 1; /* what step_rule_propose asks where its bound proves nothing */
    for (int e = 0; e < 2; e++) {
        float *hp = malloc(n * sizeof *hp), *hg = malloc(n * sizeof *hg), *hz = calloc(n, sizeof *hz);
        for (size_t i = 0; i < n; i++) {
            hp[i] = e == 1 && i == 123 ? c->p : 0.5f;
            hg[i] = e == 1 && i == 123 ? c->g : 0.25f;
        }
        t[e][0] = tfrom(c->master, n, hp);
        t[e][1] = tfrom(DT_FP32, n, hg);
        t[e][2] = tfrom(c->state, n, hz);
        t[e][3] = tfrom(c->state, n, hz);
        a[e] = (struct optim_update_args){ .master = t[e][0], .grad = t[e][1], .m = t[e][2],
                                           .v = adamw ? t[e][3] : NULL, .sc = &sc, .beta1 = 0.9, .beta2 = 0.999,
                                           .eps = 1e-8f, .momentum = 0.9f, .stochastic = c->stochastic,
                                           .sr_seed = sr_seed(7), .sr_param = (uint32_t)e };
        free(hp);
        free(hg);
        free(hz);
    }
    void *before[2][4];
    for (int e = 0; e < 2; e++)
        for (int k = 0; k < 4; k++) {
            before[e][k] = malloc(tensor_bytes(t[e][k]));
            memcpy(before[e][k], t[e][k]->data, tensor_bytes(t[e][k]));
        }
    int64_t trial = 0;
    a[0].trial = a[1].trial = &trial;
    sc.check = 0; /* the step's bound proved it finite: the trial does nothing */
    if (adamw)
        be->adamw_update(be, a, 2);
    else
        be->sgd_update(be, a, 2);
    cr_assert_eq(trial, 0, "%s: a trial ran without sc->check", c->what);
    sc.check = 1;
    if (adamw)
        be->adamw_update(be, a, 2);
    else
        be->sgd_update(be, a, 2);
    cr_assert_eq(trial, c->want, "%s (%s): trial reported %lld, want %lld", c->what, adamw ? "adamw" : "sgd",
                 (long long)trial, (long long)c->want);
    for (int e = 0; e < 2; e++)
        for (int k = 0; k < 4; k++) {
            cr_assert_eq(memcmp(before[e][k], t[e][k]->data, tensor_bytes(t[e][k])), 0, "%s: the trial wrote", c->what);
            free(before[e][k]);
        }
    /* the update itself, where the trial was clean, leaves everything finite (and did move the weights), and
     * raises the state's bound to the largest |weight|, |m| and v it stored, over both entries */
    if (c->want == 0) {
        struct state_bound bound = {0};
        a[0].trial = a[1].trial = NULL;
        a[0].bound = a[1].bound = &bound;
        if (adamw)
            be->adamw_update(be, a, 2);
        else
            be->sgd_update(be, a, 2);
        float *w = malloc(n * sizeof *w), most[3] = {0, 0, 0};
        for (int e = 0; e < 2; e++)
            for (int k = 0; k < 3; k++) {
                if (k == 2 && !adamw)
                    continue;
                int slot = k == 0 ? 0 : k + 1; /* master, m, v */
                tensor_to_host_f32(t[e][slot], w);
                for (size_t i = 0; i < n; i++) {
                    cr_assert(isfinite(w[i]), "%s: tensor %d element %zu is %g after a clean trial", c->what, k, i,
                              w[i]);
                    most[k] = fabsf(w[i]) > most[k] ? fabsf(w[i]) : most[k];
                }
            }
        tensor_to_host_f32(t[0][0], w);
        cr_assert_neq(w[0], 0.5f, "%s: the update moved nothing", c->what);
        /* the bound holds the stored values' maxima (bf16 storage: within its rounding of them) */
        const float got[3] = {bound.pmax, bound.mmax, bound.vmax};
        for (int k = 0; k < (adamw ? 3 : 2); k++)
            cr_assert(got[k] >= most[k] * 0.996f && got[k] <= most[k] * 1.004f, "%s: bound %d is %g, stored max %g",
                      c->what, k, got[k], most[k]);
        free(w);
    }
}

Test(cpu_optim, an_update_trial_reports_the_first_parameter_that_would_go_non_finite)
{
    const struct trial_case adamw_cases[] = {
        { "clean", 1.0f, 1.0f, 1e-3f, DT_FP32, DT_FP32, false, 0 },
        { "lr overflows the weight", 3.4e38f, -1.0f, 1e37f, DT_FP32, DT_FP32, false, 2 },
        /* -lr / (1 - beta1^2) is -Inf in fp32: every weight, and the first entry is named */
        { "lr overflows every weight", 1.0f, 1.0f, 1e38f, DT_FP32, DT_FP32, false, 1 },
        { "g^2 overflows v", 1.0f, 1e21f, 1e-3f, DT_FP32, DT_FP32, false, 2 },
        /* 3.38e38 (bf16: 3.3757e38) + 3e36 x 0.744 (the step's normalised update) = 3.398e38 in bf16 storage, beyond
         * bf16's rounding boundary 3.3961e38; in fp32 storage 3.4023e38, still finite */
        { "fp32 master keeps a large weight", 3.38e38f, -1.0f, 3e36f, DT_FP32, DT_FP32, false, 0 },
        { "bf16 master rounds to Inf", 3.38e38f, -1.0f, 3e36f, DT_BF16, DT_FP32, false, 2 },
        { "bf16 master rounds to Inf, stochastically", 3.38e38f, -1.0f, 3e36f, DT_BF16, DT_FP32, true, 2 },
        { "g^2 overflows v in bf16 state", 1.0f, 3.4e38f, 1e-3f, DT_FP32, DT_BF16, false, 2 },
    };
    for (size_t i = 0; i < sizeof adamw_cases / sizeof adamw_cases[0]; i++)
        run_trial_case(&adamw_cases[i], true);
    const struct trial_case sgd_cases[] = {
        { "clean", 1.0f, 1.0f, 1e-3f, DT_FP32, DT_FP32, false, 0 },
        { "lr overflows the weight", 3.4e38f, -1.0f, 1e37f, DT_FP32, DT_FP32, false, 2 },
        /* 3.2998e38 + 1e37 = 3.3998e38: finite in fp32, beyond bf16's rounding boundary 3.3961e38 */
        { "bf16 master rounds to Inf", 3.3e38f, -1.0f, 1e37f, DT_BF16, DT_FP32, false, 2 },
        { "fp32 master keeps it", 3.3e38f, -1.0f, 1e37f, DT_FP32, DT_FP32, false, 0 },
        { "bf16 momentum rounds to Inf", 1.0f, 3.4e38f, 1e-3f, DT_FP32, DT_BF16, false, 2 },
    };
    for (size_t i = 0; i < sizeof sgd_cases / sizeof sgd_cases[0]; i++)
        run_trial_case(&sgd_cases[i], false);
}

/* The residual add fused into layernorm (norm_args.addend, dsum: a transformer block's r1 = x + proj, h2 =
 * ln2(r1), and backward's dy + ln2's dx) gives the bits of the two ops one after the other, in every dtype the
 * block meets: an fp32 residual stream with a 16-bit branch, and 16-bit all through. Rows of odd length and more
 * rows than one chunk. */
