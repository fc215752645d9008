/*
 * gemm_avx512.c — the CPU backend's AVX-512 matrix products: fp32 and fp16 inputs with FMA, bf16
 * inputs with AVX512-BF16 (vdpbf16ps), fp32 accumulation in all three, for gemm.c.
 *
 * Compiled with per-function target attributes (as dtype_simd.c), so the rest of the build needs no
 * -m flags and the binary still runs on CPUs without these instructions; gemm.c calls in only
 * when gemm_avx512_supported() says the CPU has them. Why not OpenBLAS for fp32: Debian's OpenBLAS
 * picks its kernel by CPU model, and on CPUs it does not know (or where OPENBLAS_CORETYPE names an
 * older core) it runs AVX2 code at half the AVX-512 width; this file runs the same blocking at
 * full width everywhere AVX-512 exists. Debian's OpenBLAS has no bf16 GEMM at all.
 *
 * One blocked driver (Goto/BLIS) serves the three input dtypes; they differ only in how panels are
 * packed and in the microkernel's multiply instruction. Packed panels hold 32-bit elements, a
 * "step" each:
 *   fp32, fp16  one k per step: the fp32 value (fp16 widened exactly while packing).
 *   bf16        two k per step, "pair-interleaved": vdpbf16ps multiplies pairs of bf16 and adds both
 *               products to an fp32 lane, c[j] += a[2j] * b[2j] + a[2j+1] * b[2j+1], so two
 *               consecutive k of one row of op(A) (or one column of op(B)) form one element.
 * The layout:
 *   - k is split into blocks of at most KC_BF16 / KC_F32 (balanced; even for bf16, so pairs never
 *     straddle blocks), n into blocks of NC columns, m into blocks of MC rows.
 *   - For each (n block, k block) op(B) is packed into column panels of NR = 32: for step q, the 32
 *     columns' elements side by side (two zmm). For each m block op(A) is packed into row panels of
 *     MR = 12: for step q, the 12 rows' elements (broadcast one at a time). Panels are zero-padded to
 *     MR rows / NR columns (and an odd bf16 k gets a zero partner), so the microkernel never sees an
 *     edge. Lines contiguous in k (rows of A, columns of B^T) are transposed 16 x 16 steps in
 *     registers (for bf16 a step is a pair of adjacent k, already the packed element).
 *   - The microkernel keeps a 12 x 32 tile of C in 24 zmm accumulators: per step it loads two zmm of
 *     B and, for each of the 12 rows, broadcasts A's element and issues two FMAs (vfmadd231ps or
 *     vdpbf16ps). A panel of B (at most 32 KiB) stays in L1 while the 12-row panels of A stream
 *     from L2.
 *   - The epilogue writes only the valid mr x nr part: with more than one k block the fp32 partial
 *     sums go to `partial` (or C itself when C is fp32, beta 0 and no bias) and are added back; after
 *     the last block it computes alpha * sum + beta * C_old (+ bias), in fp32, and stores fp32 or
 *     rounds once to C's 16-bit dtype (nearest-even, NaN quieted: bit for bit dtype.c's conversions).
 *
 * AMX (bf16 where the CPU has AMX-BF16 and gemm_avx512_args.amx): the same driver and epilogue with tdpbf16ps
 * tiles in place of the 12 x 32 microkernel: k blocks a multiple of 32, op(A) in 32-row panels whose rows hold
 * their pairs contiguously (pack_a_amx; or A itself where its rows already are, in whole tiles: a_direct), op(B)
 * in the 32-column panels above, both padded with zero pairs to whole tiles of 16; a 32 x 32 block of C in four
 * tiles (kernel_amx), which the first of several k blocks stores straight into the partial sums. Its sums are
 * not vdpbf16ps's (tdpbf16ps adds a pair's two products first and groups the 16 pairs of a tile row;
 * scripts/dev/probe_amx_order.c).
 *
 * Threads (gemm_avx512_threaded): for each (n block, k block) the panels of op(B) are packed once into
 * one shared buffer (the panels shared out, each packed by one thread), then the rows of C are shared
 * out in bands of whole MR-row panels, each thread packing its own rows of op(A) into its own buffer.
 * The bands depend on m alone. No element's sum changes: the k blocks depend on k alone, each element
 * is summed over them and within one over its steps in one order, whatever band, panel or tile it falls
 * in (the microkernel's lanes are independent), so the bits are the single-threaded driver's.
 *
 * Numerics: fp32 accumulation in an order fixed by the blocking (so results are bit-reproducible on
 * a given machine, whatever OPENBLAS_NUM_THREADS says), which differs from OpenBLAS's order. fp32 and
 * fp16 follow IEEE fp32 (MXCSR's default: subnormals kept). vdpbf16ps has a fixed DAZ/FTZ: bf16
 * subnormal inputs (|x| < 2^-126, about 1.2e-38) count as zero and subnormal fp32 results are
 * flushed to zero, whatever MXCSR says. Training values are nowhere near that range.
 */
#define _GNU_SOURCE /* syscall: arch_prctl for AMX */
#include "gemm_avx512.h"

#include <string.h>

#include "threadpool.h" /* parallel_for: gemm_avx512_threaded */

#include <stdatomic.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define AMP_GEMM_AVX512_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_lanes.h" /* bf16 lanes widened and rounded, shared with pool.c and norm.c */
#endif

#define MR 12
#define MR_AMX 32   /* AMX: two 16-row tiles of A */
#define NR 32
#define MC 192      /* multiple of MR: 16 panels, at most 192 * 256 * 4 bytes = 192 KiB of L2 */
#define NC 2048     /* multiple of NR */
#define KC_BF16 384 /* even: a B panel is 384 / 2 * 32 * 4 bytes = 24 KiB */
#define KC_F32 256  /* a B panel is 256 * 32 * 4 bytes = 32 KiB */

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

static int64_t round_up(int64_t x, int64_t to)
{
    return (x + to - 1) / to * to;
}

/* Whether a product of inputs `in` runs on the AMX tiles: bf16 asked to (gemm_avx512_args.amx); the one
 * place the two are combined. */
static bool on_tiles(enum dtype in, bool amx)
{
    return in == DT_BF16 && amx;
}

/* The k block length: at most KC_*, balanced over the blocks, even for bf16; for AMX a multiple of 32 (whole
 * tiles of 16 pairs: only the last block is padded). */
