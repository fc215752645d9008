/*
 * gemm_bf16.c — bf16 x bf16 -> fp32 matrix product with AVX512-BF16 (vdpbf16ps), for backend_cpu.c.
 *
 * Compiled with per-function target attributes (as dtype_simd.c), so the rest of the build needs no
 * -m flags and the binary still runs on CPUs without these instructions; backend_cpu.c calls in only
 * when gemm_bf16_supported() says the CPU has AVX-512F/BW/VL and AVX512-BF16.
 *
 * vdpbf16ps multiplies pairs of bf16 and adds both products to an fp32 lane:
 *     c[j] += a[2j] * b[2j] + a[2j+1] * b[2j+1]
 * so both operands are packed "pair-interleaved": two consecutive k of one row of op(A) (or one
 * column of op(B)) form one 32-bit element. The layout (Goto/BLIS blocking):
 *   - k is split into blocks of at most KC_MAX (balanced, even lengths but the last); n into blocks
 *     of NC columns; m into blocks of MC rows.
 *   - For each (n block, k block) op(B) is packed into column panels of NR = 32: for pair q, the 32
 *     columns' pairs side by side (two zmm). For each m block op(A) is packed into row panels of
 *     MR = 12: for pair q, the 12 rows' pairs (broadcast one at a time). Panels are zero-padded to MR
 *     rows / NR columns and an odd k gets a zero partner, so the microkernel never sees an edge.
 *   - The microkernel keeps a 12 x 32 tile of C in 24 zmm accumulators: per pair q it loads two zmm
 *     of B and, for each of the 12 rows, broadcasts A's pair and issues two vdpbf16ps. A panel of B
 *     (KC_MAX * 32 * 2 bytes = 24 KiB) stays in L1 while the 12-row panels of A stream from L2.
 *   - The epilogue writes only the valid mr x nr part: with more than one k block the fp32 partial
 *     sums go to `partial` (or C itself when C is fp32, beta 0 and no bias) and are added back; after
 *     the last block it computes alpha * sum + beta * C_old (+ bias), in fp32, and stores fp32 or
 *     rounds once to bf16 (nearest-even, NaN quieted: bit for bit dtype.c's bf16_from_fp32).
 *
 * Numerics: fp32 accumulation of exact bf16 products (an 8-bit x 8-bit significand product is exact
 * in fp32), in an order that differs from OpenBLAS's, and with the instruction's fixed DAZ/FTZ:
 * bf16 subnormal inputs (|x| < 2^-126, about 1.2e-38) count as zero and subnormal fp32 results are
 * flushed to zero, whatever MXCSR says. Training values are nowhere near that range. The order is
 * fixed by the blocking, so results are bit-reproducible on a given machine.
 */
#include "gemm_bf16.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define AMP_GEMM_BF16_X86 1
#include <immintrin.h>
#endif

#define MR 12
#define NR 32
#define MC 192     /* multiple of MR: 16 panels, 192 * KC_MAX * 2 bytes = 144 KiB of L2 */
#define NC 2048    /* multiple of NR */
#define KC_MAX 384 /* even */

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

static int64_t round_up(int64_t x, int64_t to)
{
    return (x + to - 1) / to * to;
}

/* The k block length: at most KC_MAX, balanced over the blocks, even (pairs never straddle blocks). */
static int64_t block_k(int64_t k)
{
    int64_t nb = (k + KC_MAX - 1) / KC_MAX;
    return round_up((k + nb - 1) / nb, 2);
}

void gemm_bf16_scratch_sizes(int64_t m, int64_t n, int64_t k, struct gemm_bf16_scratch *s)
{
    int64_t kc = block_k(k);
    int64_t pairs = kc / 2;
    s->pack_a_bytes = (size_t)(round_up(min64(m, MC), MR) * pairs) * sizeof(uint32_t);
    s->pack_b_bytes = (size_t)(round_up(min64(n, NC), NR) * pairs) * sizeof(uint32_t);
    s->partial_bytes = kc < k ? (size_t)(m * n) * sizeof(float) : 0;
}

#ifdef AMP_GEMM_BF16_X86

#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool gemm_bf16_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/*
 * Pack `lines` lines (rows of op(A) or columns of op(B)) starting at line l0, k range [p0, p0+kc),
 * into panels of w lines: panel-major, then pair q, then line: dst[q * w + r] holds
 * (line r, k 2q) in its low half and (line r, k 2q+1) in its high half. Element (line l, k kk) is
 * src[l * ld + kk] when contig_k, else src[kk * ld + l]. Lines past `lines` and the partner of an odd
 * last k are zero.
 */
