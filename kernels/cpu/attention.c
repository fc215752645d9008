/*
 * attention.c — the CPU backend's causal multi-head attention, forward (out and the probabilities, overwritten)
 * and backward (dqkv, overwritten), from the packed (B, T, 3C) qkv, threaded by (batch, head); and
 * attention_decode, sampling's attention of new rows over a key/value cache (the cache written, out overwritten),
 * in plain loops on the calling thread.
 *
 * Scores and their products go through gemm_core (or a worker's own product, cpu_worker_gemm); the softmax is in
 * fp32 with a double sum, max-subtracted, entries above the diagonal zero.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers, cpu_gemm_core, cpu_worker_gemm */

#include <cblas.h> /* cblas_sgemm: the portable path's per-pair products */

#include "gemm_avx512.h" /* gemm_avx512_scratch_sizes: a worker's panels */

/* Rows of the (T, T) scores become causal softmax probabilities in place: fp32, max-subtracted, the
 * sum in double; entries j > t become 0. */
static void softmax_causal(float *s, int64_t T)
{
    for (int64_t t = 0; t < T; t++) {
        float *row = s + t * T;
        float mx = row[0];
        for (int64_t j = 1; j <= t; j++)
            mx = row[j] > mx ? row[j] : mx;
        double sum = 0.0;
        for (int64_t j = 0; j <= t; j++) {
            row[j] = expf(row[j] - mx);
            sum += row[j];
        }
        float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j <= t; j++)
            row[j] *= inv;
        for (int64_t j = t + 1; j < T; j++)
            row[j] = 0.0f;
    }
}

/* Attention is threaded by (batch, head): each pair reads its own column blocks of qkv (and dout, probs)
 * and writes its own of out, probs (and dqkv). The pairs run on the pool when there are several and the
 * products are worth it (ATT_PAR_MACS multiply-adds in all); each then forms its products on its own
 * thread with its own scratch (att_gemm_worker), which gives the bits cpu_gemm_core gives: the same routine
 * (gemm_avx512, or sgemm for a 16-bit result), whose bits do not depend on the thread running it or on
 * banding (gemm_avx512.h). Otherwise the pairs run in order on the calling thread through cpu_gemm_core, as
 * they always did (a long sequence's products may then band across the pool themselves). */
#define ATT_PAR_MACS ((int64_t)1 << 20)

struct att_job {
    struct cpu_backend *cb;
    const struct tensor *qkv;               /* (B, T, 3C) */
    struct tensor *out, *probs_out;         /* forward: (B, T, C), (B, H, T, T) */
    struct tensor *dqkv;                    /* backward: (B, T, 3C) */
    const struct tensor *dout, *probs;      /* backward: (B, T, C), (B, H, T, T) */
    int64_t T, C, H, D;
    float scale;                            /* 1 / sqrt(D) */
    bool par;                               /* on the pool: att_gemm_worker; else cpu_gemm_core */
    bool bf16;                              /* the products read the bf16 tensors in place (att_bf16) */
};

/* The (rows, D) column block `col` of row-major t (row stride ld) from element off, as a product's input. */
static struct mat_in att_block(const struct tensor *t, size_t off, int64_t ld, int64_t col)
{
    return (struct mat_in){ .p = elem_ptr(t->data, t->dtype, off + (size_t)col), .dt = t->dtype, .ld = ld };
}

/* Rows [0, rows) of the column block [col, col + width) of the row-major (rows, ld) matrix at element
 * `off` of t, as fp32 at the same place of a same-shaped matrix: t's data itself when fp32, else buf
 * (rows * ld floats), into which only that block is converted. */
static const float *att_load_block(const struct tensor *t, size_t off, int64_t rows, int64_t ld, int64_t col,
                                   int64_t width, float *buf)
{
    if (t->dtype == DT_FP32)
        return (const float *)t->data + off;
    for (int64_t r = 0; r < rows; r++)
        dtype_convert(buf + r * ld + col, DT_FP32, elem_ptr(t->data, t->dtype, off + (size_t)(r * ld + col)),
                      t->dtype, (size_t)width);
    return buf;
}

