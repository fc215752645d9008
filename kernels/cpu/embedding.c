/*
 * embedding.c — the CPU backend's token + position embedding: y = wte[token] + wpe[t] forward (overwritten), and
 * the backward scatter-add of dy into dwte and dwpe (accumulated with beta), in the order (b, t) one thread takes.
 */
#include "cpu_internal.h" /* struct cpu_backend, scratch, dtype helpers */

/* The forward pass is threaded by rows of y (rows_per_chunk positions a chunk). The backward pass
 * scatter-adds dy's rows into the tables by token and by position, so it is threaded by ranges of table
 * rows (EMB_TABLE_ELEMS elements a chunk, wte's ranges first, then wpe's): a chunk zeroes its rows, adds
 * into them every matching dy row in the order (b, t) of one thread, and finishes them. The tokens are
 * first bucketed by chunk, stably, so a chunk visits only its own. */
#define EMB_TABLE_ELEMS 4096

struct emb_job {
    struct cpu_backend *cb;
    struct tensor *y;                       /* forward: (B*T, C) */
    const struct tensor *wte, *wpe, *dy;    /* (vocab, C), (>= T, C); backward: dy (B*T, C) */
    const int32_t *tokens;                  /* (B*T) */
    int64_t B, T, C, vocab, rows_per;       /* rows_per: forward positions or backward table rows a chunk */
    int64_t pe_rows;                        /* backward: wpe's rows (max_len >= T) */
    float *acc_te, *acc_pe, *dte, *dpe;     /* backward: the sums (dte, dpe themselves when beta is 0) */
    float beta;
    int64_t te_chunks;                      /* wte's chunks; wpe's follow */
    const int32_t *order, *first;           /* the positions b*T+t of each wte chunk's tokens, in order */
};

static void emb_forward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct emb_job *j = arg;
    int64_t C = j->C, i0 = chunk * j->rows_per, n = j->B * j->T;
    int64_t i1 = i0 + j->rows_per < n ? i0 + j->rows_per : n;
    float *eb = wscratch(j->cb, worker, WSCR_TMP0), *pb = wscratch(j->cb, worker, WSCR_TMP1);
    float *yb = wscratch(j->cb, worker, WSCR_TMP2);
    for (int64_t i = i0; i < i1; i++) {
        int64_t t = i % j->T;
        int32_t tok = j->tokens[i];
        assert(tok >= 0 && tok < j->vocab);
        if (tok < 0 || tok >= j->vocab)
            tok = 0; /* release builds: never read outside wte (the data module validates tokens) */
        const float *e = load_f32(j->wte->data, j->wte->dtype, (size_t)(tok * C), (size_t)C, eb);
        const float *p = load_f32(j->wpe->data, j->wpe->dtype, (size_t)(t * C), (size_t)C, pb);
        size_t off = (size_t)(i * C);
        float *yr = out_f32(j->y->data, j->y->dtype, off, yb);
        for (int64_t k = 0; k < C; k++)
            yr[k] = e[k] + p[k];
        store_f32(j->y->data, j->y->dtype, off, (size_t)C, yr);
    }
}

void cpu_embedding_forward(struct backend *be, struct tensor *y, const int32_t *tokens,
                                  const struct tensor *wte, const struct tensor *wpe, int64_t B, int64_t T,
                                  int64_t C)
{
    struct cpu_backend *cb = cpu_of(be);
    assert((int64_t)y->numel == B * T * C && (int64_t)wpe->numel >= T * C);
    size_t row_bytes = (size_t)C * sizeof(float);
    if (!cpu_wscratch_reserve(cb, WSCR_TMP0, row_bytes) || !cpu_wscratch_reserve(cb, WSCR_TMP1, row_bytes) ||
        !cpu_wscratch_reserve(cb, WSCR_TMP2, row_bytes))
        return;
    struct emb_job j = { .cb = cb, .y = y, .wte = wte, .wpe = wpe, .tokens = tokens, .B = B, .T = T, .C = C,
                         .vocab = (int64_t)wte->numel / C, .rows_per = rows_per_chunk(C) };
    parallel_for(cb->pool, div_up(B * T, j.rows_per), emb_forward_chunk, &j);
}

/* Adds dy row i into table row r of acc (C values). */
static void emb_add_row(const struct emb_job *j, float *acc, int64_t r, int64_t i, float *dybuf)
{
    const float *g = load_f32(j->dy->data, j->dy->dtype, (size_t)(i * j->C), (size_t)j->C, dybuf);
    float *e = acc + r * j->C;
    for (int64_t k = 0; k < j->C; k++)
        e[k] += g[k];
}