static int64_t block_k(enum dtype in, bool amx, int64_t k)
{
    int64_t kmax = in == DT_BF16 ? KC_BF16 : KC_F32;
    int64_t nb = (k + kmax - 1) / kmax;
    int64_t kc = (k + nb - 1) / nb;
    if (in != DT_BF16)
        return kc;
    return round_up(kc, on_tiles(in, amx) ? 32 : 2);
}

/* Packed 32-bit elements per line for kc values of k (AMX: padded with zero pairs to whole tiles of 16). */
static int64_t steps_of(enum dtype in, bool amx, int64_t kc)
{
    if (in != DT_BF16)
        return kc;
    return on_tiles(in, amx) ? round_up((kc + 1) / 2, 16) : (kc + 1) / 2;
}

/* Rows of op(A) per panel: one microkernel call's rows. */
static int64_t mr_of(enum dtype in, bool amx)
{
    return on_tiles(in, amx) ? MR_AMX : MR;
}

/* Whether AMX loads op(A)'s tiles of a k block of kcur straight from A, unpacked: A's rows are contiguous in k
 * (not ta), so a tile row (16 pairs of one row) is already 64 contiguous bytes, the block is whole tiles (no
 * padding to add) and every panel has its 32 rows (m a multiple of MR_AMX: no row past m is read). The tiles hold
 * the bytes pack_a_amx would have copied, so nothing else changes. */
static bool a_direct(enum dtype in, bool amx, bool ta, int64_t m, int64_t kcur)
{
    return on_tiles(in, amx) && !ta && m % MR_AMX == 0 && kcur % 32 == 0;
}

void gemm_avx512_scratch_sizes(enum dtype in, bool amx, int64_t m, int64_t n, int64_t k,
                               struct gemm_avx512_scratch *s)
{
    int64_t kc = block_k(in, amx, k);
    int64_t steps = steps_of(in, amx, kc);
    s->pack_a_bytes = (size_t)(round_up(min64(m, MC), mr_of(in, amx)) * steps) * sizeof(uint32_t);
    s->pack_b_bytes = (size_t)(round_up(min64(n, NC), NR) * steps) * sizeof(uint32_t);
    s->partial_bytes = kc < k ? (size_t)(m * n) * sizeof(float) : 0;
}

#ifdef AMP_GEMM_AVX512_X86

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

bool gemm_avx512_supported(enum dtype in)
{
    __builtin_cpu_init();
    bool base = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
    if (in != DT_FP32 && in != DT_FP16 && in != DT_BF16) /* fp8: the CPU backend widens it to bf16 first */
        return false;
    return base && (in != DT_BF16 || __builtin_cpu_supports("avx512bf16"));
}

bool gemm_avx512_transposed_fits(enum dtype in, int64_t m, int64_t n)
{
    if (in != DT_FP32 && in != DT_FP16)
        return false;
    return 2 * round_up(n, MR) * round_up(m, NR) <= round_up(m, MR) * round_up(n, NR);
}

/* AMX: CPUID.(7,0):EDX bit 22 (AMX-BF16) and bit 24 (AMX-TILE), and Linux's leave to use the tile data
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, Linux 5.16 and later: without it the first tile
 * instruction faults). Asked once per process; the permission covers every thread. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static bool amx_usable;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
        return;
#ifdef SYS_arch_prctl /* Linux; elsewhere no AMX */
    amx_usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
}

bool gemm_avx512_amx_supported(void)
{
    pthread_once(&amx_once, amx_probe);
    return amx_usable && gemm_avx512_supported(DT_BF16);
}

/* Lanes [0, n) of a 16-lane mask (n clamped to [0, 16]). */
static __mmask16 lanes16(int64_t n)
{
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* ---- packing ------------------------------------------------------------------------------------- */

/* 16 consecutive elements of an fp32 or fp16 array from element `off`, as fp32; lanes outside `m`
 * read nothing and are zero. */
TARGET_AVX512 static __m512 load16(const void *src, enum dtype dt, int64_t off, __mmask16 m)
{
    if (dt == DT_FP16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)src + off));
    return _mm512_maskz_loadu_ps(m, (const float *)src + off);
}

/* 16 consecutive packed steps of a line from element `off` of src: fp32 and fp16 values as fp32, bf16
 * as pairs (two bf16 in one 32-bit lane, the first in the low half: a plain 32-bit load). Lanes outside
 * `m` read nothing and are zero. */
TARGET_AVX512 static __m512 load16_steps(const void *src, enum dtype dt, int64_t off, __mmask16 m)
{
    if (dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, (const uint16_t *)src + off));
    return load16(src, dt, off, m);
}

/* r[j] = column j of the 16 x 16 matrix whose rows are r[0..15]. */
TARGET_AVX512 static void transpose16(__m512 r[16])
{
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane L: rows i, i+1 at columns 4L..4L+3 interleaved */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + c], lane L: rows i..i+3 at column 4L + c */
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) { /* column 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
        __m512 v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), w0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
        __m512 v1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        __m512 w1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_f32x4(v0, v1, 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(w0, w1, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
    }
}

/*
 * One panel of nl <= w lines that are contiguous in k (line i at src[(first + i) * ld + p0 ...]): `steps`
 * packed steps (see load16_steps) into dst[q * w + i], 16 lines by 16 steps at a time, transposed in
 * registers (shuffles only move bits). Lines nl .. w-1 are zero.
 */
TARGET_AVX512 static void pack_panel_transposed(uint32_t *dst, const void *src, enum dtype dt, int64_t ld,
                                                int64_t first, int64_t nl, int64_t p0, int64_t steps, int w)
{
    const int64_t per_step = dt == DT_BF16 ? 2 : 1; /* elements of src per packed step */
    for (int g = 0; g < w; g += 16) {
        const int64_t gl = nl - g; /* valid lines in this group (<= 0: all padding) */
        for (int64_t q0 = 0; q0 < steps; q0 += 16) {
            const int64_t nq = min64(16, steps - q0);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < gl ? load16_steps(src, dt, (first + g + i) * ld + p0 + q0 * per_step, lanes16(nq))
                              : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t j = 0; j < nq; j++)
                _mm512_mask_storeu_ps((float *)dst + (q0 + j) * w + g, lanes16(w - g), r[j]);
        }
    }
}

/*
 * The fp32/fp16 form of pack_bf16 below: `lines` lines from line l0, k range [p0, p0+kc), into
 * panels of w lines, panel-major, then k, then line: dst[q * w + r] = (line r, k p0 + q) as fp32.
 * Element (line l, k kk) is src[l * ld + kk] when contig_k, else src[kk * ld + l]. Lines past
 * `lines` are zero.
 */