/* cpu_gemm_core's path for A and B of one dtype (fp32, or bf16 on the bf16 path), beta 0 and no bias, on this
 * worker's scratch (reserved by att_reserve_gemm): gemm_avx512 where cpu_gemm_core takes it (C fp32 or of the
 * inputs' dtype), else (fp32 inputs) sgemm into C or, for a 16-bit C, into fp32 scratch rounded once. */
static void att_gemm_worker(struct cpu_backend *cb, int worker, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                            float alpha, struct mat_in a, struct mat_in b, struct mat_out c)
{
    if (a.dt == b.dt && cb->gemm_avx512[a.dt] && (c.dt == DT_FP32 || c.dt == a.dt)) {
        cpu_worker_gemm(cb, worker, a.dt, ta, tb, m, n, k, alpha, a.p, a.ld, b.p, b.ld, 0.0f, c);
        return;
    }
    assert(a.dt == DT_FP32 && b.dt == DT_FP32);
    float *cf = c.dt == DT_FP32 ? (float *)c.p : wscratch(cb, worker, WSCR_GEMM_C);
    int64_t ldc = c.dt == DT_FP32 ? c.ld : n;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blas_dim(m),
                blas_dim(n), blas_dim(k), alpha, a.p, blas_dim(a.ld), b.p, blas_dim(b.ld), 0.0f, cf, blas_dim(ldc));
    if (c.dt != DT_FP32)
        for (int64_t r = 0; r < m; r++)
            dtype_convert(elem_ptr(c.p, c.dt, (size_t)(r * c.ld)), c.dt, cf + r * n, DT_FP32, (size_t)n);
}

/* C = alpha op(A) op(B) for one (batch, head): A and B fp32, or bf16 on the bf16 path; beta 0. */
static void att_gemm(const struct att_job *j, int worker, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                     float alpha, struct mat_in a, struct mat_in b, struct mat_out c)
{
    if (j->par)
        att_gemm_worker(j->cb, worker, ta, tb, m, n, k, alpha, a, b, c);
    else
        cpu_gemm_core(j->cb, ta, tb, m, n, k, alpha, a, b, 0.0f, c, NULL);
}

/* The per-worker scratch of attention on the pool, products of inputs `in`: the packed panels (the larger of
 * the two shapes (T, T, D) and (T, D, T)) and a 16-bit result's fp32 copy or partial sums (T, D). */
static bool att_reserve_gemm(struct cpu_backend *cb, enum dtype in, int64_t T, int64_t D, enum dtype c_dt)
{
    struct gemm_avx512_scratch s1 = { 0 }, s2 = { 0 };
    if (cb->gemm_avx512[in]) {
        gemm_avx512_scratch_sizes(in, gemm_uses_amx(cb, in), T, T, D, &s1);
        gemm_avx512_scratch_sizes(in, gemm_uses_amx(cb, in), T, D, T, &s2);
    }
    size_t pa = s1.pack_a_bytes > s2.pack_a_bytes ? s1.pack_a_bytes : s2.pack_a_bytes;
    size_t pb = s1.pack_b_bytes > s2.pack_b_bytes ? s1.pack_b_bytes : s2.pack_b_bytes;
    size_t pc = (size_t)(T * D) * sizeof(float);
    pc = s2.partial_bytes > pc ? s2.partial_bytes : pc;
    return (!pa || cpu_wscratch_reserve(cb, WSCR_PACK_A, pa)) && (!pb || cpu_wscratch_reserve(cb, WSCR_GEMM_B, pb)) &&
           (c_dt == DT_FP32 || cpu_wscratch_reserve(cb, WSCR_GEMM_C, pc));
}

