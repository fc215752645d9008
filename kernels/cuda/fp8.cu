/*
 * fp8.cu — precision.mode fp8 on the GPU (lib/base/fp8.h, backend.h fp8_cast / fp8_update and the fp8 rules of gemm).
 *
 * Casts: a grid-stride amax (fmaxf, so NaN is ignored as on the CPU; an atomicMax on the bits of a non-negative
 * float orders like the float), the recipe's scale (lib/base/fp8.h, one thread), then the cast. Recipe current needs
 * the amax before the cast (two passes over x); the delayed recipe casts at the scale it already has and takes the
 * amax in the cast's own pass (one read of x), then folds it into the step's amax (the group's pending one, which
 * fp8_update files into the history row). The cast: x * scale rounded to nearest even with saturation
 * (__nv_cvt_float_to_fp8 with __NV_SATFINITE, which tests/test_dtype.c checks the CPU's fp8_from_fp32 against bit for
 * bit). The scale is read from device memory: nothing waits for the host.
 * The cast-transpose (fp8_cast_args.dst_t, Transformer Engine's): where a product reads the codes the other way
 * round, the same pass also writes them transposed, through 32 x 32 tiles in shared memory (cast_transpose_kernel:
 * src read once, both outputs written coalesced), with the same codes, amax and counts.
 * The delayed recipe's scale update after a step (fp8_update, update_kernel): every fp8 tensor of the model, the
 * forward's group and the backward's, in one launch of one thread per tensor, with no memset: each thread folds its
 * pending amax into the step's history row and zeroes it, sets its scale and scale_inv from the history, and clears
 * its own entry of the next step's row. The step (hence the row) is read from device memory, so a recorded CUDA
 * graph replays the one launch at every step. The arithmetic is lib/base/fp8.h's, the CPU's, bit for bit.
 *
 * Products: cuBLASLt FP8 matmuls on sm_89 and newer (compute 32F, our B's scale_inv as its A scale pointer and our
 * A's as its B scale pointer). Hopper's FP8 kernels take only the "TN" layout (cuBLASLt's A transposed, its B not),
 * i.e. in our row-major terms !trans_a and trans_b: the forward product (x W^T) is already so; dx (dy W) reads W's
 * transposed codes and dW (dy^T x) dy's and x's, which the casts made (gemm_args a_t, b_t: the linear layer's
 * weight cast once a step, its input's cast in training, its output gradient's cast); an operand without them is
 * transposed into scratch first. Where C is a fresh bf16 tensor (beta 0: the forward y = x W^T + b, with GELU where
 * it follows, and dx), cuBLASLt writes it itself: alpha * sa * sb * sum + the fp32 bias, rounded once to bf16, with
 * CUBLASLT_EPILOGUE_BIAS or GELU_AUX_BIAS (the pre-activation into aux), no scratch and no second pass
 * (fp8_product_into_c; cuBLASLt's order is the CPU's: sum, scale, bias, one rounding; its GELU's tanh may differ
 * by ulps, invisible but where a value lies on a bf16 rounding boundary). cublasLt.h gives a bf16 D's bias the
 * type bf16; ours is fp32, as the CPU adds it, so a heuristic without such a kernel or a call refusing it (the
 * plan remembers, and a note says so once) sends the product to the scratch path. Otherwise (beta != 0: a
 * gradient accumulated over micro-batches; an fp32 C, whose bits follow the CPU's order; the heuristic's refusal;
 * AMPTRAIN_FP8_CUBLASLT_EPILOGUE=0) D goes to an fp32 scratch, and one epilogue kernel adds beta * C, the fp32 bias
 * and the GELU, and rounds once into C: the CPU's order (sum, scale, bias, one rounding). cuBLASLt's amax of D
 * (CUBLASLT_MATMUL_DESC_AMAX_D_POINTER) is not used: cublasLt.h does not say it is computed for a bf16 D, and the
 * delayed recipe's next cast takes its amax in its own single pass anyway. Below sm_89 (with a warning, once),
 * and for shapes whose m, n or k is not a multiple of 16 (cuBLASLt's FP8 alignment), the codes are widened to
 * bf16 (exactly), multiplied by cuBLASLt in bf16 with FP32 accumulation, and the epilogue applies the scales: the
 * same values up to summation order. On the native path Hopper's FP8
 * tensor cores add the products in a narrower accumulator (about 22 bits, moved into fp32 every few 32-product
 * groups; fast accumulation is off, the most accurate setting), so an fp32 C differs from the CPU's exact-product
 * fp32 sums by more than summation order: about 1e-4 relative on the GPU test's operands by a reviewer's
 * simulation of that accumulator, and measured on the H200 (2026-12-04): 1.12e-4 (k = 128) and 8.9e-5 (k = 512,
 * tests/test_cuda_backend.c fp8_gemm_runs_native_on_fp8_tensor_cores).
 *
 * Recipe blockwise (backend.h fp8_block_cast and gemm_args a_blocks / b_blocks). The cast: one thread a tile
 * (fp8_block_scale: the codes and scales of kernels/cpu/fp8.c, bit for bit). The product, where it fits
 * (block_lt_unfit: sm_90 or newer, m and n multiples of 16, k of 128, not two 128x128 operands, not switched off by
 * AMPTRAIN_FP8_BLOCK_CUBLASLT=0): cuBLASLt's block-scaled matmul (block_product_lt; scale modes VEC128_32F for 1x128
 * tiles and BLK128x128_32F for blocks, compute 32F, fast accumulation off) into the fp32 scratch P, on TN operands
 * (fp8_tn_codes: an operand stored the other way transposed into scratch) with the scales copied into the layouts
 * cuBLASLt reads (block_scales_lt_kernel: 1x128 as (ceil(k / 128), outer) outer-contiguous, 128x128 as
 * (ceil(outer / 128), ceil(k / 128) rounded up to 4) k-contiguous, Transformer Engine's GEMM-ready layouts), then the
 * epilogue kernel above (alpha, bias, GELU, beta, one rounding). Its numbers are the tensor cores': each block's 128
 * products in the narrower accumulator above, then scaled and promoted into fp32 at every block (DeepSeek-V3's
 * promotion interval), so an element differs from the CPU's exact block sums by up to about
 * (2^-14 + (2 blocks + 4) 2^-24) sum |a b| (tests/test_cuda_backend.c block_lt_bound holds it to twice that).
 * Anywhere else, and where cuBLASLt's heuristic offers no algorithm or a call refuses the plan (the plan remembers;
 * a note says so once): the CPU's arithmetic in plain kernels, one thread an element of C (each 128-wide block's
 * exact sum in double rounded once to fp32, times the tiles' scale_inv, into an fp32 accumulator, blocks in order),
 * then the same epilogue kernel: the CPU's bits but for GELU's tanhf; correct, no tensor cores.
 */