TARGET_AVX512 static void pack_f32(float *dst, const void *src, enum dtype dt, int64_t ld, bool contig_k, int64_t l0,
                                   int64_t lines, int64_t p0, int64_t kc, int w)
{
    for (int64_t lp = 0; lp < lines; lp += w, dst += kc * w) {
        const int64_t nl = min64(w, lines - lp);
        if (!contig_k) { /* each k holds the panel's lines side by side: up to two masked loads */
            for (int64_t q = 0; q < kc; q++) {
                const int64_t off = (p0 + q) * ld + l0 + lp;
                for (int g = 0; g < w; g += 16)
                    _mm512_mask_storeu_ps(dst + q * w + g, lanes16(w - g), load16(src, dt, off + g, lanes16(nl - g)));
            }
            continue;
        }
        pack_panel_transposed((uint32_t *)dst, src, dt, ld, l0 + lp, nl, p0, kc, w);
    }
}

/*
 * Pack `lines` lines (rows of op(A) or columns of op(B)) starting at line l0, k range [p0, p0+kc),
 * into panels of w lines and `steps` pairs: panel-major, then pair q, then line: dst[q * w + r] holds
 * (line r, k 2q) in its low half and (line r, k 2q+1) in its high half. Element (line l, k kk) is
 * src[l * ld + kk] when contig_k, else src[kk * ld + l]. Lines past `lines`, the partner of an odd
 * last k and the pairs past (kc + 1) / 2 (AMX's padding to whole tiles) are zero.
 */
TARGET_BF16 static void pack_bf16(uint32_t *dst, const uint16_t *src, int64_t ld, bool contig_k, int64_t l0,
                                  int64_t lines, int64_t p0, int64_t kc, int w, int64_t steps)
{
    const int64_t pairs = (kc + 1) / 2, full = kc / 2;
    /* vpermt2w indices interleaving two 32 x 16-bit rows: out[2i] = lo[i], out[2i+1] = hi[i] */
    const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i idx_hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                            54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t lp = 0; lp < lines; lp += w, dst += steps * w) {
        const int nl = (int)min64(w, lines - lp);
        memset(dst + pairs * w, 0, (size_t)((steps - pairs) * w) * sizeof(uint32_t));
        if (contig_k) { /* the full pairs transposed; an odd last k alone in its pair */
            pack_panel_transposed(dst, src, DT_BF16, ld, l0 + lp, nl, p0, full, w);
            if (kc & 1)
                for (int r = 0; r < w; r++)
                    dst[full * w + r] = r < nl ? src[(l0 + lp + r) * ld + p0 + kc - 1] : 0;
        } else {
            /* nl <= w <= 32: one masked load per k row, lanes past nl read as zero */
            const __mmask32 lm = nl >= 32 ? 0xFFFFFFFFu : ((__mmask32)1 << nl) - 1;
            const __mmask16 m0 = lanes16(w), m1 = lanes16(w - 16);
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

/*
 * AMX's op(A) panels: MR_AMX rows, each row its `steps` pairs contiguous (a tile row is 16 pairs):
 * dst[r * steps + q] holds (row r, k 2q) low, (row r, k 2q+1) high. Rows past `lines`, the partner of an
 * odd last k and pairs past (kc + 1) / 2 are zero. Rows contiguous in k are copied as they are.
 */
TARGET_AVX512 static void pack_a_amx(uint32_t *dst, const uint16_t *src, int64_t ld, bool contig_k, int64_t l0,
                                     int64_t lines, int64_t p0, int64_t kc, int64_t steps)
{
    const int64_t pairs = (kc + 1) / 2;
    for (int64_t lp = 0; lp < lines; lp += MR_AMX, dst += MR_AMX * steps) {
        const int64_t nl = min64(MR_AMX, lines - lp);
        /* only the padding is zeroed: each row's values past kc, and the rows past `lines` */
        if (contig_k) {
            for (int64_t r = 0; r < nl; r++) {
                uint16_t *row = (uint16_t *)(void *)(dst + r * steps);
                memcpy(row, src + (l0 + lp + r) * ld + p0, (size_t)kc * sizeof(uint16_t));
                memset(row + kc, 0, (size_t)(2 * steps - kc) * sizeof(uint16_t));
            }
        } else {
            /* 16 rows by 16 pairs at a time: pair q of the 16 rows (two k rows of the source, widened and
             * joined) in vector q, then transposed (transpose16: shuffles only move bits) into one vector
             * per row; pairs past (kc + 1) / 2 and the partner of an odd last k load as zeros */
            for (int64_t r0 = 0; r0 < nl; r0 += 16) {
                const __mmask16 rm = lanes16(nl - r0);
                const int64_t rows = min64(16, nl - r0);
                for (int64_t q0 = 0; q0 < steps; q0 += 16) {
                    __m512 v[16];
                    for (int i = 0; i < 16; i++) {
                        const int64_t q = q0 + i;
                        __m512i x = _mm512_setzero_si512();
                        if (q < pairs) {
                            const uint16_t *lo = src + (p0 + 2 * q) * ld + l0 + lp + r0;
                            x = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rm, lo));
                            if (2 * q + 1 < kc)
                                x = _mm512_or_si512(
                                    x, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rm, lo + ld)), 16));
                        }
                        v[i] = _mm512_castsi512_ps(x);
                    }
                    transpose16(v);
                    for (int64_t r = 0; r < rows; r++)
                        _mm512_storeu_ps((float *)(dst + (r0 + r) * steps + q0), v[r]);
                }
            }
        }
        memset(dst + nl * steps, 0, (size_t)((MR_AMX - nl) * steps) * sizeof(uint32_t));
    }
}

/* The AMX tile shapes: every tile 16 rows of 64 bytes (C: 16 x 16 fp32; A: 16 rows x 16 pairs; B: 16 pairs
 * x 16 columns). Tiles 0-3 hold a 32 x 32 block of C, 4-5 two 16-row slices of A, 6-7 two 16-column
 * slices of B. Loaded per thread before its tiles are used (it zeroes them), released after. */
TARGET_AMX static void amx_configure(void)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    /* ldtilecfg in asm, not _tile_loadconfig: GCC 12 does not see that the builtin reads cfg and drops the
     * stores of colsb and rows (a zero shape leaves the tiles unconfigured: the first tile op is #UD) */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

TARGET_AMX static void amx_release(void)
{
    _tile_release();
}