/* Whether a call's products take its bf16 tensors as they are (every tensor given bf16, gemm_avx512 taking
 * bf16): the bf16 path, whose sums are gemm_avx512's bf16 product (AMX where present); else fp32 inputs. */
static bool att_bf16(const struct cpu_backend *cb, const struct tensor *const *t, int n)
{
    bool all = cb->gemm_avx512[DT_BF16];
    for (int i = 0; i < n; i++)
        all = all && t[i]->dtype == DT_BF16;
    return all;
}

/* Whether B*H pairs of this size run on the pool. */
static bool att_par(const struct cpu_backend *cb, int64_t B, int64_t T, int64_t D, int64_t H)
{
    return cb->pool && B * H > 1 && B * H * T * T * D >= ATT_PAR_MACS;
}

/* Head h's Q, K and V blocks of the sequence at element seq of qkv (row stride 3C) as products' inputs: in
 * place on the bf16 path, else widened into qbuf (one sequence). */
static void att_qkv(const struct att_job *j, size_t seq, int64_t h, float *qbuf, struct mat_in *q, struct mat_in *k,
                    struct mat_in *v)
{
    const int64_t T = j->T, C = j->C, D = j->D;
    if (j->bf16) {
        *q = att_block(j->qkv, seq, 3 * C, h * D);
        *k = att_block(j->qkv, seq, 3 * C, C + h * D);
        *v = att_block(j->qkv, seq, 3 * C, 2 * C + h * D);
        return;
    }
    att_load_block(j->qkv, seq, T, 3 * C, h * D, D, qbuf);
    att_load_block(j->qkv, seq, T, 3 * C, C + h * D, D, qbuf);
    const float *qb = att_load_block(j->qkv, seq, T, 3 * C, 2 * C + h * D, D, qbuf) + h * D;
    *q = mat_f32(qb, 3 * C);
    *k = mat_f32(qb + C, 3 * C);
    *v = mat_f32(qb + 2 * C, 3 * C);
}

/* Per (batch b, head h), with Q, K, V the (T, D) column blocks h*D, C + h*D, 2C + h*D of qkv[b]
 * (row stride 3C) and d = qkv's dtype:
 *   S = round_d(Q K^T / sqrt(D))           GEMM, fp32 accumulation
 *   P = round_probs(causal_softmax(S))      fp32, stored in `probs`
 *   out[b, :, hD:(h+1)D] = round_out(P V)   GEMM */
static void att_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct att_job *j = arg;
    int64_t T = j->T, C = j->C, D = j->D, b = chunk / j->H, h = chunk % j->H;
    const struct tensor *qkv = j->qkv;
    float *qbuf = wscratch(j->cb, worker, WSCR_IN0), *s = wscratch(j->cb, worker, WSCR_TMP0);
    size_t seq = (size_t)(b * T * 3 * C);
    struct mat_in q, k, v;
    att_qkv(j, seq, h, qbuf, &q, &k, &v);
    att_gemm(j, worker, false, true, T, T, D, j->scale, q, k, out_mat_f32(s, T));
    round_f32_to(s, (size_t)(T * T), qkv->dtype);
    softmax_causal(s, T);
    round_f32_to(s, (size_t)(T * T), j->probs_out->dtype);
    void *probs = elem_ptr(j->probs_out->data, j->probs_out->dtype, (size_t)(chunk * T * T));
    dtype_convert(probs, j->probs_out->dtype, s, DT_FP32, (size_t)(T * T));
    struct mat_out o = { .p = elem_ptr(j->out->data, j->out->dtype, (size_t)(b * T * C + h * D)), .dt = j->out->dtype,
                         .ld = C };
    /* P: the stored probabilities themselves on the bf16 path (s holds their values) */
    struct mat_in p = j->bf16 ? (struct mat_in){ .p = probs, .dt = DT_BF16, .ld = T } : mat_f32(s, T);
    att_gemm(j, worker, false, false, T, D, T, 1.0f, p, v, o);
}