#include "backend_cuda_internal.h"

#include <cmath>
#include <cstdio>
#include <cstring>

extern "C" {
#include "fp8.h" /* fp8_scale_from_amax, fp8_amax_fold, fp8_block_scale, the tilings: the recipes' arithmetic */
}

#define GRID_STRIDE(i, n)                                                                                      \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)(n);                            \
         i += (size_t)gridDim.x * blockDim.x)

__device__ __forceinline__ void atomic_max_nonneg(float *addr, float v)
{
    /* non-negative floats (and +Inf) order as their bits do */
    atomicMax(reinterpret_cast<unsigned int *>(addr), __float_as_uint(v));
}

__global__ void amax_kernel(float *amax, const void *x, int x_dt, size_t n)
{
    float m = 0.0f;
    GRID_STRIDE(i, n)
        m = fp8_amax_fold(m, load_elem(x, x_dt, i));
    for (int off = 16; off > 0; off >>= 1)
        m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
    if ((threadIdx.x & 31) == 0)
        atomic_max_nonneg(amax, m);
}

/* recipe current: the scale from this cast's amax; and the running amax of the delayed recipe */
__global__ void cast_scale_kernel(float *scale, float *scale_inv, const float *now, float *amax, float fmax, int margin,
                                  bool current)
{
    if (current) {
        *scale = fp8_scale_from_amax(*now, fmax, margin, *scale, true);
        *scale_inv = 1.0f / *scale;
    }
    if (amax)
        *amax = fp8_amax_fold(*amax, *now);
}

/* The end of a cast kernel: each warp's max |src| into *amax (where wanted) and its counts (fp8_cast_args.counts)
 * into counts[0..2], added by the warp's lane 0 (`lane0`, whole warps of 32 threads); `first`, one thread of the
 * grid, adds the n elements cast to counts[3]. Every thread of a warp calls it. */
__device__ void cast_flush(float m, float *amax, unsigned long long sat, unsigned long long flushed,
                           unsigned long long nonzero, int64_t *counts, bool lane0, bool first, size_t n)
{
    if (amax) {
        for (int off = 16; off > 0; off >>= 1)
            m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
        if (lane0)
            atomic_max_nonneg(amax, m);
    }
    if (!counts)
        return;
    for (int off = 16; off > 0; off >>= 1) {
        sat += __shfl_down_sync(0xffffffffu, sat, off);
        flushed += __shfl_down_sync(0xffffffffu, flushed, off);
        nonzero += __shfl_down_sync(0xffffffffu, nonzero, off);
    }
    if (lane0) {
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[0]), sat);
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[1]), flushed);
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[2]), nonzero);
    }
    if (first)
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[3]), (unsigned long long)n);
}

/* The cast at *scale; with `amax` (the delayed recipe, whose scale is known before the cast) it also folds max |src|
 * into *amax in the same pass (a zeroed scratch float: cast_scale_kernel folds it into the history afterwards). */
__global__ void cast_kernel(void *dst, int dst_dt, const void *src, int src_dt, const float *scale, size_t n,
                            int64_t *counts, float *amax)
{
    const float s = *scale;
    const __nv_fp8_interpretation_t fi = dst_dt == DT_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
    unsigned long long sat = 0, flushed = 0, nonzero = 0;
    float m = 0.0f;
    GRID_STRIDE(i, n)
    {
        float v = load_elem(src, src_dt, i);
        m = fp8_amax_fold(m, v);
        store_elem(dst, dst_dt, i, v * s);
        if (counts && v != 0.0f && !isnan(v)) {
            nonzero++;
            unsigned raw = __nv_cvt_float_to_fp8(v * s, __NV_NOSAT, fi) & 0x7Fu;
            sat += dst_dt == DT_FP8_E4M3 ? raw == 0x7Fu : raw >= 0x7Cu;
            flushed += (__nv_cvt_float_to_fp8(v * s, __NV_SATFINITE, fi) & 0x7Fu) == 0;
        }
    }
    cast_flush(m, amax, sat, flushed, nonzero, counts, (threadIdx.x & 31) == 0, blockIdx.x == 0 && threadIdx.x == 0, n);
}

/* The transposing half of a 32 x 32 tile's trip through shared memory (cast_transpose_kernel, transpose_u8_kernel):
 * the tile of rows r0.., columns c0.. of a (rows, cols) matrix, read as tile[row - r0][col - c0], written into dst
 * (cols, rows) a row of dst per threadIdx.y step, threadIdx.x along it (coalesced). Between two __syncthreads. */
__device__ void tile_store_transposed(uint8_t *dst, const uint8_t (*tile)[33], int64_t r0, int64_t c0, int64_t rows,
                                      int64_t cols)
{
    const int64_t r = r0 + threadIdx.x;
    for (int j = threadIdx.y; j < 32; j += blockDim.y)
        if (c0 + j < cols && r < rows)
            dst[(c0 + j) * rows + r] = tile[threadIdx.x][j];
}

/* The cast-transpose (backend.h fp8_cast_args.dst_t; Transformer Engine's): src (rows, cols) cast at *scale into dst
 * (rows, cols) and, through a 32 x 32 tile of codes in shared memory, into dst_t (cols, rows). A block of 32 x 8
 * threads reads a tile's rows once (a warp a row: coalesced), writes dst's rows, then dst_t's rows (the tile's
 * columns, coalesced too); row tiles are strided over gridDim.y (at most 65535). The codes, amax and counts are
 * cast_kernel's, element by element: store_elem's conversion, the same folds. */