/*
 * tile (MR_AMX x NR fp32) = A panel x B panel (pack_bf16, NR columns), `steps` pairs, a multiple of 16: per 16
 * pairs, two A tiles, two B tiles, four tdpbf16ps. The A panel's 32 rows are sa bytes apart: packed
 * (pack_a_amx, sa = steps pairs) or A itself (a_direct, sa = A's row); the tile's rows are stored ldt floats
 * apart (a tile buffer, or the partial sums). tdpbf16ps sums each pair's two
 * products before adding to C and groups the pairs of one instruction, so its sums are not vdpbf16ps's
 * (docs/backend.md); the order is fixed by k alone, so the bits do not depend on threads or blocking of m, n.
 */
TARGET_AMX static void kernel_amx(int64_t steps, const void *pa, size_t sa, const uint32_t *pb, float *tile,
                                  int64_t ldt)
{
    const size_t sb = NR * sizeof(uint32_t), sc = (size_t)ldt * sizeof(float);
    const char *a0 = pa, *a1 = a0 + 16 * sa; /* rows 0-15 and 16-31, sa bytes apart */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t q = 0; q < steps; q += 16) {
        _tile_loadd(4, a0 + q * sizeof(uint32_t), sa);
        _tile_loadd(5, a1 + q * sizeof(uint32_t), sa);
        _tile_loadd(6, pb + q * NR, sb);
        _tile_loadd(7, pb + q * NR + 16, sb);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, tile, sc);
    _tile_stored(1, tile + 16, sc);
    _tile_stored(2, tile + 16 * ldt, sc);
    _tile_stored(3, tile + 16 * ldt + 16, sc);
}

/* ---- microkernels: tile (MR x NR fp32, 64-byte aligned) = packed A panel x packed B panel ---------- */

/* A tile's rows and columns are independent lanes: a kernel that leaves out rows or the second half of the
 * columns computes the others' sums exactly as the full kernel would. So the edge tiles of C (fewer than MR rows,
 * or at most 16 columns) run kernels of 4 or 8 rows and of one zmm of columns (the packed panels keep their
 * MR / NR strides and zero padding; the rows and columns left out are never read by the epilogue): fashion_cnn's
 * 64-channel products (64 = 5 x 12 + 4 rows) and its 196-pixel planes (6 x 32 + 4 columns) spent a sixth and an
 * eighth of their FMAs on padding (`git show 5225666:docs/perf.md`, "Zen 4, twelfth session"). */