void cpu_attention_forward(struct backend *be, struct tensor *out, struct tensor *probs,
                                  const struct tensor *qkv, int64_t B, int64_t T, int64_t C, int64_t H)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(H >= 1 && C % H == 0);
    assert((int64_t)qkv->numel == B * T * 3 * C && (int64_t)out->numel == B * T * C);
    assert((int64_t)probs->numel == B * H * T * T);
    int64_t D = C / H;
    const struct tensor *io[] = { qkv, probs, out };
    struct att_job j = { .cb = cb, .qkv = qkv, .out = out, .probs_out = probs, .T = T, .C = C, .H = H, .D = D,
                         .scale = 1.0f / sqrtf((float)D), .par = att_par(cb, B, T, D, H), .bf16 = att_bf16(cb, io, 3) };
    /* one sequence's qkv (only the pair's blocks are filled; none on the bf16 path), one (T, T) score matrix */
    if (!wstage_reserve(cb, WSCR_IN0, j.bf16 ? NULL : qkv, (size_t)(T * 3 * C)) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP0, (size_t)(T * T) * sizeof(float)) ||
        (j.par && !att_reserve_gemm(cb, j.bf16 ? DT_BF16 : DT_FP32, T, D, out->dtype)))
        return;
    parallel_for(j.par ? cb->pool : NULL, B * H, att_forward_chunk, &j);
}

/* The chain rule through cpu_attention_forward, per (b, h), with d = qkv's dtype. The 16-bit roundings
 * are the ones a GPU implementation stores (llm.c's datt and dpreatt buffers):
 *   dP = round_d(dO V^T)                               GEMM
 *   dS = round_d(P * (dP - rowsum(P * dP)))             fp32 softmax backward (0 where masked)
 *   dV = P^T dO,  dQ = dS K / sqrt(D),  dK = dS^T Q / sqrt(D)   GEMMs rounded to dqkv's dtype */
HOT_LOOP static void att_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct att_job *j = arg;
    int64_t T = j->T, C = j->C, D = j->D, b = chunk / j->H, h = chunk % j->H;
    const struct tensor *qkv = j->qkv;
    enum dtype d = qkv->dtype;
    struct cpu_backend *cb = j->cb;
    float *qbuf = wscratch(cb, worker, WSCR_IN0), *dobuf = wscratch(cb, worker, WSCR_IN1);
    float *pbuf = wscratch(cb, worker, WSCR_IN2), *ds = wscratch(cb, worker, WSCR_TMP0);
    size_t seq = (size_t)(b * T * 3 * C);
    struct mat_in q, k, v, dob, p;
    const float *pb = load_f32(j->probs->data, j->probs->dtype, (size_t)(chunk * T * T), (size_t)(T * T), pbuf);
    att_qkv(j, seq, h, qbuf, &q, &k, &v);
    if (j->bf16) {
        dob = att_block(j->dout, (size_t)(b * T * C), C, h * D);
        p = att_block(j->probs, (size_t)(chunk * T * T), T, 0);
    } else {
        dob = mat_f32(att_load_block(j->dout, (size_t)(b * T * C), T, C, h * D, D, dobuf) + h * D, C);
        p = mat_f32(pb, T);
    }
    att_gemm(j, worker, false, true, T, T, D, 1.0f, dob, v, out_mat_f32(ds, T));
    round_f32_to(ds, (size_t)(T * T), d);
    for (int64_t t = 0; t < T; t++) {
        const float *pr = pb + t * T;
        float *row = ds + t * T;
        double dot = 0.0;
        for (int64_t k = 0; k <= t; k++)
            dot += (double)pr[k] * row[k];
        float dot_f = (float)dot;
        for (int64_t k = 0; k <= t; k++)
            row[k] = pr[k] * (row[k] - dot_f);
        for (int64_t k = t + 1; k < T; k++)
            row[k] = 0.0f;
    }
    round_f32_to(ds, (size_t)(T * T), d);
    struct mat_in dsm = mat_f32(ds, T);
    if (j->bf16) { /* dS's bf16 bits (its values are bf16 already) in the qkv staging slot, unused here */
        dtype_convert(qbuf, DT_BF16, ds, DT_FP32, (size_t)(T * T));
        dsm = (struct mat_in){ .p = qbuf, .dt = DT_BF16, .ld = T };
    }
    struct tensor *dqkv = j->dqkv;
    size_t base = seq + (size_t)(h * D);
    struct mat_out dq = { .p = elem_ptr(dqkv->data, dqkv->dtype, base), .dt = dqkv->dtype, .ld = 3 * C };
    struct mat_out dk = { .p = elem_ptr(dqkv->data, dqkv->dtype, base + (size_t)C), .dt = dqkv->dtype, .ld = 3 * C };
    struct mat_out dv = { .p = elem_ptr(dqkv->data, dqkv->dtype, base + 2 * (size_t)C), .dt = dqkv->dtype,
                          .ld = 3 * C };
    att_gemm(j, worker, true, false, T, D, T, 1.0f, p, dob, dv);
    att_gemm(j, worker, false, false, T, D, T, j->scale, dsm, k, dq);
    att_gemm(j, worker, true, false, T, D, T, j->scale, dsm, q, dk);
}

