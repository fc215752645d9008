/*
 * dtype.c — the reference fp32 <-> fp16 / bf16 conversions, the bulk converter, and the choice of
 * vectorised path. See dtype.h for the contract.
 *
 * The scalar functions here are the definition of every conversion in ampTrain: the CPU model stores
 * its low-precision tensors through them, the SIMD paths in dtype_simd.c must agree with them bit for
 * bit, and tests/test_cuda_convert.c holds the GPU kernels to them. They use integer arithmetic on the
 * bit patterns only, so they give the same answer whatever the FPU's rounding mode or FTZ/DAZ flags.
 *
 * NaN handling (the one place where "as the hardware does" needs a choice):
 *   fp32 -> fp16: quiet NaN, sign kept, the top 10 mantissa bits kept (truncated), quiet bit set;
 *                 this is what x86 F16C (vcvtps2ph) produces.
 *   fp32 -> bf16: (bits >> 16) | 0x0040, the usual bf16 definition and what AVX512-BF16 produces.
 *   fp16 -> fp32: payload shifted into place and the quiet bit set, as F16C's vcvtph2ps does (it
 *                 quiets signalling NaNs), so that the F16C bulk path needs no fix-up.
 *   bf16 -> fp32: exact: the 16 bits become the top half of the fp32 (a signalling NaN stays one).
 *
 * Bulk conversion between fp16 and bf16 goes through fp32; the first step is exact, so only one
 * rounding happens.
 */
#include "dtype.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype_simd.h"  /* dtype_simd_table, the vectorised paths and their names */

static uint32_t bits_of_float(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float float_of_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

size_t dtype_size(enum dtype dt)
{
    switch (dt) {
    case DT_FP32: return 4;
    case DT_FP16: return 2;
    case DT_BF16: return 2;
    case DT_FP8_E4M3:
    case DT_FP8_E5M2: return 1;
    case DT_COUNT: break;
    }
    return 0;
}

const char *dtype_name(enum dtype dt)
{
    switch (dt) {
    case DT_FP32: return "fp32";
    case DT_FP16: return "fp16";
    case DT_BF16: return "bf16";
    case DT_FP8_E4M3: return "e4m3";
    case DT_FP8_E5M2: return "e5m2";
    case DT_COUNT: break;
    }
    return "unknown";
}

/* Round-to-nearest-even of `q + rem / 2^shift`, where rem < 2^shift and shift >= 1. */
static uint32_t round_shifted(uint32_t mantissa, unsigned shift)
{
    uint32_t q = mantissa >> shift;
    uint32_t rem = mantissa & ((UINT32_C(1) << shift) - 1);
    uint32_t half = UINT32_C(1) << (shift - 1);
    if (rem > half || (rem == half && (q & 1)))
        q++;
    return q;
}

uint16_t fp16_from_fp32(float x)
{
    uint32_t u = bits_of_float(x);
    uint32_t sign = (u >> 16) & 0x8000;
    uint32_t a = u & 0x7FFFFFFF;

    if (a > 0x7F800000)                       /* NaN */
        return (uint16_t)(sign | 0x7E00 | ((a >> 13) & 0x03FF));
    if (a >= 0x477FF000)                      /* >= 65520 rounds past 65504: Inf (Inf included) */
        return (uint16_t)(sign | 0x7C00);
    if (a >= 0x38800000) {                    /* >= 2^-14: normal fp16 */
        uint32_t r = a - 0x38000000;          /* exponent rebiased from 127 to 15 */
        r += 0x0FFF + ((r >> 13) & 1);        /* RNE on the 13 dropped bits; a carry bumps the exponent */
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000)                      /* <= 2^-25: zero (2^-25 itself is a tie, to even 0) */
        return (uint16_t)sign;
    /* Subnormal fp16: the result counts units of 2^-24. |x| = m * 2^(e - 150), so the count is
     * m / 2^(126 - e), with 14 <= 126 - e <= 24. Rounding up from 0x3FF gives 0x400, the smallest normal. */
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x007FFFFF) | 0x00800000;
    return (uint16_t)(sign | round_shifted(m, 126 - e));
}

float fp16_to_fp32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1F;
    uint32_t m = h & 0x03FF;

    if (e == 0x1F) {
        if (m == 0)
            return float_of_bits(sign | 0x7F800000);
        return float_of_bits(sign | 0x7FC00000 | (m << 13));  /* NaN: payload in place, made quiet */
    }
    if (e != 0)
        return float_of_bits(sign | ((e + 112) << 23) | (m << 13));
    if (m == 0)
        return float_of_bits(sign);
    /* Subnormal fp16 m * 2^-24: normalise so the leading 1 becomes the implicit bit. */
    uint32_t exponent = 113;                  /* 2^-14 in fp32's bias, before the shifts */
    while (!(m & 0x0400)) {
        m <<= 1;
        exponent--;
    }
    return float_of_bits(sign | (exponent << 23) | ((m & 0x03FF) << 13));
}