#define DECL2(i) __m512 c##i##_0 = _mm512_setzero_ps(), c##i##_1 = _mm512_setzero_ps()
#define DECL1(i) __m512 c##i##_0 = _mm512_setzero_ps()
#define STORE2(i)                                                                                                    \
    do {                                                                                                             \
        _mm512_store_ps(tile + (i) * NR, c##i##_0);                                                                  \
        _mm512_store_ps(tile + (i) * NR + 16, c##i##_1);                                                             \
    } while (0)
#define STORE1(i) _mm512_store_ps(tile + (i) * NR, c##i##_0)
#define ROWS4(X) X(0); X(1); X(2); X(3)
#define ROWS8(X) ROWS4(X); X(4); X(5); X(6); X(7)
#define ROWS12(X) ROWS8(X); X(8); X(9); X(10); X(11)
#define TILE_LOOP(ROWS, DECL, ROW, STORE)                                                                            \
    ROWS(DECL);                                                                                                      \
    for (int64_t q = 0; q < steps; q++, pa += MR, pb += NR) {                                                        \
        ROWS(ROW);                                                                                                   \
    }                                                                                                                \
    ROWS(STORE)

#define ROW2_F32(i)                                                                                                  \
    do {                                                                                                             \
        __m512 a_ = _mm512_set1_ps(pa[i]);                                                                           \
        c##i##_0 = _mm512_fmadd_ps(a_, _mm512_load_ps(pb), c##i##_0);                                                \
        c##i##_1 = _mm512_fmadd_ps(a_, _mm512_load_ps(pb + 16), c##i##_1);                                           \
    } while (0)
#define ROW1_F32(i) c##i##_0 = _mm512_fmadd_ps(_mm512_set1_ps(pa[i]), _mm512_load_ps(pb), c##i##_0)
#define ROW2_BF16(i)                                                                                                 \
    do {                                                                                                             \
        __m512bh a_ = (__m512bh)_mm512_set1_epi32((int)pa[i]);                                                       \
        c##i##_0 = _mm512_dpbf16_ps(c##i##_0, a_, (__m512bh)_mm512_load_si512(pb));                                  \
        c##i##_1 = _mm512_dpbf16_ps(c##i##_1, a_, (__m512bh)_mm512_load_si512(pb + 16));                             \
    } while (0)
#define ROW1_BF16(i)                                                                                                 \
    c##i##_0 = _mm512_dpbf16_ps(c##i##_0, (__m512bh)_mm512_set1_epi32((int)pa[i]),                                   \
                                (__m512bh)_mm512_load_si512(pb))

/* kernel_f32_R_H / kernel_bf16_R_H: R rows (4, 8, 12) by H zmm of columns (1: 16, 2: 32). */
#define DEFINE_KERNELS(R)                                                                                            \
    TARGET_AVX512 static void kernel_f32_##R##_2(int64_t steps, const float *pa, const float *pb, float *tile)       \
    {                                                                                                                \
        TILE_LOOP(ROWS##R, DECL2, ROW2_F32, STORE2);                                                                 \
    }                                                                                                                \
    TARGET_AVX512 static void kernel_f32_##R##_1(int64_t steps, const float *pa, const float *pb, float *tile)       \
    {                                                                                                                \
        TILE_LOOP(ROWS##R, DECL1, ROW1_F32, STORE1);                                                                 \
    }                                                                                                                \
    TARGET_BF16 static void kernel_bf16_##R##_2(int64_t steps, const uint32_t *pa, const uint32_t *pb,               \
                                                float *tile)                                                         \
    {                                                                                                                \
        TILE_LOOP(ROWS##R, DECL2, ROW2_BF16, STORE2);                                                                \
    }                                                                                                                \
    TARGET_BF16 static void kernel_bf16_##R##_1(int64_t steps, const uint32_t *pa, const uint32_t *pb,               \
                                                float *tile)                                                         \
    {                                                                                                                \
        TILE_LOOP(ROWS##R, DECL1, ROW1_BF16, STORE1);                                                                \
    }
DEFINE_KERNELS(4)
DEFINE_KERNELS(8)
DEFINE_KERNELS(12)
#undef DEFINE_KERNELS

typedef void (*kernel_f32_fn)(int64_t, const float *, const float *, float *);
typedef void (*kernel_bf16_fn)(int64_t, const uint32_t *, const uint32_t *, float *);
static const kernel_f32_fn kernels_f32[3][2] = { { kernel_f32_4_1, kernel_f32_4_2 }, { kernel_f32_8_1, kernel_f32_8_2 },
                                                 { kernel_f32_12_1, kernel_f32_12_2 } };
static const kernel_bf16_fn kernels_bf16[3][2] = { { kernel_bf16_4_1, kernel_bf16_4_2 },
                                                   { kernel_bf16_8_1, kernel_bf16_8_2 },
                                                   { kernel_bf16_12_1, kernel_bf16_12_2 } };

/* ---- epilogue and driver --------------------------------------------------------------------------- */

/* 16 elements of C (dtype dt) at p as fp32, lanes outside m zero. */
TARGET_AVX512 static __m512 load_c(const void *p, enum dtype dt, __mmask16 m)
{
    if (dt == DT_BF16)
        return bf16_lanes_widen(_mm256_maskz_loadu_epi16(m, p));
    return load16(p, dt, 0, m);
}

/* v rounded once to C's dtype into lanes m of p (fp16: vcvtps2ph, bit for bit dtype.c's fp16_from_fp32). */
TARGET_AVX512 static void store_c(void *p, enum dtype dt, __mmask16 m, __m512 v)
{
    if (dt == DT_BF16)
        _mm512_mask_cvtepi32_storeu_epi16(p, m, bf16_lanes_round(v));
    else if (dt == DT_FP16)
        _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else
        _mm512_mask_storeu_ps(p, m, v);
}

/* The lanes of 16 elements of a ReLU mask (C's dtype, lanes outside m zero) that pass ReLU: > 0, or a NaN
 * (act_apply's x <= 0 test failing); +0, -0 and any negative do not. */
TARGET_AVX512 static __mmask16 relu_passes(const void *p, enum dtype dt, __mmask16 m)
{
    if (dt == DT_FP32)
        return _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, p), _mm512_setzero_ps(), _CMP_NLE_UQ);
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    const __m512i mag = _mm512_and_si512(h, _mm512_set1_epi32(0x7FFF));
    const __m512i inf = _mm512_set1_epi32(dt == DT_BF16 ? 0x7F80 : 0x7C00);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(mag, inf);
    const __mmask16 pos = _mm512_testn_epi32_mask(h, _mm512_set1_epi32(0x8000)) &
                          _mm512_test_epi32_mask(mag, mag);
    return m & (nan | pos);
}

/* The valid mr x nr part of a tile at C's (i0, j0): add earlier k blocks' partial sums, then either
 * keep the sum for the next block or finish it (alpha, beta * C_old, bias, ReLU or its mask, store / round
 * once). Zeroing a lane before the rounding gives the +0 the ReLU ops give after it: a value rounds to <= 0
 * exactly when it is <= 0, and a NaN stays one. */
TARGET_AVX512 static inline __attribute__((always_inline)) void
epilogue_with(const struct gemm_avx512_args *g, const float *tile, int64_t i0, int64_t j0, int mr, int nr, bool first,
              bool last, float *w, int64_t ldw, bool relu, const char *rmask)
{
    /* g's fields as locals: C's stores could alias *g for all the compiler knows, and would make it read them
     * again for every row */
    const __m512 alpha = _mm512_set1_ps(g->alpha), beta = _mm512_set1_ps(g->beta);
    const bool has_beta = g->beta != 0.0f;
    const float *const bias_p = g->bias, *const row_bias = g->row_bias;
    const bool extra = has_beta || bias_p || row_bias;
    const enum dtype c_dt = g->c_dt;
    const size_t csize = dtype_size(c_dt);
    char *const c = g->c;
    const int64_t ldc = g->ldc, ldr = g->ldr;
    for (int v = 0; v < 2 && nr > 16 * v; v++) {
        const __mmask16 m = lanes16(nr - 16 * v);
        const int64_t j = j0 + 16 * v;
        const __m512 bias = bias_p ? _mm512_maskz_loadu_ps(m, bias_p + j) : _mm512_setzero_ps();
        for (int r = 0; r < mr; r++) {
            const int64_t i = i0 + r;
            __m512 s = _mm512_load_ps(tile + r * NR + 16 * v);
            if (!first)
                s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, w + i * ldw + j), s);
            if (!last) {
                _mm512_mask_storeu_ps(w + i * ldw + j, m, s);
                continue;
            }
            void *cp = c + (size_t)(i * ldc + j) * csize;
            __m512 out;
            if (extra) {
                __m512 e = row_bias ? _mm512_set1_ps(row_bias[i]) : bias; /* either bias needs beta 0 */
                if (has_beta)
                    e = _mm512_mul_ps(beta, load_c(cp, c_dt, m));
                out = _mm512_fmadd_ps(alpha, s, e);
            } else {
                out = _mm512_mul_ps(alpha, s);
            }
            if (relu)
                out = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(out, _mm512_setzero_ps(), _CMP_NLE_UQ), out);
            if (rmask)
                out = _mm512_maskz_mov_ps(relu_passes(rmask + (size_t)(i * ldr + j) * csize, c_dt, m), out);
            store_c(cp, c_dt, m, out);
        }
    }
}

/* The epilogue compiled twice: without the ReLU tests for the products that have none (most), and with them. */
TARGET_AVX512 static void epilogue(const struct gemm_avx512_args *g, const float *tile, int64_t i0, int64_t j0,
                                   int mr, int nr, bool first, bool last, float *w, int64_t ldw)
{
    if (!g->relu && !g->relu_mask)
        epilogue_with(g, tile, i0, j0, mr, nr, first, last, w, ldw, false, NULL);
    else
        epilogue_with(g, tile, i0, j0, mr, nr, first, last, w, ldw, g->relu, g->relu_mask);
}

/* Pack op(A) rows or op(B) columns for the input dtype (see pack_f32), `steps` packed steps per line. */
TARGET_AVX512 static void pack(enum dtype in, uint32_t *dst, const void *src, int64_t ld, bool contig_k, int64_t l0,
                               int64_t lines, int64_t p0, int64_t kc, int w, int64_t steps)
{
    if (in == DT_BF16)
        pack_bf16(dst, src, ld, contig_k, l0, lines, p0, kc, w, steps);
    else
        pack_f32((float *)dst, src, in, ld, contig_k, l0, lines, p0, kc, w);
}