void cpu_attention_backward(struct backend *be, struct tensor *dqkv, const struct tensor *dout,
                                   const struct tensor *qkv, const struct tensor *probs, int64_t B, int64_t T,
                                   int64_t C, int64_t H)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(H >= 1 && C % H == 0);
    assert((int64_t)qkv->numel == B * T * 3 * C && (int64_t)dqkv->numel == B * T * 3 * C);
    assert((int64_t)dout->numel == B * T * C && (int64_t)probs->numel == B * H * T * T);
    int64_t D = C / H;
    const struct tensor *io[] = { qkv, dout, probs, dqkv };
    struct att_job j = { .cb = cb, .qkv = qkv, .dqkv = dqkv, .dout = dout, .probs = probs, .T = T, .C = C, .H = H,
                         .D = D, .scale = 1.0f / sqrtf((float)D), .par = att_par(cb, B, T, D, H),
                         .bf16 = att_bf16(cb, io, 4) };
    /* staged per sequence (qkv, dout: the pair's blocks) and per pair (probs); on the bf16 path nothing of qkv
     * and dout, and IN0 holds dS's bf16 bits */
    if (!(j.bf16 ? cpu_wscratch_reserve(cb, WSCR_IN0, (size_t)(T * T) * sizeof(uint16_t))
                 : wstage_reserve(cb, WSCR_IN0, qkv, (size_t)(T * 3 * C))) ||
        !wstage_reserve(cb, WSCR_IN1, j.bf16 ? NULL : dout, (size_t)(T * C)) ||
        !wstage_reserve(cb, WSCR_IN2, probs, (size_t)(T * T)) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP0, (size_t)(T * T) * sizeof(float)) ||
        (j.par && !att_reserve_gemm(cb, j.bf16 ? DT_BF16 : DT_FP32, T, D, dqkv->dtype)))
        return;
    parallel_for(j.par ? cb->pool : NULL, B * H, att_backward_chunk, &j);
}

/* ---- attention over a key/value cache (sampling) ---------------------------------------------------
 * The reference of backend.h's attention_decode, as plain loops: the new rows' K and V go into the cache,
 * then each (row, head) makes three passes over the cached positions 0..pos+i (the scores' max, the sum of
 * their exponentials, the weighted values), recomputing a score q.k in each rather than keeping a row of
 * them: the CUDA kernel does the same, one thread block per (row, head). Decoding runs one position at a
 * time, so this is at most a few thousand dot products per layer. */