uint16_t bf16_from_fp32(float x)
{
    uint32_t u = bits_of_float(x);
    if ((u & 0x7FFFFFFF) > 0x7F800000)        /* NaN */
        return (uint16_t)((u >> 16) | 0x0040);
    /* RNE on the 16 dropped bits; finite values near FLT_MAX carry into the exponent and give Inf,
     * and Inf itself has zero low bits so it stays Inf. */
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* ---- fp8 ------------------------------------------------------------------------------------------- */

struct fp8_layout {
    int mbits, bias;
    double max;
};

static struct fp8_layout fp8_layout_of(enum fp8_format f)
{
    return f == FP8_E4M3 ? (struct fp8_layout){3, 7, 448.0} : (struct fp8_layout){2, 15, 57344.0};
}

float fp8_max(enum fp8_format f)
{
    return (float)fp8_layout_of(f).max;
}

uint8_t fp8_from_fp32(float x, enum fp8_format f, int saturate)
{
    const int mbits = f == FP8_E4M3 ? 3 : 2, bias = f == FP8_E4M3 ? 7 : 15;
    const uint32_t maxcode = f == FP8_E4M3 ? 0x7E : 0x7B; /* 448 = 1.75 2^8, 57344 = 1.75 2^15 */
    uint32_t u = bits_of_float(x);
    uint32_t a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) /* NaN */
        return 0x7F;
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const int emin = 1 - bias; /* exponent of the smallest normal */
    uint32_t code;
    if ((int)(a >> 23) - 127 >= emin) {
        /* a normal fp8 (or beyond): round fp32's bits to nearest even at mbits mantissa bits; a carry moves into
         * the exponent as it should, and Inf (exponent all ones) lands beyond maxcode */
        const unsigned shift = 23 - (unsigned)mbits;
        uint32_t r = (a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift;
        code = r - ((uint32_t)(127 - bias) << mbits);
    } else {
        /* below the normal range: count quanta of 2^(emin - mbits) (exact: a power-of-two scaling of a value
         * this small), rounded to nearest even; 2^mbits quanta is the smallest normal's code, as it should be */
        code = (uint32_t)nearbyintf(ldexpf(float_of_bits(a), mbits - emin));
    }
    if (code > maxcode) {
        if (saturate)
            return (uint8_t)(sign | maxcode);
        return (uint8_t)(sign | (f == FP8_E4M3 ? 0x7F : 0x7C));
    }
    return (uint8_t)(sign | code);
}

float fp8_to_fp32(uint8_t v, enum fp8_format f)
{
    const struct fp8_layout L = fp8_layout_of(f);
    float sign = (v & 0x80) ? -1.0f : 1.0f;
    int field = (v & 0x7F) >> L.mbits, mant = v & ((1 << L.mbits) - 1);
    if (f == FP8_E4M3 && (v & 0x7F) == 0x7F)
        return NAN;
    if (f == FP8_E5M2 && field == 0x1F)
        return mant ? NAN : sign * INFINITY;
    if (field == 0)
        return sign * (float)ldexp(mant, 1 - L.bias - L.mbits);
    return sign * (float)ldexp((1 << L.mbits) + mant, field - L.bias - L.mbits);
}

float dtype_round(float x, enum dtype dt)
{
    switch (dt) {
    case DT_FP16: return fp16_to_fp32(fp16_from_fp32(x));
    case DT_BF16: return bf16_to_fp32(bf16_from_fp32(x));
    case DT_FP8_E4M3: return fp8_to_fp32(fp8_from_fp32(x, FP8_E4M3, 1), FP8_E4M3);
    case DT_FP8_E5M2: return fp8_to_fp32(fp8_from_fp32(x, FP8_E5M2, 1), FP8_E5M2);
    case DT_FP32:
    case DT_COUNT: break;
    }
    return x;
}

/* ---- bulk conversion -------------------------------------------------------------------------- */

/* fp8 -> fp32 by table: 256 exact values a format, filled once. */
static float fp8_table[2][256];
static pthread_once_t fp8_table_once = PTHREAD_ONCE_INIT;

static void fp8_table_fill(void)
{
    for (int v = 0; v < 256; v++) {
        fp8_table[0][v] = fp8_to_fp32((uint8_t)v, FP8_E4M3);
        fp8_table[1][v] = fp8_to_fp32((uint8_t)v, FP8_E5M2);
    }
}

/* src and dst may lie at any address (dtype_simd.h's loads and stores). */
static float load_as_fp32(const void *src, enum dtype dt, size_t i)
{
    switch (dt) {
    case DT_FP16: return fp16_to_fp32(dtype_ld_u16(src, i));
    case DT_BF16: return bf16_to_fp32(dtype_ld_u16(src, i));
    case DT_FP8_E4M3: return fp8_table[0][((const uint8_t *)src)[i]];
    case DT_FP8_E5M2: return fp8_table[1][((const uint8_t *)src)[i]];
    case DT_FP32:
    case DT_COUNT: break;
    }
    return dtype_ld_f32(src, i);
}

static void store_from_fp32(void *dst, enum dtype dt, size_t i, float x)
{
    switch (dt) {
    case DT_FP16: dtype_st_u16(dst, i, fp16_from_fp32(x)); return;
    case DT_BF16: dtype_st_u16(dst, i, bf16_from_fp32(x)); return;
    case DT_FP8_E4M3: ((uint8_t *)dst)[i] = fp8_from_fp32(x, FP8_E4M3, 1); return;
    case DT_FP8_E5M2: ((uint8_t *)dst)[i] = fp8_from_fp32(x, FP8_E5M2, 1); return;
    case DT_FP32:
    case DT_COUNT: break;
    }
    dtype_st_f32(dst, i, x);
}

void dtype_convert_portable(void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n)
{
    if (n == 0 || dst_dt >= DT_COUNT || src_dt >= DT_COUNT)
        return;
    if (dst_dt == src_dt) {
        if (dst != src)
            memmove(dst, src, n * dtype_size(dst_dt));
        return;
    }
    if (dtype_is_fp8(src_dt))
        pthread_once(&fp8_table_once, fp8_table_fill);
    for (size_t i = 0; i < n; i++)
        store_from_fp32(dst, dst_dt, i, load_as_fp32(src, src_dt, i));
}

/* Run one vectorised kernel over the whole array, or fall back to the portable loop when the path
 * has none for this pair. Kernels handle their own tails, so any n and any alignment is fine. */
static void convert_with_table(const struct dtype_simd_table *t, void *dst, enum dtype dst_dt,
                               const void *src, enum dtype src_dt, size_t n)
{
    dtype_simd_kernel_fn *k = NULL;
    if (src_dt == DT_FP32 && dst_dt == DT_FP16) k = t->fp32_to_fp16;
    if (src_dt == DT_FP16 && dst_dt == DT_FP32) k = t->fp16_to_fp32;
    if (src_dt == DT_FP32 && dst_dt == DT_BF16) k = t->fp32_to_bf16;
    if (src_dt == DT_BF16 && dst_dt == DT_FP32) k = t->bf16_to_fp32;
    if (src_dt == DT_FP16 && dst_dt == DT_BF16) k = t->fp16_to_bf16;
    if (src_dt == DT_BF16 && dst_dt == DT_FP16) k = t->bf16_to_fp16;
    if (k)
        k(dst, src, n);
    else
        dtype_convert_portable(dst, dst_dt, src, src_dt, n);
}

/* The chosen path is decided once per process: the CPU cannot change under us, and the environment
 * variable is documented as read at start-up. */
static const struct dtype_simd_table *chosen_table;
static pthread_once_t chosen_once = PTHREAD_ONCE_INIT;

static void choose_table(void)
{
    const char *portable = getenv("AMPTRAIN_DTYPE_PORTABLE");
    if (portable && portable[0] && strcmp(portable, "0") != 0) {
        chosen_table = NULL;
        return;
    }
    chosen_table = dtype_simd_best();
}

static const struct dtype_simd_table *current_table(void)
{
    pthread_once(&chosen_once, choose_table);
    return chosen_table;
}

void dtype_convert(void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n)
{
    const struct dtype_simd_table *t = current_table();
    if (n == 0 || dst_dt >= DT_COUNT || src_dt >= DT_COUNT)
        return;
    if (!t || dst_dt == src_dt)
        dtype_convert_portable(dst, dst_dt, src, src_dt, n);
    else
        convert_with_table(t, dst, dst_dt, src, src_dt, n);
}

int dtype_convert_via(const char *path, void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt,
                      size_t n)
{
    if (!path)
        return -1;
    if (strcmp(path, "portable") == 0) {
        dtype_convert_portable(dst, dst_dt, src, src_dt, n);
        return 0;
    }
    const struct dtype_simd_table *t = dtype_simd_find(path);
    if (!t)
        return -1;
    if (n == 0 || dst_dt >= DT_COUNT || src_dt >= DT_COUNT)
        return 0;
    if (dst_dt == src_dt)
        dtype_convert_portable(dst, dst_dt, src, src_dt, n);
    else
        convert_with_table(t, dst, dst_dt, src, src_dt, n);
    return 0;
}

const char *dtype_simd_path(void)
{
    const struct dtype_simd_table *t = current_table();
    return t ? t->name : "portable";
}

void double_to_text(double v, char *buf, size_t size)
{
    if (isnan(v) || isinf(v)) {
        snprintf(buf, size, "%s", isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
        return;
    }
    for (int prec = 9; prec <= 17; prec++) {
        snprintf(buf, size, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}