/* The microkernel for inputs `in` (amx: on_tiles's answer): tile = A panel x B panel over `steps`, at least its
 * first mr rows and nr columns (the edge kernels above); an AMX A panel's rows are sa bytes apart (packed: steps
 * pairs). */
TARGET_AVX512 static void kernel(enum dtype in, bool amx, int64_t steps, const uint32_t *ap, size_t sa,
                                 const uint32_t *bp, float *tile, int mr, int nr)
{
    const int rows = mr <= 4 ? 0 : mr <= 8 ? 1 : 2, halves = nr <= 16 ? 0 : 1;
    if (amx)
        kernel_amx(steps, ap, sa, bp, tile, NR);
    else if (in == DT_BF16)
        kernels_bf16[rows][halves](steps, ap, bp, tile);
    else
        kernels_f32[rows][halves](steps, (const float *)ap, (const float *)bp, tile);
}

/* op(A)'s rows [l0, l0 + lines) of one k block into dst: whole panels of mr rows, each row its `steps`. */
TARGET_AVX512 static void pack_a_rows(const struct gemm_avx512_args *g, uint32_t *dst, int64_t l0, int64_t lines,
                                      int64_t p0, int64_t kcur, int64_t steps)
{
    if (a_direct(g->in, g->amx, g->ta, g->m, kcur))
        return; /* tiles reads A itself */
    if (on_tiles(g->in, g->amx))
        pack_a_amx(dst, g->a, g->lda, !g->ta, l0, lines, p0, kcur, steps);
    else
        pack(g->in, dst, g->a, g->lda, !g->ta, l0, lines, p0, kcur, MR, steps);
}

/* Every tile of C's rows [i0, i0 + mc) (their panels packed in pa, or A itself: a_direct) by columns [j0, j0 + nc)
 * (packed in pb) over the k block [p0, p0 + kcur) of `steps`, each with its epilogue (first, last: the k block's
 * place). */
TARGET_AVX512 static void tiles(const struct gemm_avx512_args *g, int64_t steps, const uint32_t *pa, int64_t i0,
                                int64_t mc, const uint32_t *pb, int64_t j0, int64_t nc, int64_t p0, int64_t kcur,
                                float *w, int64_t ldw, float *tile)
{
    const bool amx = on_tiles(g->in, g->amx), direct = a_direct(g->in, g->amx, g->ta, g->m, kcur);
    const bool first = p0 == 0, last = p0 + kcur >= g->k;
    const int64_t mr = mr_of(g->in, amx);
    const size_t sa = direct ? (size_t)g->lda * sizeof(uint16_t) : (size_t)steps * sizeof(uint32_t);
    for (int64_t jr = 0; jr < nc; jr += NR) {
        const uint32_t *bp = pb + (jr / NR) * steps * NR;
        const int nr = (int)min64(NR, nc - jr);
        for (int64_t ir = 0; ir < mc; ir += mr) {
            const uint32_t *ap = direct ? (const uint32_t *)(const void *)((const uint16_t *)g->a +
                                                                           (i0 + ir) * g->lda + p0)
                                        : pa + (ir / mr) * steps * mr;
            if (amx && first && !last && nr == NR && mc - ir >= MR_AMX) {
                /* the first of several k blocks: the sums are the partial sums as they are (the epilogue's copy) */
                kernel_amx(steps, ap, sa, bp, w + (i0 + ir) * ldw + j0 + jr, ldw);
                continue;
            }
            const int rows = (int)min64(mr, mc - ir);
            kernel(g->in, amx, steps, ap, sa, bp, tile, rows, nr);
            epilogue(g, tile, i0 + ir, j0 + jr, rows, nr, first, last, w, ldw);
        }
    }
}

/* One (n block, k block) of the product for rows [r0, r1) of C, op(B)'s panels already packed in pb:
 * op(A)'s rows packed MC at a time into pa, then every MR x NR tile and its epilogue. */
TARGET_AVX512 static void block_rows(const struct gemm_avx512_args *g, int64_t jc, int64_t nc, int64_t p0,
                                     int64_t kcur, int64_t r0, int64_t r1, uint32_t *pa, const uint32_t *pb,
                                     float *w, int64_t ldw)
{
    const bool amx = on_tiles(g->in, g->amx);
    const int64_t steps = steps_of(g->in, amx, kcur);
    float tile[MR_AMX * NR] __attribute__((aligned(64)));
    if (amx)
        amx_configure();
    for (int64_t ic = r0; ic < r1; ic += MC) {
        const int64_t mc = min64(MC, r1 - ic);
        pack_a_rows(g, pa, ic, mc, p0, kcur, steps);
        tiles(g, steps, pa, ic, mc, pb, jc, nc, p0, kcur, w, ldw, tile);
    }
    if (amx)
        amx_release();
    /* Leave the vector registers' upper halves clean (vzeroupper). GCC 12 ends this function with a tail call to
     * amx_release and no vzeroupper before it, and with the upper state dirty every legacy-SSE instruction after it
     * (the engine is built for baseline x86-64) waits on a merge: glibc's exp ran 6x slower in the loss. */
    _mm256_zeroupper();
}

/* Where the partial sums of an unfinished k block go: `partial`, or C itself (gemm_avx512_scratch). */
static float *partial_target(const struct gemm_avx512_args *g, float *partial, int64_t *ldw)
{
    *ldw = partial ? g->n : g->ldc;
    return partial ? partial : (float *)g->c;
}

TARGET_AVX512 void gemm_avx512(const struct gemm_avx512_args *g, void *pack_a, void *pack_b, float *partial)
{
    const int64_t m = g->m, n = g->n, k = g->k, kc = block_k(g->in, g->amx, k);
    int64_t ldw;
    float *w = partial_target(g, partial, &ldw);
    for (int64_t jc = 0; jc < n; jc += NC) {
        const int64_t nc = min64(NC, n - jc);
        for (int64_t p0 = 0; p0 < k; p0 += kc) {
            const int64_t kcur = min64(kc, k - p0);
            pack(g->in, pack_b, g->b, g->ldb, g->tb, jc, nc, p0, kcur, NR, steps_of(g->in, g->amx, kcur));
            block_rows(g, jc, nc, p0, kcur, 0, m, pack_a, pack_b, w, ldw);
        }
    }
}

/* ---- the threaded driver ----------------------------------------------------------------------------- */

