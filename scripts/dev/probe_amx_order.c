/*
 * probe_amx_order.c — how this CPU's two bf16 dot-product instructions round, measured: AVX512-BF16
 * vdpbf16ps and AMX tdpbf16ps, each against candidate orders of its fp32 sums on random normal inputs. It
 * is the evidence behind docs/backend.md's "AMX" paragraph: no packing of the operands makes tdpbf16ps
 * give vdpbf16ps's bits, so the AMX path has its own bits.
 *   gcc -O1 -ffp-contract=off scripts/dev/probe_amx_order.c -o /tmp/probe_amx_order && /tmp/probe_amx_order
 * Needs x86-64 with AVX512-BF16 and AMX-BF16, and Linux 5.16 or later (arch_prctl for the tile data).
 * Inputs are bf16 with exponents within 2^+-8 (no subnormals: both instructions flush those alike).
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void)
{
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return rs;
}
static uint16_t rbf(void) /* a random normal bf16 of magnitude 2^-8 .. 2^9 */
{
    return (uint16_t)((rnd() & 1) << 15 | (uint16_t)(127 + (int)(rnd() % 17) - 8) << 7 | (rnd() & 0x7f));
}
static float f(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static float lo(uint32_t p) { return f((uint16_t)p); }
static float hi(uint32_t p) { return f((uint16_t)(p >> 16)); }

__attribute__((target("avx512f,avx512bf16"))) static float vdp(float c, const uint32_t *a, const uint32_t *b, int k)
{
    __m512 acc = _mm512_set1_ps(c);
    for (int q = 0; q < k; q++)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)a[q]), (__m512bh)_mm512_set1_epi32((int)b[q]));
    return _mm512_cvtss_f32(acc);
}

/* One tdpbf16ps of a 1 x k tile of pairs (A) by a k x 1 tile (B) into a 1 x 1 tile holding c. */
__attribute__((target("amx-tile,amx-bf16"))) static float tdp(float c, const uint32_t *a, const uint32_t *b, int k)
{
    /* the 64-byte tile configuration: byte 0 palette; bytes 16 + 2t: tile t's bytes per row; 48 + t: its rows */
    uint8_t cfg[64] __attribute__((aligned(64))) = { 1 };
    const unsigned shape[3][2] = { { 1, 4 }, { 1, 4 * (unsigned)k }, { (unsigned)k, 4 } }; /* C, A, B: rows, bytes */
    for (int t = 0; t < 3; t++)
        cfg[48 + t] = (uint8_t)shape[t][0], cfg[16 + 2 * t] = (uint8_t)shape[t][1];
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
    float out = c;
    _tile_loadd(0, &out, 4);
    _tile_loadd(1, a, 4 * k);
    _tile_loadd(2, b, 4);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, &out, 4);
    _tile_release();
    return out;
}

int main(void)
{
    if (!__builtin_cpu_supports("avx512bf16") || syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18)) {
        fprintf(stderr, "probe_amx_order: this CPU (or kernel) lacks AVX512-BF16 or AMX tile data\n");
        return 2;
    }
    enum { N = 200000 };
    printf("probe_amx_order: %d random cases each; a product of two bf16 is exact in fp32, each + rounds to fp32\n", N);
    /* one pair: c + a0 b0 + a1 b1 in three orders */
    long v[3] = { 0 }, t[3] = { 0 };
    for (long i = 0; i < N; i++) {
        uint32_t a = rbf() | (uint32_t)rbf() << 16, b = rbf() | (uint32_t)rbf() << 16;
        uint32_t cu = (uint32_t)rbf() << 16 | (uint32_t)(rnd() & 0xffff);
        float c, p0 = lo(a) * lo(b), p1 = hi(a) * hi(b);
        memcpy(&c, &cu, 4);
        float m[3] = { (c + p1) + p0, (c + p0) + p1, c + (p0 + p1) };
        float x = vdp(c, &a, &b, 1), y = tdp(c, &a, &b, 1);
        for (int j = 0; j < 3; j++)
            v[j] += memcmp(&m[j], &x, 4) != 0, t[j] += memcmp(&m[j], &y, 4) != 0;
    }
    const char *name[3] = { "(c + a1 b1) + a0 b0", "(c + a0 b0) + a1 b1", "c + (a0 b0 + a1 b1)" };
    for (int j = 0; j < 3; j++)
        printf("one pair, %-20s  vdpbf16ps mismatches %6ld   tdpbf16ps mismatches %6ld\n", name[j], v[j], t[j]);
    /* k pairs in one tdpbf16ps against the pairs added one after another, each as c + (a0 b0 + a1 b1) */
    for (int k = 2; k <= 16; k *= 2) {
        long bad = 0;
        for (long i = 0; i < N; i++) {
            uint32_t a[16], b[16], cu = (uint32_t)rbf() << 16 | (uint32_t)(rnd() & 0xffff);
            float c, s;
            memcpy(&c, &cu, 4);
            s = c;
            for (int q = 0; q < k; q++) {
                a[q] = rbf() | (uint32_t)rbf() << 16, b[q] = rbf() | (uint32_t)rbf() << 16;
                s = s + (lo(a[q]) * lo(b[q]) + hi(a[q]) * hi(b[q]));
            }
            float y = tdp(c, a, b, k);
            bad += memcmp(&s, &y, 4) != 0;
        }
        printf("%2d pairs in one tdpbf16ps vs pair after pair:  mismatches %6ld\n", k, bad);
    }
    return 0;
}