static void emb_backward_chunk(void *arg, int64_t chunk, int worker)
{
    const struct emb_job *j = arg;
    float *dybuf = wscratch(j->cb, worker, WSCR_IN0);
    bool te = chunk < j->te_chunks;
    int64_t r0 = (te ? chunk : chunk - j->te_chunks) * j->rows_per, rows = te ? j->vocab : j->pe_rows;
    int64_t r1 = r0 + j->rows_per < rows ? r0 + j->rows_per : rows;
    float *acc = te ? j->acc_te : j->acc_pe, *d = te ? j->dte : j->dpe;
    size_t lo = (size_t)(r0 * j->C), hi = (size_t)(r1 * j->C);
    scale_f32(acc + lo, hi - lo, 0.0f);
    if (te) {
        for (int32_t q = j->first[chunk]; q < j->first[chunk + 1]; q++)
            emb_add_row(j, acc, j->tokens[j->order[q]], j->order[q], dybuf);
    } else {
        for (int64_t b = 0; b < j->B; b++)
            for (int64_t t = r0; t < r1 && t < j->T; t++)
                emb_add_row(j, acc, t, b * j->T + t, dybuf);
    }
    if (j->beta != 0.0f)
        for (size_t i = lo; i < hi; i++)
            d[i] = j->beta * d[i] + acc[i];
}

void cpu_embedding_backward(struct backend *be, struct tensor *dwte, struct tensor *dwpe,
                                   const struct tensor *dy, const int32_t *tokens, int64_t B, int64_t T, int64_t C,
                                   float beta)
{
    struct cpu_backend *cb = cpu_of(be);
    int64_t vocab = (int64_t)dwte->numel / C, n = B * T;
    assert(dwte->dtype == DT_FP32 && dwpe->dtype == DT_FP32 && (int64_t)dy->numel == B * T * C);
    assert((int64_t)dwpe->numel >= T * C && n < INT32_MAX);
    assert(dwte->numel % (size_t)C == 0 && dwpe->numel % (size_t)C == 0);
    int64_t per = EMB_TABLE_ELEMS / C > 0 ? EMB_TABLE_ELEMS / C : 1;
    int64_t pe_rows = (int64_t)dwpe->numel / C, te_chunks = div_up(vocab, per), pe_chunks = div_up(pe_rows, per);
    if (!wstage_reserve(cb, WSCR_IN0, dy, (size_t)C)) /* one row at a time */
        return;
    /* This pass's gradient is summed from zero, then added to beta * d: accumulating micro-batches is
     * "grad += new" (PyTorch's order), so one rank summing two micro-batches gives the bits of two ranks'
     * all-reduce. With beta != 0 the sums go to scratch first. */
    float *dte = (float *)dwte->data, *dpe = (float *)dwpe->data;
    float *acc_te = dte, *acc_pe = dpe;
    if (beta != 0.0f) {
        acc_te = scratch_get(cb, SCR_TMP0, dwte->numel * sizeof(float));
        acc_pe = scratch_get(cb, SCR_TMP1, dwpe->numel * sizeof(float));
        if (!acc_te || !acc_pe)
            return;
    }
    /* The bucket of each wte chunk: the positions of its tokens, in order (a stable counting sort). */
    int32_t *first = scratch_get(cb, SCR_ACC0, (size_t)(te_chunks + 1 + n) * sizeof(int32_t)), *order;
    if (!first)
        return;
    order = first + te_chunks + 1;
    memset(first, 0, (size_t)(te_chunks + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < n; i++) {
        assert(tokens[i] >= 0 && tokens[i] < vocab);
        if (tokens[i] >= 0 && tokens[i] < vocab) /* release builds skip a bad token */
            first[tokens[i] / per + 1]++;
    }
    for (int64_t c = 0; c < te_chunks; c++)
        first[c + 1] += first[c];
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] >= 0 && tokens[i] < vocab)
            order[first[tokens[i] / per]++] = (int32_t)i;
    for (int64_t c = te_chunks; c > 0; c--) /* back from each bucket's end to its start */
        first[c] = first[c - 1];
    first[0] = 0;
    struct emb_job j = { .cb = cb, .dy = dy, .tokens = tokens, .B = B, .T = T, .C = C, .vocab = vocab,
                         .rows_per = per, .pe_rows = pe_rows, .acc_te = acc_te, .acc_pe = acc_pe, .dte = dte, .dpe = dpe, .beta = beta,
                         .te_chunks = te_chunks, .order = order, .first = first };
    parallel_for((n + vocab + T) * C > (int64_t)EW_CHUNK ? cb->pool : NULL, te_chunks + pe_chunks, emb_backward_chunk,
                 &j);
}