__global__ void cast_transpose_kernel(uint8_t *dst, uint8_t *dst_t, int dst_dt, const void *src, int src_dt,
                                      const float *scale, int64_t rows, int64_t cols, int64_t *counts, float *amax)
{
    __shared__ uint8_t tile[32][33];
    const float s = *scale;
    const __nv_fp8_interpretation_t fi = dst_dt == DT_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2;
    unsigned long long sat = 0, flushed = 0, nonzero = 0;
    float m = 0.0f;
    const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x, c0 = (int64_t)blockIdx.x * 32;
    for (int64_t r0 = (int64_t)blockIdx.y * 32; r0 < rows; r0 += (int64_t)gridDim.y * 32) { /* uniform per block */
        for (int j = threadIdx.y; j < 32; j += blockDim.y) {
            if (r0 + j >= rows || c >= cols)
                continue;
            const size_t i = (size_t)((r0 + j) * cols + c);
            const float v = load_elem(src, src_dt, i);
            m = fp8_amax_fold(m, v);
            const uint8_t code = __nv_cvt_float_to_fp8(v * s, __NV_SATFINITE, fi); /* store_elem's conversion */
            dst[i] = code;
            tile[j][threadIdx.x] = code;
            if (counts && v != 0.0f && !isnan(v)) {
                nonzero++;
                unsigned raw = __nv_cvt_float_to_fp8(v * s, __NV_NOSAT, fi) & 0x7Fu;
                sat += dst_dt == DT_FP8_E4M3 ? raw == 0x7Fu : raw >= 0x7Cu;
                flushed += (code & 0x7Fu) == 0;
            }
        }
        __syncthreads();
        tile_store_transposed(dst_t, tile, r0, c0, rows, cols);
        __syncthreads(); /* the tile is read before the next row block writes it */
    }
    cast_flush(m, amax, sat, flushed, nonzero, counts, threadIdx.x == 0,
               blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0, (size_t)(rows * cols));
}

/* 32 x 32 tiles: one block a column of tiles' width, row tiles strided over at most 65535 blocks */
static void launch_cast_transpose(struct cuda_backend *cb, const struct fp8_cast_args *a, float *fold)
{
    const int64_t row_blocks = (a->rows + 31) / 32;
    dim3 block(32, 8), grid((unsigned)((a->cols + 31) / 32), (unsigned)(row_blocks < 65535 ? row_blocks : 65535));
    cast_transpose_kernel<<<grid, block, 0, cb->stream>>>(
        static_cast<uint8_t *>(a->dst->data), static_cast<uint8_t *>(a->dst_t->data), a->dst->dtype, a->src->data,
        a->src->dtype, a->scale, a->rows, a->cols, a->counts, fold);
    CB_LAUNCHED(cb, "cast_transpose_kernel");
}

void cuda_fp8_cast(struct backend *be, const struct fp8_cast_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    const struct tensor *src = a->src;
    struct tensor *dst = a->dst;
    if (!dtype_is_fp8(dst->dtype) || dtype_is_fp8(src->dtype) || dst->numel != src->numel) {
        cuda_record(cb, "this is a bug in the caller (see fp8_cast_args in lib/base/backend.h)",
                    "fp8_cast: %s (%zu) from %s (%zu)", dtype_name(dst->dtype), dst->numel, dtype_name(src->dtype),
                    src->numel);
        return;
    }
    if (a->dst_t && (a->dst_t->dtype != dst->dtype || a->rows < 0 || a->cols < 0 ||
                     (size_t)(a->rows * a->cols) != dst->numel || a->dst_t->numel != dst->numel)) {
        cuda_record(cb, "this is a bug in the caller (see fp8_cast_args.dst_t in lib/base/backend.h)",
                    "fp8_cast: transposed codes %s (%zu) of a (%lld, %lld) %s cast of %zu elements",
                    dtype_name(a->dst_t->dtype), a->dst_t->numel, (long long)a->rows, (long long)a->cols,
                    dtype_name(dst->dtype), dst->numel);
        return;
    }
    size_t n = src->numel;
    float fmax = dst->dtype == DT_FP8_E4M3 ? 448.0f : 57344.0f;
    float *now = NULL;
    if (a->current || a->amax) {
        now = static_cast<float *>(cuda_scratch(cb, CSCR_FP8_AMAX, sizeof(float)));
        if (!now)
            return;
        if (!CB_CUDA(cb, cudaMemsetAsync(now, 0, sizeof(float), cb->stream)))
            return;
    }
    if (a->current) { /* the scale needs the whole tensor's amax first: a pass of its own */
        if (n)
            amax_kernel<<<grid_for(n), kThreads, 0, cb->stream>>>(now, src->data, src->dtype, n);
        cast_scale_kernel<<<1, 1, 0, cb->stream>>>(a->scale, a->scale_inv, now, a->amax, fmax, a->margin, true);
        CB_LAUNCHED(cb, "amax_kernel / cast_scale_kernel");
    }
    if (n) { /* delayed: the amax is taken by the cast's own pass over src */
        float *fold = a->amax && !a->current ? now : NULL;
        if (a->dst_t) {
            launch_cast_transpose(cb, a, fold);
        } else {
            cast_kernel<<<grid_for(n), kThreads, 0, cb->stream>>>(dst->data, dst->dtype, src->data, src->dtype,
                                                                  a->scale, n, a->counts, fold);
            CB_LAUNCHED(cb, "cast_kernel");
        }
    }
    if (a->amax && !a->current) {
        cast_scale_kernel<<<1, 1, 0, cb->stream>>>(a->scale, a->scale_inv, now, a->amax, fmax, a->margin, false);
        CB_LAUNCHED(cb, "cast_scale_kernel");
    }
}

/* One launch for every group: one thread per tensor, the groups' tensors numbered one after another (thread t is
 * tensor t - first of the group it falls in), so each thread owns one column of one group's history. It folds the
 * pending amax into the row (the row read from device memory where step is set: backend.h fp8_update_args), takes the
 * history's amax, the scale and its reciprocal, then clears its column of the next step's row. The arguments come by
 * value: a recorded graph keeps them, and reads the step from memory at every replay. */