static float elem_f32(const void *base, enum dtype dt, size_t i)
{
    float v;
    dtype_convert(&v, DT_FP32, elem_ptr(base, dt, i), dt, 1);
    return v;
}

/* score j of query q (D fp32) against cached key j of head h: the dot product in fp32, times scale, rounded to
 * d as attention_forward stores its scores */
static float decode_score(const float *q, const struct tensor *cache, int64_t h, int64_t j, int64_t max_T, int64_t D,
                          float scale, enum dtype d)
{
    size_t k0 = (size_t)((h * max_T + j) * D);
    float dot = 0.0f;
    for (int64_t e = 0; e < D; e++)
        dot = fmaf(q[e], elem_f32(cache->data, cache->dtype, k0 + (size_t)e), dot);
    return dtype_round(scale * dot, d);
}

void cpu_attention_decode(struct backend *be, struct tensor *out, struct tensor *cache, const struct tensor *qkv,
                          int64_t pos, int64_t n, int64_t C, int64_t H)
{
    struct cpu_backend *cb = cpu_of(be);
    assert(H >= 1 && C % H == 0 && pos >= 0 && n >= 1);
    int64_t D = C / H, max_T = cache->shape[2];
    assert(cache->ndim == 4 && cache->shape[0] == 2 && cache->shape[1] == H && cache->shape[3] == D);
    assert(pos + n <= max_T && (int64_t)qkv->numel == n * 3 * C && (int64_t)out->numel == n * C);
    enum dtype d = qkv->dtype;
    size_t values = (size_t)(H * max_T * D); /* cache[1] starts here */
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t e = 0; e < D; e++) {
                size_t at = (size_t)((h * max_T + pos + i) * D + e);
                float k = elem_f32(qkv->data, d, (size_t)(i * 3 * C + C + h * D + e));
                float v = elem_f32(qkv->data, d, (size_t)(i * 3 * C + 2 * C + h * D + e));
                dtype_convert(elem_ptr(cache->data, cache->dtype, at), cache->dtype, &k, DT_FP32, 1);
                dtype_convert(elem_ptr(cache->data, cache->dtype, values + at), cache->dtype, &v, DT_FP32, 1);
            }
    float *q = scratch_get(cb, SCR_TMP0, (size_t)D * 2 * sizeof(float)); /* query, then the weighted sum */
    if (!q)
        return;
    float *acc = q + D;
    float scale = 1.0f / sqrtf((float)D);
    const void *vals = elem_ptr(cache->data, cache->dtype, values);
    for (int64_t i = 0; i < n; i++) {
        int64_t last = pos + i;
        for (int64_t h = 0; h < H; h++) {
            for (int64_t e = 0; e < D; e++)
                q[e] = elem_f32(qkv->data, d, (size_t)(i * 3 * C + h * D + e));
            float mx = -INFINITY;
            for (int64_t j = 0; j <= last; j++) {
                float s = decode_score(q, cache, h, j, max_T, D, scale, d);
                mx = s > mx ? s : mx;
            }
            double sum = 0.0;
            for (int64_t j = 0; j <= last; j++)
                sum += expf(decode_score(q, cache, h, j, max_T, D, scale, d) - mx);
            float inv = (float)(1.0 / sum);
            for (int64_t e = 0; e < D; e++)
                acc[e] = 0.0f;
            for (int64_t j = 0; j <= last; j++) {
                float p = dtype_round(expf(decode_score(q, cache, h, j, max_T, D, scale, d) - mx) * inv, d);
                for (int64_t e = 0; e < D; e++)
                    acc[e] = fmaf(p, elem_f32(vals, cache->dtype, (size_t)((h * max_T + j) * D + e)), acc[e]);
            }
            dtype_convert(elem_ptr(out->data, out->dtype, (size_t)(i * C + h * D)), out->dtype, acc, DT_FP32,
                          (size_t)D);
        }
    }
}
