/*
 * test_cpu_embedding.c — the token + position embedding (kernels/cpu/embedding.c), forward and the backward scatter-add
 * of repeated tokens.
 *
 * Each op runs on fresh random inputs from a seeded generator; outputs are poisoned with NaN before each call
 * so an element the backend forgets to write fails (cpu_testlib.h).
 */

#include "cpu_testlib.h" /* be, tnew, tfrom, trand, check_*, fd_grad */

TestSuite(cpu_embedding, .init = cpu_test_setup, .fini = cpu_test_teardown);

/* ---- embedding --------------------------------------------------------------------------------- */

Test(cpu_embedding, embedding_forward_and_repeated_token_backward)
{
    seed(16);
    int64_t B = 2, T = 3, C = 5, V = 4;
    int32_t htok[6] = { 1, 3, 1, 1, 0, 3 };
    int32_t *tok = be->alloc(be, sizeof htok);
    be->upload(be, tok, htok, sizeof htok);
    float *hwte, *hwpe, *hdy, *hdte0;
    struct tensor *wte = trand(DT_FP32, (size_t)(V * C), -1, 1, &hwte), *wpe = trand(DT_FP32, (size_t)(T * C), -1, 1, &hwpe);
    enum dtype outs[2] = { DT_FP32, DT_FP16 };
    for (int o = 0; o < 2; o++) {
        struct tensor *y = tnew(outs[o], (size_t)(B * T * C));
        be->embedding_forward(be, y, tok, wte, wpe, B, T, C);
        double want[30];
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j < C; j++)
                    want[(b * T + t) * C + j] = (double)(hwte[htok[b * T + t] * C + j] + hwpe[t * C + j]);
        check_out(y, want, 30, 0, 0, "embedding_forward");
    }
    struct tensor *dy = trand(DT_BF16, (size_t)(B * T * C), -1, 1, &hdy);
    struct tensor *dte = tnew(DT_FP32, (size_t)(V * C)), *dpe = tnew(DT_FP32, (size_t)(T * C));
    be->embedding_backward(be, dte, dpe, dy, tok, B, T, C, 0.0f);
    double gte[20] = { 0 }, gpe[15] = { 0 };
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < C; j++) {
                gte[htok[b * T + t] * C + j] += hdy[(b * T + t) * C + j];
                gpe[t * C + j] += hdy[(b * T + t) * C + j];
            }
    check_f32(dte, gte, 20, 1e-6, 1e-6, "dwte: token 1 three times, token 2 never (zeros)");
    check_f32(dpe, gpe, 15, 1e-6, 1e-6, "dwpe");
    for (int j = 0; j < 5; j++)
        cr_assert_eq(((float *)dte->data)[2 * C + j], 0.0f, "an unused token's row is overwritten with 0");
    /* beta 1 accumulates */
    struct tensor *dte1 = trand(DT_FP32, (size_t)(V * C), -1, 1, &hdte0);
    be->embedding_backward(be, dte1, dpe, dy, tok, B, T, C, 1.0f);
    for (int i = 0; i < 20; i++)
        gte[i] += hdte0[i];
    for (int i = 0; i < 15; i++)
        gpe[i] *= 2;
    check_f32(dte1, gte, 20, 1e-6, 1e-6, "dwte beta 1");
    check_f32(dpe, gpe, 15, 1e-6, 1e-6, "dwpe beta 1");
    be->free(be, tok);
}