__global__ void update_kernel(struct fp8_update_args a)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x, k = 0;
    while (k < a.ngroups && i >= a.groups[k].n)
        i -= a.groups[k++].n;
    if (k >= a.ngroups)
        return;
    const struct fp8_update_group &g = a.groups[k];
    const int n = g.n, len = a.len, row = a.step ? (int)(*a.step % len) : a.row;
    if (g.pending) {
        float *h = &g.history[(size_t)row * (size_t)n + (size_t)i];
        *h = fmaxf(*h, g.pending[i]);
        g.pending[i] = 0.0f;
    }
    float amax = fp8_history_amax(g.history, n, len, row, i, a.most_recent);
    g.scale[i] = fp8_scale_from_amax(amax, g.fmax, a.margin, g.scale[i], false);
    g.scale_inv[i] = 1.0f / g.scale[i];
    g.history[(size_t)((row + 1) % len) * (size_t)n + (size_t)i] = 0.0f; /* this thread's column only */
}

void cuda_fp8_update(struct backend *be, const struct fp8_update_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->ngroups < 1 || a->ngroups > FP8_UPDATE_MAX_GROUPS || a->len < 1 ||
        (!a->step && (a->row < 0 || a->row >= a->len)))
        return;
    int64_t tensors = 0;
    for (int k = 0; k < a->ngroups; k++) {
        if (a->groups[k].n < 1)
            return;
        tensors += a->groups[k].n;
    }
    update_kernel<<<(unsigned)((tensors + 127) / 128), 128, 0, cb->stream>>>(*a);
    CB_LAUNCHED(cb, "update_kernel");
}

/* ---- products ----------------------------------------------------------------------------------- */

/* dst (cols, rows) = src (rows, cols)^T, one byte per element; blocks of 32 x 32, the row blocks strided over
 * gridDim.y (at most 65535: dW's rows are the micro-batch's tokens, which may be more than 2 Mi) */
__global__ void transpose_u8_kernel(uint8_t *dst, const uint8_t *src, int64_t rows, int64_t cols)
{
    __shared__ uint8_t tile[32][33];
    const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x, c0 = (int64_t)blockIdx.x * 32;
    for (int64_t r0 = (int64_t)blockIdx.y * 32; r0 < rows; r0 += (int64_t)gridDim.y * 32) { /* uniform per block */
        for (int j = threadIdx.y; j < 32; j += blockDim.y)
            if (r0 + j < rows && c < cols)
                tile[j][threadIdx.x] = src[(r0 + j) * cols + c];
        __syncthreads();
        tile_store_transposed(dst, tile, r0, c0, rows, cols);
        __syncthreads(); /* the tile is read before the next row block writes it */
    }
}

static const void *transposed(struct cuda_backend *cb, enum cuda_scratch_slot slot, const void *src, int64_t rows,
                              int64_t cols)
{
    uint8_t *dst = static_cast<uint8_t *>(cuda_scratch(cb, slot, (size_t)(rows * cols)));
    if (!dst || rows == 0 || cols == 0) /* an empty operand (k = 0): nothing to move, and a grid of 0 blocks is
                                         * an invalid launch */
        return dst;
    const int64_t row_blocks = (rows + 31) / 32;
    dim3 block(32, 8), grid((unsigned)((cols + 31) / 32), (unsigned)(row_blocks < 65535 ? row_blocks : 65535));
    transpose_u8_kernel<<<grid, block, 0, cb->stream>>>(dst, static_cast<const uint8_t *>(src), rows, cols);
    CB_LAUNCHED(cb, "transpose_u8_kernel");
    return dst;
}

__global__ void widen_kernel(__nv_bfloat16 *dst, const void *src, int src_dt, size_t n)
{
    GRID_STRIDE(i, n)
        dst[i] = __float2bfloat16_rn(load_elem(src, src_dt, i)); /* exact: every fp8 value is a bf16 value */
}

static const void *widened(struct cuda_backend *cb, enum cuda_scratch_slot slot, const void *src, enum dtype dt,
                           size_t n)
{
    __nv_bfloat16 *dst = static_cast<__nv_bfloat16 *>(cuda_scratch(cb, slot, n * sizeof(__nv_bfloat16)));
    if (!dst)
        return NULL;
    widen_kernel<<<grid_for(n), kThreads, 0, cb->stream>>>(dst, src, dt, n);
    CB_LAUNCHED(cb, "widen_kernel");
    return dst;
}

/* C = round(f * P + bias [+ beta * C]) or, with aux, aux = round(pre) and C = round(gelu_tanh(pre)), where
 * f = alpha (* sa * sb when the product did not apply them) and pre = f * P + bias. */
__global__ void fp8_epilogue_kernel(void *c, int c_dt, void *aux, const float *p, const float *bias, float alpha,
                                    const float *sa, const float *sb, float beta, int64_t m, int64_t n)
{
    float f = alpha;
    if (sa)
        f = f * *sa * *sb;
    GRID_STRIDE(i, (size_t)(m * n))
    {
        float v = f * p[i];
        if (bias)
            v += bias[i % (size_t)n];
        if (aux) {
            store_elem(aux, c_dt, i, v);
            float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
            v = 0.5f * v * (1.0f + tanhf(u));
        } else if (beta != 0.0f) {
            v = beta * load_elem(c, c_dt, i) + v;
        }
        store_elem(c, c_dt, i, v);
    }
}

__global__ void copy_scales_kernel(float *dst, const float *sa, const float *sb)
{
    dst[0] = *sa;
    dst[4] = *sb;
}

/* A's and B's scale_inv for cuBLASLt's scale pointers, at 16-byte-aligned addresses: lib/base/fp8.c keeps a layer's
 * scales side by side, 4 bytes apart, and on the H200 (cuBLASLt 130100, 2026-12-04) cublasLtMatmul refused every
 * native product of the backend, whose scale pointers were such, while it accepted the same product with
 * 256-byte-aligned scales in scripts/gpu/fp8_probe.cu: the one difference found between the two, so copied here
 * (one 1-thread kernel, only where a pointer is not aligned). Confirmed on the H200 (2026-12-04, 55f85b4):
 * fp8_probe's product with scales 4 bytes past a 16-byte boundary was refused by all 8 algorithms offered, the
 * same with aligned scales accepted, and the backend's products then ran natively (tests/test_cuda_backend.c,
 * fp8_gemm_runs_native_on_fp8_tensor_cores, checks it). false where the copy could not start. */