/*
 * Three ways to share a product out, chosen by gemm_avx512_plan from the shape alone:
 *  - GEMM_SPLIT_COLUMNS, few rows (at most MC, or, off AMX, no more rows than columns and at most 4 MC; n at most
 *    NC): every thread packs all of op(A), every k block, once into its own buffer, and chunks of COL_PANELS
 *    panels of columns (fewer where that would leave one chunk: col_panels) each run every k block: pack
 *    their own columns of op(B) into their own region of the shared buffer, then every tile of those columns.
 *    Banding so few rows would give each thread a few panels that still read all of op(B), packed half by the
 *    other thread (in the other core's cache). On AMX more than MC rows are banded: a thread then writes whole
 *    rows of C, which is how the jobs after a weight gradient (the gradient check, the optimizer) cut it, so
 *    they find their rows in their own core's cache. fashion_mlp's two 512-row weight gradients ran slower
 *    banded alone (bench_gemm) but the step 1.05x faster at 2 threads
 *    (`git show 99ca90b:docs/perf.md`, "Home ranges").
 *  - GEMM_SPLIT_BANDS_WHOLE_B, several k blocks and op(B) small (n at most NC, packed at most
 *    WHOLE_B_BYTES): every thread packs all of op(B), every k block, once into its own buffer, and bands of
 *    rows each run every k block. One pool job where the bands below take two a k block.
 *  - GEMM_SPLIT_BANDS: for each (n block, k block), op(B)'s panels packed into the shared buffer
 *    (PANELS_PER_CHUNK a chunk), then bands of rows, each thread packing its band's rows into its own.
 * Bands are whole panels of rows (at most GEMM_AVX512_MAX_BANDS, fixed by m). In all three each element of
 * C is summed over the k blocks in order, within one over the kernel's steps, with the epilogue of each k
 * block in between: gemm_avx512's order, so the same bits.
 */
#define PANELS_PER_CHUNK 2
#define COL_PANELS 4
#define WHOLE_B_BYTES ((size_t)1 << 20)

/* The product a thread last packed a whole operand for (into its own buffer), by number. */
static _Atomic uint64_t whole_seq;
static _Thread_local uint64_t whole_packed;

/* Rows a band: whole panels, at most GEMM_AVX512_MAX_BANDS bands, fixed by m. */
static int64_t row_band(enum dtype in, bool amx, int64_t m)
{
    const int64_t mr = mr_of(in, amx), panels = (m + mr - 1) / mr;
    int64_t per = (panels + GEMM_AVX512_MAX_BANDS - 1) / GEMM_AVX512_MAX_BANDS;
    return per * mr;
}

/* Panels of columns a chunk of GEMM_SPLIT_COLUMNS: COL_PANELS; on the FMA kernel (fp32, fp16) half of n's
 * panels (rounded up) where n has fewer than 2 COL_PANELS, so that a product of few columns is still two
 * chunks (fashion_cnn's fc1 forward, 128 x 128 x 3136 fp32: `MODEL=cnn DTYPE=fp32 scripts/bench/bench_gemm.sh`,
 * `git show 0392743:docs/perf.md`). Not for bf16, whose products are fast enough that packing all of op(A)
 * twice cost more than the split saved when this was tried. Fixed by the shape and dtype. */
static int64_t col_panels(enum dtype in, int64_t n)
{
    const int64_t panels = (n + NR - 1) / NR;
    return panels >= 2 * COL_PANELS || in == DT_BF16 ? COL_PANELS : (panels + 1) / 2;
}

/* One k block of an operand packed whole: lines rounded up to whole panels of w, each its steps. */
static int64_t whole_stride(enum dtype in, bool amx, int64_t lines, int w, int64_t k)
{
    return round_up(lines, w) * steps_of(in, amx, block_k(in, amx, k));
}

void gemm_avx512_plan(enum dtype in, bool amx, int64_t m, int64_t n, int64_t k, struct gemm_avx512_plan *p)
{
    amx = on_tiles(in, amx);
    const int64_t kc = block_k(in, amx, k), blocks = (k + kc - 1) / kc, mr = mr_of(in, amx);
    const size_t whole_b = (size_t)(whole_stride(in, amx, n, NR, k) * blocks) * sizeof(uint32_t);
    struct gemm_avx512_scratch s;
    gemm_avx512_scratch_sizes(in, amx, m, n, k, &s);
    *p = (struct gemm_avx512_plan){ 0 };
    if ((m <= MC || (!amx && m <= n && m <= 4 * MC)) && n <= NC) {
        p->split = GEMM_SPLIT_COLUMNS;
        p->chunks = (n + col_panels(in, n) * NR - 1) / (col_panels(in, n) * NR);
        p->worker_a_bytes = (size_t)(whole_stride(in, amx, m, mr, k) * blocks) * sizeof(uint32_t);
        p->shared_b_bytes = s.pack_b_bytes;
    } else if (blocks > 1 && n <= NC && whole_b <= WHOLE_B_BYTES) {
        p->split = GEMM_SPLIT_BANDS_WHOLE_B;
        p->chunks = (m + row_band(in, amx, m) - 1) / row_band(in, amx, m);
        p->worker_a_bytes = s.pack_a_bytes;
        p->worker_b_bytes = whole_b;
    } else {
        p->split = GEMM_SPLIT_BANDS;
        p->chunks = (m + row_band(in, amx, m) - 1) / row_band(in, amx, m);
        p->worker_a_bytes = s.pack_a_bytes;
        p->shared_b_bytes = s.pack_b_bytes;
    }
}

struct par_block {
    const struct gemm_avx512_args *g;
    void *const *pack_a, *const *pack_b; /* per worker */
    uint32_t *pb;                        /* shared */
    float *w;
    int64_t ldw, jc, nc, p0, kcur, band;
    int64_t kc, whole;                   /* the whole operand's k blocks: kc, stride between them */
    uint64_t seq;                        /* this product's number (whole_packed) */
};

/* Pack op(A) (rows, w = mr) or op(B) (columns, w = NR), every k block, into dst, unless this thread already
 * has for this product. */
TARGET_AVX512 static void pack_whole(const struct par_block *b, bool a_side, uint32_t *dst)
{
    if (whole_packed == b->seq)
        return;
    const struct gemm_avx512_args *g = b->g;
    for (int64_t p0 = 0, blk = 0; p0 < g->k; p0 += b->kc, blk++) {
        const int64_t kcur = min64(b->kc, g->k - p0), steps = steps_of(g->in, g->amx, kcur);
        uint32_t *d = dst + blk * b->whole;
        if (a_side)
            pack_a_rows(g, d, 0, g->m, p0, kcur, steps);
        else
            pack(g->in, d, g->b, g->ldb, g->tb, 0, g->n, p0, kcur, NR, steps);
    }
    whole_packed = b->seq;
}

