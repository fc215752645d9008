/*
 * dtype.h — storage types and exact fp32 <-> fp16 / bf16 conversion.
 *
 * Every conversion rounds to nearest, ties to even, exactly as the GPU's __float2half_rn and
 * __float2bfloat16_rn do: values beyond a format's range become ±Inf, values below its normal range
 * become subnormals or ±0, NaN stays NaN (made quiet, sign and top payload bits kept where they fit).
 * NaN payloads follow x86: fp32 -> fp16 as F16C's vcvtps2ph (truncate, set the quiet bit), fp32 -> bf16
 * as (bits >> 16) | 0x0040, fp16 -> fp32 as vcvtph2ps (payload shifted, quiet bit set), bf16 -> fp32
 * exact. The GPU may give a different (canonical) NaN: across CPU and GPU only "NaN stays NaN" holds.
 * The portable scalar functions are the definition; the bulk functions may take a vectorised path
 * (F16C / AVX-512, chosen at run time; AMPTRAIN_DTYPE_PORTABLE=1 forces the portable path) that must agree
 * with them bit for bit.
 */
#ifndef AMP_DTYPE_H
#define AMP_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" { /* kernels/ (CUDA C++) includes this header */
#endif

/* The fp8 dtypes hold raw E4M3 / E5M2 codes (below); a tensor of them carries the per-tensor scale its codes were
 * cast with (tensor.h, scale_inv). dtype_convert between fp8 and the other dtypes is the unscaled cast (scale 1,
 * saturating): scaled casts are the backend's fp8_cast. */
enum dtype { DT_FP32 = 0, DT_FP16 = 1, DT_BF16 = 2, DT_FP8_E4M3 = 3, DT_FP8_E5M2 = 4, DT_COUNT };

size_t dtype_size(enum dtype dt);       /* bytes per element: 4, 2, 2, 1, 1 */
const char *dtype_name(enum dtype dt);  /* "fp32", "fp16", "bf16", "e4m3", "e5m2" */
static inline int dtype_is_fp8(enum dtype dt) { return dt == DT_FP8_E4M3 || dt == DT_FP8_E5M2; }

/* Portable scalar conversions (the reference). */
uint16_t fp16_from_fp32(float x);
float fp16_to_fp32(uint16_t h);
uint16_t bf16_from_fp32(float x);
static inline float bf16_to_fp32(uint16_t h) /* exact: bf16 is fp32's upper half (inline: kernels widen with it) */
{
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* fp8 (the OCP formats of NVIDIA's __nv_fp8_e4m3 / __nv_fp8_e5m2 and Transformer Engine):
 *   E4M3: bias 7, 3 mantissa bits, largest finite 448, no Inf; NaN is S.1111.111 (0x7F, 0xFF).
 *   E5M2: bias 15, 2 mantissa bits, largest finite 57344; Inf and NaN as IEEE (0x7C Inf, 0x7D-0x7F NaN).
 * From fp32: round to nearest, ties to even, with subnormals; a value whose rounding passes the largest finite
 * one becomes +-max with `saturate` (Transformer Engine's and torchao's casts, and Inf too), else NaN (E4M3,
 * sign kept) or +-Inf (E5M2). A NaN input gives 0x7F. These are the results of CUDA's __nv_cvt_float_to_fp8
 * (cuda_fp8.hpp) with __NV_SATFINITE or __NV_NOSAT, bit for bit (tests/test_dtype.c). To fp32: exact. */
enum fp8_format { FP8_E4M3, FP8_E5M2 };
uint8_t fp8_from_fp32(float x, enum fp8_format f, int saturate);
float fp8_to_fp32(uint8_t v, enum fp8_format f);
float fp8_max(enum fp8_format f); /* 448 or 57344 */

/* x rounded to `dt` and back to fp32 (identity for DT_FP32). */
float dtype_round(float x, enum dtype dt);

/* Bulk conversion of n elements between any two dtypes (same dtype: a copy). May use SIMD.
 * Any n and any alignment; dst and src must not overlap unless dst == src with the same dtype. */
void dtype_convert(void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n);

/* The shortest decimal text ("%.Ng", N in 9..17) that strtod reads back to exactly v: 2^30 prints as
 * 1073741824, 0.1 as 0.1; "nan", "inf", "-inf" for the rest. Logs and messages print values a user may
 * compare with it. */
void double_to_text(double v, char *buf, size_t size);

/* The same, forced through the portable scalar path (for tests and for AMPTRAIN_DTYPE_PORTABLE=1). */
void dtype_convert_portable(void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt, size_t n);

/* Which bulk path dtype_convert takes on this CPU: "portable", "f16c", "avx512", ... (for logs/tests). */
const char *dtype_simd_path(void);

/* The same as dtype_convert, but through the named path ("portable", "f16c" = F16C + AVX2,
 * "avx512" = AVX-512F), so tests and benchmarks can hold every path this CPU has to the portable one.
 * Returns 0, or -1 (converting nothing) when the name is unknown or this CPU lacks its instructions. */
int dtype_convert_via(const char *path, void *dst, enum dtype dst_dt, const void *src, enum dtype src_dt,
                      size_t n);

#ifdef __cplusplus
}
#endif

#endif