static bool fp8_aligned_scales(struct cuda_backend *cb, const struct gemm_args *g, const float **sa, const float **sb)
{
    *sa = g->a->scale_inv;
    *sb = g->b->scale_inv;
    if ((((uintptr_t)*sa | (uintptr_t)*sb) & 15u) == 0)
        return true;
    float *dst = static_cast<float *>(cuda_scratch(cb, CSCR_FP8_SCALES, 8 * sizeof(float)));
    if (!dst)
        return false;
    copy_scales_kernel<<<1, 1, 0, cb->stream>>>(dst, *sa, *sb);
    CB_LAUNCHED(cb, "copy_scales_kernel");
    *sa = dst;
    *sb = dst + 4;
    return true;
}

/* mm's operands for a native product: TN, A (m, k) row-major untransposed, B (n, k) row-major, i.e. trans_b. An
 * operand stored the other way is read from its transposed codes where the caller has them (gemm_args a_t, b_t: the
 * cast made them), else transposed into scratch. false where nothing may run (an error recorded). */
static bool fp8_tn_codes(struct cuda_backend *cb, const struct gemm_args *g, struct lt_matmul *mm)
{
    const int64_t m = g->m, n = g->n, k = g->k;
    mm->a = !g->trans_a ? g->a->data : g->a_t ? g->a_t->data : transposed(cb, CSCR_FP8_A, g->a->data, k, m);
    mm->b = g->trans_b ? g->b->data : g->b_t ? g->b_t->data : transposed(cb, CSCR_FP8_B, g->b->data, k, n);
    mm->ab_dt = g->a->dtype;
    mm->b_dt = g->b->dtype;
    mm->trans_a = false;
    mm->trans_b = true;
    mm->lda = k;
    mm->ldb = k;
    return mm->a && mm->b;
}

static bool fp8_native_operands(struct cuda_backend *cb, const struct gemm_args *g, struct lt_matmul *mm)
{
    return fp8_tn_codes(cb, g, mm) && fp8_aligned_scales(cb, g, &mm->a_scale, &mm->b_scale);
}

/* mm's output and shape for g's product: C (m, n) at c in c_dt, row stride n, alpha, beta 0, one matrix. */
static void lt_output(struct lt_matmul *mm, const struct gemm_args *g, void *c, enum dtype c_dt, float alpha)
{
    mm->c = c;
    mm->c_dt = c_dt;
    mm->m = g->m;
    mm->n = g->n;
    mm->k = g->k;
    mm->ldc = g->n;
    mm->alpha = alpha;
    mm->beta = 0.0f;
    mm->batch = 1;
}

/* P (m, n, fp32) = A B of g's fp8 operands: natively (cuBLASLt's fp8 kernels, TN, the scales applied by the
 * product), or widened to bf16 with FP32 accumulation (the scales left to the epilogue). false where nothing ran
 * (an error recorded). */
static bool fp8_product(struct cuda_backend *cb, const struct gemm_args *g, float *p, bool native)
{
    int64_t m = g->m, n = g->n, k = g->k;
    enum dtype da = g->a->dtype, db = g->b->dtype;
    struct lt_matmul mm;
    memset(&mm, 0, sizeof mm);
    lt_output(&mm, g, p, DT_FP32, 1.0f);
    if (native) {
        if (!fp8_native_operands(cb, g, &mm))
            return false;
    } else {
        mm.a = widened(cb, CSCR_FP8_A, g->a->data, da, (size_t)(m * k));
        mm.b = widened(cb, CSCR_FP8_B, g->b->data, db, (size_t)(k * n));
        mm.ab_dt = DT_BF16;
        mm.trans_a = g->trans_a;
        mm.trans_b = g->trans_b;
        mm.lda = g->trans_a ? m : k;
        mm.ldb = g->trans_b ? k : n;
    }
    if (!mm.a || !mm.b)
        return false;
    if (k > 0)
        cuda_lt_matmul(cb, &mm);
    else if (!CB_CUDA(cb, cudaMemsetAsync(p, 0, (size_t)(m * n) * sizeof(float), cb->stream)))
        return false;
    return true;
}

/* A native product whose C is a fresh bf16 tensor (beta 0): cuBLASLt writes C itself, alpha * sa * sb * sum + the
 * fp32 bias (and GELU, its pre-activation into aux) rounded once, in its epilogue: no fp32 scratch and no epilogue
 * kernel. true where that ran (or an error was recorded); false where cuBLASLt offers no such kernel or refused it
 * (cuda_lt_matmul_fused: the plan remembers), and the caller takes the scratch path. */
static bool fp8_product_into_c(struct cuda_backend *cb, const struct gemm_args *g)
{
    struct lt_matmul mm;
    memset(&mm, 0, sizeof mm);
    if (!fp8_native_operands(cb, g, &mm))
        return true;
    lt_output(&mm, g, g->c->data, g->c->dtype, g->alpha);
    mm.bias = g->bias ? static_cast<const float *>(g->bias->data) : NULL;
    mm.aux = g->epilogue == GEMM_EPI_GELU_TANH ? g->aux->data : NULL;
    return cuda_lt_matmul_fused(cb, &mm);
}

static void cuda_gemm_fp8_blocks(struct cuda_backend *cb, const struct gemm_args *g);