TARGET_BF16 static void pack_panels(uint32_t *dst, const uint16_t *src, int64_t ld, bool contig_k, int64_t l0,
                                    int64_t lines, int64_t p0, int64_t kc, int w)
{
    const int64_t pairs = (kc + 1) / 2, full = kc / 2;
    /* vpermt2w indices interleaving two 32 x 16-bit rows: out[2i] = lo[i], out[2i+1] = hi[i] */
    const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i idx_hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                            54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t lp = 0; lp < lines; lp += w, dst += pairs * w) {
        const int nl = (int)min64(w, lines - lp);
        if (contig_k) {
            for (int r = 0; r < nl; r++) {
                const uint16_t *row = src + (l0 + lp + r) * ld + p0;
                uint32_t *d = dst + r;
                for (int64_t q = 0; q < full; q++)
                    d[q * w] = (uint32_t)row[2 * q] | (uint32_t)row[2 * q + 1] << 16;
                if (kc & 1)
                    d[full * w] = row[kc - 1];
            }
            for (int r = nl; r < w; r++)
                for (int64_t q = 0; q < pairs; q++)
                    dst[q * w + r] = 0;
        } else {
            /* nl <= w <= 32: one masked load per k row, lanes past nl read as zero */
            const __mmask32 lm = nl >= 32 ? 0xFFFFFFFFu : ((__mmask32)1 << nl) - 1;
            const __mmask16 m0 = w >= 16 ? 0xFFFF : (__mmask16)((1u << w) - 1);
            const __mmask16 m1 = w > 16 ? (__mmask16)(w >= 32 ? 0xFFFFu : (1u << (w - 16)) - 1) : 0;
            for (int64_t q = 0; q < pairs; q++) {
                const uint16_t *r0 = src + (p0 + 2 * q) * ld + l0 + lp;
                __m512i lo = _mm512_maskz_loadu_epi16(lm, r0);
                __m512i hi = 2 * q + 1 < kc ? _mm512_maskz_loadu_epi16(lm, r0 + ld) : _mm512_setzero_si512();
                _mm512_mask_storeu_epi32(dst + q * w, m0, _mm512_permutex2var_epi16(lo, idx_lo, hi));
                if (m1)
                    _mm512_mask_storeu_epi32(dst + q * w + 16, m1, _mm512_permutex2var_epi16(lo, idx_hi, hi));
            }
        }
    }
}

#define ROW(i)                                                                                                   \
    do {                                                                                                         \
        __m512bh a_ = (__m512bh)_mm512_set1_epi32((int)pa[i]);                                                   \
        c##i##_0 = _mm512_dpbf16_ps(c##i##_0, a_, b0);                                                           \
        c##i##_1 = _mm512_dpbf16_ps(c##i##_1, a_, b1);                                                           \
    } while (0)