TARGET_AVX512 static void pack_b_chunk(void *arg, int64_t chunk, int worker)
{
    (void)worker;
    const struct par_block *b = arg;
    const int64_t steps = steps_of(b->g->in, b->g->amx, b->kcur), j0 = chunk * PANELS_PER_CHUNK * NR;
    const int64_t lines = min64(PANELS_PER_CHUNK * NR, b->nc - j0);
    pack(b->g->in, b->pb + (j0 / NR) * steps * NR, b->g->b, b->g->ldb, b->g->tb, b->jc + j0, lines, b->p0, b->kcur,
         NR, steps);
}

TARGET_AVX512 static void rows_chunk(void *arg, int64_t chunk, int worker)
{
    const struct par_block *b = arg;
    const int64_t r0 = chunk * b->band, r1 = min64(r0 + b->band, b->g->m);
    block_rows(b->g, b->jc, b->nc, b->p0, b->kcur, r0, r1, b->pack_a[worker], b->pb, b->w, b->ldw);
}

/* A band of rows through every k block, against this thread's whole op(B). */
TARGET_AVX512 static void rows_whole_b_chunk(void *arg, int64_t chunk, int worker)
{
    const struct par_block *b = arg;
    const struct gemm_avx512_args *g = b->g;
    const int64_t r0 = chunk * b->band, r1 = min64(r0 + b->band, g->m);
    uint32_t *pb = b->pack_b[worker];
    pack_whole(b, false, pb);
    for (int64_t p0 = 0, blk = 0; p0 < g->k; p0 += b->kc, blk++)
        block_rows(g, 0, g->n, p0, min64(b->kc, g->k - p0), r0, r1, b->pack_a[worker], pb + blk * b->whole, b->w,
                   b->ldw);
}

/* Columns [j0, j0 + col_panels(in, n) * NR) of C: every k block in order, its panels of op(B) packed into this chunk's
 * own region of pb, then every tile of those columns against this thread's whole op(A). */
TARGET_AVX512 static void cols_chunk(void *arg, int64_t chunk, int worker)
{
    const struct par_block *b = arg;
    const struct gemm_avx512_args *g = b->g;
    const bool amx = on_tiles(g->in, g->amx);
    const int64_t k = g->k, cols = col_panels(g->in, g->n) * NR, j0 = chunk * cols, nc = min64(cols, g->n - j0);
    uint32_t *pb = b->pb + (j0 / NR) * steps_of(g->in, amx, b->kc) * NR, *pa_all = b->pack_a[worker];
    float tile[MR_AMX * NR] __attribute__((aligned(64)));
    pack_whole(b, true, pa_all);
    if (amx)
        amx_configure();
    for (int64_t p0 = 0, blk = 0; p0 < k; p0 += b->kc, blk++) {
        const int64_t kcur = min64(b->kc, k - p0), steps = steps_of(g->in, g->amx, kcur);
        pack(g->in, pb, g->b, g->ldb, g->tb, j0, nc, p0, kcur, NR, steps);
        tiles(g, steps, pa_all + blk * b->whole, 0, g->m, pb, j0, nc, p0, kcur, b->w, b->ldw, tile);
    }
    if (amx)
        amx_release();
    _mm256_zeroupper(); /* as block_rows */
}

TARGET_AVX512 void gemm_avx512_threaded(const struct gemm_avx512_args *g, const struct gemm_avx512_plan *plan,
                                        struct threadpool *pool, void *const *pack_a, void *const *pack_b,
                                        void *shared_b, float *partial)
{
    const bool amx = on_tiles(g->in, g->amx);
    const int64_t m = g->m, n = g->n, k = g->k, kc = block_k(g->in, g->amx, k);
    struct par_block b = { .g = g, .pack_a = pack_a, .pack_b = pack_b, .pb = shared_b, .kc = kc,
                           .band = row_band(g->in, g->amx, m), .seq = atomic_fetch_add(&whole_seq, 1) + 1 };
    b.w = partial_target(g, partial, &b.ldw);
    if (plan->split == GEMM_SPLIT_COLUMNS) {
        b.whole = whole_stride(g->in, amx, m, (int)mr_of(g->in, amx), k);
        parallel_for(pool, plan->chunks, cols_chunk, &b);
        return;
    }
    if (plan->split == GEMM_SPLIT_BANDS_WHOLE_B) {
        b.whole = whole_stride(g->in, amx, n, NR, k);
        parallel_for(pool, plan->chunks, rows_whole_b_chunk, &b);
        return;
    }
    for (b.jc = 0; b.jc < n; b.jc += NC) {
        b.nc = min64(NC, n - b.jc);
        const int64_t panels = (b.nc + NR - 1) / NR;
        for (b.p0 = 0; b.p0 < k; b.p0 += kc) {
            b.kcur = min64(kc, k - b.p0);
            parallel_for(pool, (panels + PANELS_PER_CHUNK - 1) / PANELS_PER_CHUNK, pack_b_chunk, &b);
            parallel_for(pool, plan->chunks, rows_chunk, &b);
        }
    }
}

#else /* not x86-64: the portable path only */

bool gemm_avx512_supported(enum dtype in)
{
    (void)in;
    return false;
}

void gemm_avx512(const struct gemm_avx512_args *g, void *pack_a, void *pack_b, float *partial)
{
    (void)g, (void)pack_a, (void)pack_b, (void)partial;
}

bool gemm_avx512_transposed_fits(enum dtype in, int64_t m, int64_t n)
{
    (void)in, (void)m, (void)n;
    return false;
}

bool gemm_avx512_amx_supported(void)
{
    return false;
}

void gemm_avx512_plan(enum dtype in, bool amx, int64_t m, int64_t n, int64_t k, struct gemm_avx512_plan *p)
{
    (void)in, (void)amx, (void)m, (void)n, (void)k;
    *p = (struct gemm_avx512_plan){ .split = GEMM_SPLIT_BANDS, .chunks = 1 };
}

void gemm_avx512_threaded(const struct gemm_avx512_args *g, const struct gemm_avx512_plan *plan,
                          struct threadpool *pool, void *const *pack_a, void *const *pack_b, void *shared_b,
                          float *partial)
{
    (void)g, (void)plan, (void)pool, (void)pack_a, (void)pack_b, (void)shared_b, (void)partial;
}

#endif