void cuda_gemm_fp8(struct cuda_backend *cb, const struct gemm_args *g)
{
    if (g->a_blocks.scale_inv || g->b_blocks.scale_inv) { /* recipe blockwise */
        cuda_gemm_fp8_blocks(cb, g);
        return;
    }
    enum dtype da = g->a->dtype, db = g->b->dtype, dc = g->c->dtype;
    bool ok = dtype_is_fp8(da) && dtype_is_fp8(db) && !(da == DT_FP8_E5M2 && db == DT_FP8_E5M2) &&
              (dc == DT_FP32 || dc == DT_BF16) && g->batch == 1 && g->a->scale_inv && g->b->scale_inv &&
              (!g->bias || (g->bias->dtype == DT_FP32 && g->beta == 0.0f)) &&
              (!g->a_t || (g->a_t->dtype == da && g->a_t->numel == g->a->numel)) &&
              (!g->b_t || (g->b_t->dtype == db && g->b_t->numel == g->b->numel));
    if (!ok) {
        cuda_record(cb, "this is a bug in the caller (see the fp8 rules of gemm_args in lib/base/backend.h)",
                    "gemm: unsupported fp8 product A %s, B %s, C %s (batch %lld, scales %s)", dtype_name(da),
                    dtype_name(db), dtype_name(dc), (long long)g->batch,
                    g->a->scale_inv && g->b->scale_inv ? "set" : "missing");
        return;
    }
    int64_t m = g->m, n = g->n, k = g->k;
    if (m <= 0 || n <= 0)
        return;
    /* cuBLASLt's FP8 kernels want 16-byte multiples for every dimension (leading dimensions included); a
     * product cuBLASLt refused once (cb->fp8_refused, the warning printed by plan_refused) is not asked again */
    bool native = cb->cc >= 89 && !cb->fp8_refused && m % 16 == 0 && n % 16 == 0 && k % 16 == 0;
    if (native && dc == DT_BF16 && g->beta == 0.0f && k > 0 && !cb->fp8_epilogue_off) {
        if (fp8_product_into_c(cb, g))
            return;
        if (!cb->fp8_refused && !cb->fp8_epilogue_noted) {
            fprintf(stderr, "ampTrain: note: %s: cuBLASLt does not write an fp8 product's bf16 C with its epilogue here "
                            "(m=%lld n=%lld k=%lld, %s%s): such products go through an fp32 scratch and an epilogue "
                            "kernel, the same values, slower\n",
                    cb->name, (long long)m, (long long)n, (long long)k, g->bias ? "fp32 bias" : "no bias",
                    g->epilogue == GEMM_EPI_GELU_TANH ? ", GELU" : "");
            cb->fp8_epilogue_noted = true;
        }
    }
    native = native && !cb->fp8_refused; /* (fp8_product_into_c may have met the refusal) */
    float *p = static_cast<float *>(cuda_scratch(cb, CSCR_FP8_P, (size_t)(m * n) * sizeof(float)));
    if (!p)
        return;
    if (!native && !cb->fp8_warned && cb->cc < 89) {
        fprintf(stderr, "ampTrain: warning: %s (compute capability %d.%d) has no fp8 matrix products (sm_89 or newer): "
                        "they are emulated in bf16 with FP32 accumulation, the same values, without fp8's speed\n",
                cb->name, cb->cc / 10, cb->cc % 10);
        cb->fp8_warned = true;
    }
    if (!fp8_product(cb, g, p, native))
        return;
    if (native && cb->fp8_refused) { /* refused at this call: nothing ran, so the same product emulated */
        native = false;
        if (!fp8_product(cb, g, p, false))
            return;
    }
    fp8_epilogue_kernel<<<grid_for((size_t)(m * n)), kThreads, 0, cb->stream>>>(
        g->c->data, dc, g->epilogue == GEMM_EPI_GELU_TANH ? g->aux->data : NULL, p,
        g->bias ? static_cast<const float *>(g->bias->data) : NULL, g->alpha, native ? NULL : g->a->scale_inv,
        native ? NULL : g->b->scale_inv, g->beta, m, n);
    CB_LAUNCHED(cb, "fp8_epilogue_kernel");
}

/* ---- recipe blockwise ---------------------------------------------------------------------------------- */

/* One thread a tile of the (rows, cols) matrix (lib/base/fp8.h, enum fp8_tiling): its amax (fmaxf: NaN ignored),
 * its power-of-two scale, the codes and scale_inv; the counts as cast_kernel's, at each tile's scale. */
__global__ void block_cast_kernel(void *dst, const void *src, int src_dt, int64_t rows, int64_t cols, int tiling,
                                  float *scale_inv, int64_t *counts)
{
    const int64_t tr = tiling == FP8_TILES_ROWS ? 1 : FP8_BLOCK, tc = tiling == FP8_TILES_COLS ? 1 : FP8_BLOCK;
    const int64_t col_tiles = (cols + tc - 1) / tc, tiles = (rows + tr - 1) / tr * col_tiles;
    unsigned long long sat = 0, flushed = 0, nonzero = 0;
    GRID_STRIDE(t, (size_t)tiles)
    {
        const int64_t r0 = (int64_t)t / col_tiles * tr, c0 = (int64_t)t % col_tiles * tc;
        const int64_t r1 = r0 + tr < rows ? r0 + tr : rows, c1 = c0 + tc < cols ? c0 + tc : cols;
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; r++)
            for (int64_t c = c0; c < c1; c++)
                amax = fp8_amax_fold(amax, load_elem(src, src_dt, (size_t)(r * cols + c)));
        const float scale = fp8_block_scale(amax);
        for (int64_t r = r0; r < r1; r++)
            for (int64_t c = c0; c < c1; c++) {
                const size_t i = (size_t)(r * cols + c);
                const float v = load_elem(src, src_dt, i);
                store_elem(dst, DT_FP8_E4M3, i, v * scale);
                if (counts && v != 0.0f && !isnan(v)) {
                    nonzero++;
                    sat += (__nv_cvt_float_to_fp8(v * scale, __NV_NOSAT, __NV_E4M3) & 0x7Fu) == 0x7Fu;
                    flushed += (__nv_cvt_float_to_fp8(v * scale, __NV_SATFINITE, __NV_E4M3) & 0x7Fu) == 0;
                }
            }
        scale_inv[fp8_tiling_index((enum fp8_tiling)tiling, cols, r0, c0)] = 1.0f / scale;
    }
    if (!counts)
        return;
    if (sat)
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[0]), sat);
    if (flushed)
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[1]), flushed);
    if (nonzero)
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[2]), nonzero);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        atomicAdd(reinterpret_cast<unsigned long long *>(&counts[3]), (unsigned long long)(rows * cols));
}