#define DECL(i) __m512 c##i##_0 = _mm512_setzero_ps(), c##i##_1 = _mm512_setzero_ps()
#define STORE(i)                                                                                                 \
    do {                                                                                                         \
        _mm512_store_ps(tile + (i) * NR, c##i##_0);                                                              \
        _mm512_store_ps(tile + (i) * NR + 16, c##i##_1);                                                         \
    } while (0)

/* tile (MR x NR fp32, 64-byte aligned) = the packed A panel times the packed B panel over `pairs` pairs. */
TARGET_BF16 static void kernel_12x32(int64_t pairs, const uint32_t *pa, const uint32_t *pb, float *tile)
{
    DECL(0); DECL(1); DECL(2); DECL(3); DECL(4); DECL(5);
    DECL(6); DECL(7); DECL(8); DECL(9); DECL(10); DECL(11);
    for (int64_t q = 0; q < pairs; q++, pa += MR, pb += NR) {
        __m512bh b0 = (__m512bh)_mm512_load_si512(pb);
        __m512bh b1 = (__m512bh)_mm512_load_si512(pb + 16);
        ROW(0); ROW(1); ROW(2); ROW(3); ROW(4); ROW(5);
        ROW(6); ROW(7); ROW(8); ROW(9); ROW(10); ROW(11);
    }
    STORE(0); STORE(1); STORE(2); STORE(3); STORE(4); STORE(5);
    STORE(6); STORE(7); STORE(8); STORE(9); STORE(10); STORE(11);
}

/* fp32 -> bf16 bits in the low half of each lane: RNE, NaN quieted (dtype.c's bf16_from_fp32). */
TARGET_BF16 static __m512i bf16_round(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                            _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

/* The valid mr x nr part of a tile at C's (i0, j0): add earlier k blocks' partial sums, then either
 * keep the sum for the next block or finish it (alpha, beta * C_old, bias, store / round once). */
TARGET_BF16 static void epilogue(const struct gemm_bf16_args *g, const float *tile, int64_t i0, int64_t j0, int mr,
                                 int nr, bool first, bool last, float *w, int64_t ldw)
{
    const __m512 alpha = _mm512_set1_ps(g->alpha), beta = _mm512_set1_ps(g->beta);
    const bool extra = g->beta != 0.0f || g->bias;
    for (int v = 0; v < 2; v++) {
        const int cols = nr - 16 * v;
        if (cols <= 0)
            break;
        const __mmask16 m = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
        const int64_t j = j0 + 16 * v;
        const __m512 bias = g->bias ? _mm512_maskz_loadu_ps(m, g->bias + j) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) {
            const int64_t i = i0 + r;
            __m512 s = _mm512_load_ps(tile + r * NR + 16 * v);
            if (!first)
                s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, w + i * ldw + j), s);
            if (!last) {
                _mm512_mask_storeu_ps(w + i * ldw + j, m, s);
                continue;
            }
            __m512 out;
            if (extra) {
                __m512 e = bias;
                if (g->beta != 0.0f) {
                    __m512 old;
                    if (g->c_bf16) {
                        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)g->c + i * g->ldc + j);
                        old = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                    } else {
                        old = _mm512_maskz_loadu_ps(m, (const float *)g->c + i * g->ldc + j);
                    }
                    e = _mm512_mul_ps(beta, old); /* bias needs beta 0, so e is one of the two */
                }
                out = _mm512_fmadd_ps(alpha, s, e);
            } else {
                out = _mm512_mul_ps(alpha, s);
            }
            if (g->c_bf16)
                _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)g->c + i * g->ldc + j, m, bf16_round(out));
            else
                _mm512_mask_storeu_ps((float *)g->c + i * g->ldc + j, m, out);
        }
    }
}

TARGET_BF16 void gemm_bf16(const struct gemm_bf16_args *g, void *pack_a, void *pack_b, float *partial)
{
    const int64_t m = g->m, n = g->n, k = g->k, kc = block_k(k);
    uint32_t *pa = pack_a, *pb = pack_b;
    float *w = partial;
    int64_t ldw = n;
    if (!w) { /* one k block, or C fp32 with beta 0 and no bias: partial sums in C itself */
        w = (float *)g->c;
        ldw = g->ldc;
    }
    float tile[MR * NR] __attribute__((aligned(64)));
    for (int64_t jc = 0; jc < n; jc += NC) {
        const int64_t nc = min64(NC, n - jc);
        for (int64_t p0 = 0; p0 < k; p0 += kc) {
            const int64_t kcur = min64(kc, k - p0), pairs = (kcur + 1) / 2;
            const bool first = p0 == 0, last = p0 + kcur >= k;
            pack_panels(pb, g->b, g->ldb, g->tb, jc, nc, p0, kcur, NR);
            for (int64_t ic = 0; ic < m; ic += MC) {
                const int64_t mc = min64(MC, m - ic);
                pack_panels(pa, g->a, g->lda, !g->ta, ic, mc, p0, kcur, MR);
                for (int64_t jr = 0; jr < nc; jr += NR) {
                    const uint32_t *bp = pb + (jr / NR) * pairs * NR;
                    const int nr = (int)min64(NR, nc - jr);
                    for (int64_t ir = 0; ir < mc; ir += MR) {
                        kernel_12x32(pairs, pa + (ir / MR) * pairs * MR, bp, tile);
                        epilogue(g, tile, ic + ir, jc + jr, (int)min64(MR, mc - ir), nr, first, last, w, ldw);
                    }
                }
            }
        }
    }
}

#else /* not x86-64: the portable path only */

bool gemm_bf16_supported(void)
{
    return false;
}

void gemm_bf16(const struct gemm_bf16_args *g, void *pack_a, void *pack_b, float *partial)
{
    (void)g, (void)pack_a, (void)pack_b, (void)partial;
}

#endif