void cuda_fp8_block_cast(struct backend *be, const struct fp8_block_cast_args *a)
{
    struct cuda_backend *cb = cuda_of(be);
    if (a->dst->dtype != DT_FP8_E4M3 || dtype_is_fp8(a->src->dtype) || (int64_t)a->dst->numel < a->rows * a->cols ||
        (int64_t)a->src->numel < a->rows * a->cols) {
        cuda_record(cb, "this is a bug in the caller (see fp8_block_cast_args in lib/base/backend.h)",
                    "fp8_block_cast: %s (%zu) from %s (%zu) as (%lld, %lld)", dtype_name(a->dst->dtype), a->dst->numel,
                    dtype_name(a->src->dtype), a->src->numel, (long long)a->rows, (long long)a->cols);
        return;
    }
    const int64_t tiles = fp8_tiling_scales(a->tiling, a->rows, a->cols);
    if (tiles <= 0)
        return;
    block_cast_kernel<<<grid_for((size_t)tiles), kThreads, 0, cb->stream>>>(
        a->dst->data, a->src->data, a->src->dtype, a->rows, a->cols, a->tiling, a->scale_inv, a->counts);
    CB_LAUNCHED(cb, "block_cast_kernel");
}

/* The stored position of op(X)'s element (outer, kk) and its tile scale's index: X is (outer, k) row-major, or
 * (k, outer) when k_rows (K is its stored rows). */
__device__ __forceinline__ size_t block_at(bool k_rows, int64_t outer_n, int64_t k, int64_t outer, int64_t kk)
{
    return (size_t)(k_rows ? kk * outer_n + outer : outer * k + kk);
}

__device__ __forceinline__ float block_scale_of(const float *inv, int tiling, bool k_rows, int64_t outer_n, int64_t k,
                                                int64_t outer, int64_t kk)
{
    const int64_t cols = k_rows ? outer_n : k, r = k_rows ? kk : outer, c = k_rows ? outer : kk;
    return inv[fp8_tiling_index((enum fp8_tiling)tiling, cols, r, c)];
}

/* P (m, n) fp32: one thread an element, the CPU's arithmetic (kernels/cpu/fp8.c, cpu_gemm_blockwise) without alpha,
 * which the epilogue applies. A's K is its stored rows when trans_a; B's when !trans_b. */
__global__ void block_product_kernel(float *p, const void *a, const void *b, bool ta, bool tb, int64_t m, int64_t n,
                                     int64_t k, const float *sa, int a_tiling, const float *sb, int b_tiling)
{
    GRID_STRIDE(e, (size_t)(m * n))
    {
        const int64_t i = (int64_t)e / n, j = (int64_t)e % n;
        float acc = 0.0f;
        for (int64_t k0 = 0; k0 < k; k0 += FP8_BLOCK) {
            const int64_t k1 = k0 + FP8_BLOCK < k ? k0 + FP8_BLOCK : k;
            double s = 0.0; /* exact: products of E4M3 values are multiples of 2^-18 below 2^18 */
            for (int64_t kk = k0; kk < k1; kk++)
                s += (double)(load_elem(a, DT_FP8_E4M3, block_at(ta, m, k, i, kk)) *
                              load_elem(b, DT_FP8_E4M3, block_at(!tb, n, k, j, kk)));
            const float f = block_scale_of(sa, a_tiling, ta, m, k, i, k0) * block_scale_of(sb, b_tiling, !tb, n, k, j, k0);
            acc += (float)s * f;
        }
        p[e] = acc;
    }
}

/* One operand's tile scales in the layout cuBLASLt's block-scaled matmul reads, from the layout the cast wrote
 * (block_scale_of: X's scales, X (outer_n, k) or, when k_rows, stored (k, outer_n)), into dst:
 *   VEC128_32F (1x128 tiles):   (ceil(k / 128), outer_n), outer_n contiguous: dst[kb * outer_n + i];
 *   BLK128x128_32F (blocks):    (ceil(outer_n / 128), ld), ld = ceil(k / 128) rounded up to 4 (16 bytes), K
 *                               contiguous: dst[ob * ld + kb]; the padding gets 1.
 * A copy, no arithmetic: the scales are the cast's bits. */
__global__ void block_scales_lt_kernel(float *dst, const float *inv, int tiling, bool k_rows, int64_t outer_n, int64_t k,
                                       bool blk, int64_t ld)
{
    const int64_t kt = fp8_tiles(k), n = blk ? fp8_tiles(outer_n) * ld : kt * outer_n;
    GRID_STRIDE(e, (size_t)n)
    {
        const int64_t row = (int64_t)e / (blk ? ld : outer_n), col = (int64_t)e % (blk ? ld : outer_n);
        if (blk)
            dst[e] = col < kt ? block_scale_of(inv, tiling, k_rows, outer_n, k, row * FP8_BLOCK, col * FP8_BLOCK) : 1.0f;
        else
            dst[e] = block_scale_of(inv, tiling, k_rows, outer_n, k, col, row * FP8_BLOCK);
    }
}

/* X's scales for cuBLASLt in scratch `slot`; its scale mode in *mode. NULL where nothing may run (an error
 * recorded). */
static const float *block_scales_lt(struct cuda_backend *cb, enum cuda_scratch_slot slot, const struct fp8_blocks *x,
                                    bool k_rows, int64_t outer_n, int64_t k, int32_t *mode)
{
    const bool blk = x->tiling == FP8_BLOCKS;
    const int64_t ld = blk ? (fp8_tiles(k) + 3) / 4 * 4 : outer_n, n = blk ? fp8_tiles(outer_n) * ld : fp8_tiles(k) * ld;
    float *dst = static_cast<float *>(cuda_scratch(cb, slot, (size_t)n * sizeof(float)));
    if (!dst)
        return NULL;
    block_scales_lt_kernel<<<grid_for((size_t)n), kThreads, 0, cb->stream>>>(dst, x->scale_inv, x->tiling, k_rows,
                                                                             outer_n, k, blk, ld);
    CB_LAUNCHED(cb, "block_scales_lt_kernel");
    *mode = blk ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    return dst;
}

/* Why g's product does not go to cuBLASLt's block-scaled matmul (NULL: it may): Hopper's block scaling (sm_90,
 * CUDA 12.9 and later), not switched off, both operands' codes 16-byte aligned along K and the outer sides too
 * (cuBLASLt's fp8 rule), whole 128-wide blocks of K (a partial last block is the plain kernels'), and at most one
 * operand in 128x128 blocks (cuBLASLt takes 1x128 by 1x128, 1x128 by 128x128 and 128x128 by 1x128). */
static const char *block_lt_unfit(const struct cuda_backend *cb, const struct gemm_args *g)
{
    if (cb->fp8_block_lt_off)
        return "AMPTRAIN_FP8_BLOCK_CUBLASLT=0";
    if (cb->cc < 90)
        return "cuBLASLt's block-scaled fp8 products need sm_90 or newer";
    if (g->m % 16 != 0 || g->n % 16 != 0 || g->k % FP8_BLOCK != 0 || g->k == 0)
        return "its shape: cuBLASLt's block-scaled path takes m and n multiples of 16 and k a multiple of 128";
    if (g->a_blocks.tiling == FP8_BLOCKS && g->b_blocks.tiling == FP8_BLOCKS)
        return "two operands in 128x128 blocks";
    return NULL;
}

/* P (m, n) fp32 = the block-scaled sum through cuBLASLt (compute 32F, fast accumulation off): TN codes (fp8_tn_codes:
 * transposed into scratch where an operand is stored the other way), the scales in cuBLASLt's layout. 1 where it
 * ran or an error was recorded (the backend's status says which), 0 where cuBLASLt offers no algorithm or refused
 * it (nothing written), -1 where nothing could start (an error recorded). */
static int block_product_lt(struct cuda_backend *cb, const struct gemm_args *g, float *p)
{
    struct lt_matmul mm;
    memset(&mm, 0, sizeof mm);
    if (!fp8_tn_codes(cb, g, &mm))
        return -1;
    mm.a_scale = block_scales_lt(cb, CSCR_FP8_SA, &g->a_blocks, g->trans_a, g->m, g->k, &mm.a_scale_mode);
    mm.b_scale = block_scales_lt(cb, CSCR_FP8_SB, &g->b_blocks, !g->trans_b, g->n, g->k, &mm.b_scale_mode);
    if (!mm.a_scale || !mm.b_scale)
        return -1;
    lt_output(&mm, g, p, DT_FP32, 1.0f);
    return cuda_lt_matmul_block_scaled(cb, &mm) ? 1 : 0;
}

/* Whether an operand's tiles lie along K (FP8_TILES_COLS where K is its stored rows, FP8_TILES_ROWS where its
 * stored columns; blocks either way). */
static bool block_tiles_along_k(enum fp8_tiling t, bool k_rows)
{
    return t == FP8_BLOCKS || (t == FP8_TILES_COLS) == k_rows;
}

static void cuda_gemm_fp8_blocks(struct cuda_backend *cb, const struct gemm_args *g)
{
    enum dtype dc = g->c->dtype;
    bool ok = g->a->dtype == DT_FP8_E4M3 && g->b->dtype == DT_FP8_E4M3 && g->a_blocks.scale_inv &&
              g->b_blocks.scale_inv && (dc == DT_FP32 || dc == DT_BF16) && g->batch == 1 &&
              (!g->bias || (g->bias->dtype == DT_FP32 && g->beta == 0.0f)) &&
              block_tiles_along_k(g->a_blocks.tiling, g->trans_a) && block_tiles_along_k(g->b_blocks.tiling, !g->trans_b);
    if (!ok) {
        cuda_record(cb, "this is a bug in the caller (see the block-scaled operands of gemm_args in lib/base/backend.h)",
                    "gemm: unsupported block-scaled product A %s, B %s, C %s (batch %lld, scales %s, tilings %d/%d)",
                    dtype_name(g->a->dtype), dtype_name(g->b->dtype), dtype_name(dc), (long long)g->batch,
                    g->a_blocks.scale_inv && g->b_blocks.scale_inv ? "set" : "missing", (int)g->a_blocks.tiling,
                    (int)g->b_blocks.tiling);
        return;
    }
    const int64_t m = g->m, n = g->n, k = g->k;
    if (m <= 0 || n <= 0)
        return;
    float *p = static_cast<float *>(cuda_scratch(cb, CSCR_FP8_P, (size_t)(m * n) * sizeof(float)));
    if (!p)
        return;
    const char *unfit = block_lt_unfit(cb, g);
    int ran = unfit ? 0 : block_product_lt(cb, g, p);
    if (ran < 0)
        return;
    if (!ran) {
        if (!cb->blockwise_noted) {
            fprintf(stderr, "ampTrain: note: %s: a block-scaled fp8 product (m=%lld n=%lld k=%lld) runs the CPU's "
                            "arithmetic in plain CUDA kernels, not on tensor cores (%s): correct, slower than bf16; "
                            "said once\n",
                    cb->name, (long long)m, (long long)n, (long long)k,
                    unfit ? unfit : "cuBLASLt offers no block-scaled matmul for it here, or refused it");
            cb->blockwise_noted = true;
        }
        block_product_kernel<<<grid_for((size_t)(m * n)), kThreads, 0, cb->stream>>>(
            p, g->a->data, g->b->data, g->trans_a, g->trans_b, m, n, k, g->a_blocks.scale_inv, g->a_blocks.tiling,
            g->b_blocks.scale_inv, g->b_blocks.tiling);
        CB_LAUNCHED(cb, "block_product_kernel");
    }
    fp8_epilogue_kernel<<<grid_for((size_t)(m * n)), kThreads, 0, cb->stream>>>(
        g->c->data, dc, g->epilogue == GEMM_EPI_GELU_TANH ? g->aux->data : NULL, p,
        g->bias ? static_cast<const float *>(g->bias->data) : NULL, g->alpha, NULL, NULL, g->beta, m, n);
    CB_LAUNCHED(cb, "fp8_epilogue_kernel");
}
