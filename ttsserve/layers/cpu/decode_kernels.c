/* The CPU decode step's work between the GEMMs, fused: one call per piece instead of ~50 torch ops per layer.

   Built at run time by ttsserve/layers/cpu/kernels.py (cc -O3 -march=native -ffp-contract=off -fopenmp) and
   called through ctypes. Every function takes raw pointers to contiguous tensors:
   - an activation is either fp32 (`*_bf16 == 0`) or bf16 (`*_bf16 == 1`, stored as uint16);
   - `round_bf16 == 1` means the model computes in bf16: each result is rounded to bf16 where the torch
     path rounds it (after every elementwise op), even when it is stored as fp32 for an fp32 GEMM input.
   The math follows the torch path op by op (model/layers.py, attention/torch_ref.py); sums run in another
   order and exp is a polynomial (~1 ulp), so results agree to fp32 rounding, not bitwise. No FMA
   contraction: a*b + c rounds twice, as in torch.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16    /* independent partial sums, so the compiler vectorizes reductions without reassociation */
#define MAX_VECS 256 /* 16-float vectors of one task's query heads (Hq * D <= 4096) */
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN -> 0x7FC0 (c10::BFloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : r;
}

static inline float rnd(float f, int round_bf16) { return round_bf16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* e^x to ~1 ulp, branch-free so that loops of it vectorize (Cephes' expf): x = n ln2 + r by Cody-Waite,
   e^r = 1 + r + r^2 P(r), then 2^n as two normal powers of two (n spans [-150, 128]: denormal results round
   once, as torch's do). 0 below -104 (e^x < 2^-150), +inf above ln(FLT_MAX). */
static inline float exp_poly(float x) {
    float xc = x > 88.7228f ? 88.7228f : (x < -104.0f ? -104.0f : x);
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    int32_t n1 = (int32_t)n >> 1, n2 = (int32_t)n - n1; /* floor halves, both in [-75, 64] */
    uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    float y = (p * s1) * s2;
    y = x > 88.72283f ? INFINITY : y;
    return x < -104.0f ? 0.0f : y;
}

/* Row helpers: branch-free loops over fp32 staging arrays, so that every loop vectorizes. */
static void to_f32(float *dst, const void *src, int bf16, int64_t n) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
    else
        memcpy(dst, src, n * sizeof(float));
}

static void from_f32(void *dst, int bf16, const float *src, int64_t n) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
    else
        memcpy(dst, src, n * sizeof(float));
}

static void round_bf16_(float *x, int64_t n, int round_bf16) {
    if (round_bf16)
        for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

/* h[t] += delta[t] (when delta), then out[t] = w * rms_norm(h[t]) for T rows of H.
   The residual add rounds to the model dtype (delta first: the torch path casts a GEMM's fp32 output to it);
   the norm is MODEL.md §3.1's: x * rsqrt(mean(x^2) + eps) in fp32, cast to the model dtype, times w. */
void add_rms_norm(void *h, int h_bf16, const void *delta, int delta_bf16, const void *w, int64_t T, int64_t H,
                  float eps, void *out, int out_bf16) {
    int rb = h_bf16;
    int64_t es = h_bf16 ? 2 : 4, ds = delta_bf16 ? 2 : 4, os = out_bf16 ? 2 : 4;
    float x[H], y[H], wf[H];
    to_f32(wf, w, h_bf16, H);
    for (int64_t t = 0; t < T; t++) {
        char *hr = (char *)h + t * H * es;
        to_f32(x, hr, h_bf16, H);
        if (delta) {
            to_f32(y, (const char *)delta + t * H * ds, delta_bf16, H);
            round_bf16_(y, H, rb);
            for (int64_t i = 0; i < H; i++) x[i] += y[i];
            round_bf16_(x, H, rb);
            from_f32(hr, h_bf16, x, H);
        }
        float part[LANES] = {0}, ss = 0.f;
        int64_t i = 0;
        for (; i + LANES <= H; i += LANES)
            for (int j = 0; j < LANES; j++) part[j] += x[i + j] * x[i + j];
        for (; i < H; i++) ss += x[i] * x[i];
        for (int j = 0; j < LANES; j++) ss += part[j];
        float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; i++) y[i] = x[i] * r;
        round_bf16_(y, H, rb);
        for (i = 0; i < H; i++) y[i] = wf[i] * y[i];
        round_bf16_(y, H, rb);
        from_f32((char *)out + t * H * os, out_bf16, y, H);
    }
}

/* gu: [T, 2I] (gate, then up) -> out [T, I] = silu(gate) * up, each op rounded to the model dtype. */
void silu_mul(const void *gu, int gu_bf16, int64_t T, int64_t I, void *out, int out_bf16, int round_bf16) {
    int64_t gs = gu_bf16 ? 2 : 4, os = out_bf16 ? 2 : 4;
    float g[I], u[I];
    for (int64_t t = 0; t < T; t++) {
        to_f32(g, (const char *)gu + 2 * t * I * gs, gu_bf16, I);
        to_f32(u, (const char *)gu + (2 * t + 1) * I * gs, gu_bf16, I);
        round_bf16_(g, I, round_bf16);
        round_bf16_(u, I, round_bf16);
        for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1.0f + exp_poly(-g[i]));
        round_bf16_(g, I, round_bf16);
        for (int64_t i = 0; i < I; i++) g[i] *= u[i];
        round_bf16_(g, I, round_bf16);
        from_f32((char *)out + t * I * os, out_bf16, g, I);
    }
}

/* x = x * cos + rotate_half(x) * sin (NeoX RoPE of one head of D <= 512), each op rounded to the model dtype. */
static void rope(float *x, const float *cos, const float *sin, int64_t D, int round_bf16) {
    float tmp[512];
    int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) {
        float rh = d < half ? -x[d + half] : x[d - half];
        tmp[d] = rnd(rnd(x[d] * cos[d], round_bf16) + rnd(rh * sin[d], round_bf16), round_bf16);
    }
    memcpy(x, tmp, D * sizeof(float));
}

static inline v16f load16(const char *p, int bf16) {
    v16f f;
#ifdef __AVX512F__ /* one 16-lane widening load: the generic form below splits into 8-lane pieces */
    if (bf16) {
        __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
        return (v16f)_mm512_castsi512_ps(u);
    }
#endif
    if (bf16) {
        v16h h;
        memcpy(&h, p, sizeof h);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

/* [sum of the lanes of x[0], ..., of x[15]]: a transposing tree of 15 adds and 30 shuffles for 16 sums. */
static inline v16f hsum16x16(const v16f *x) {
    v16f y[8], z[4], w[2];
    for (int k = 0; k < 8; k++) /* lanes: x[2k] (8 partial sums), x[2k+1] (8) */
        y[k] = __builtin_shufflevector(x[2 * k], x[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(x[2 * k], x[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                       31);
    for (int k = 0; k < 4; k++) /* x[4k .. 4k+3]: 4 partial sums each */
        z[k] = __builtin_shufflevector(y[2 * k], y[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(y[2 * k], y[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++) /* x[8k .. 8k+7]: 2 partial sums each */
        w[k] = __builtin_shufflevector(z[2 * k], z[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(z[2 * k], z[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Heads [0, nh) of one sequence (qv: nh * nv query vectors of 16, RoPE applied) over `len` positions of a paged
   context -> out [nh, nv * 16] fp32. Block by block (a block's rows are contiguous, block_size rows of
   row_stride values; head_offset locates head 0 of the range in a row), head by head within a block, so the
   query or accumulator vectors of a head stay in registers over the block's positions. s: nh * len floats.
   Always inlined: callers pass a constant nv, which unrolls the per-position loops. */
static inline __attribute__((always_inline)) void attend_heads(const v16f *qv, int64_t nh, int64_t group,
                                                               const int64_t nv, const char *kc, const char *vc,
                                                               int esize, int bf16, int q_bf16, const int32_t *table,
                                                               int64_t bs, int64_t len, int64_t row_stride,
                                                               int64_t head_offset, float scale, float *s, float *out) {
    int64_t hd = nv * 16, rs = row_stride * esize; /* head dim; a row's bytes */
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
        const char *kb = kc + ((int64_t)table[p0 / bs] * bs * row_stride + head_offset) * esize;
        for (int64_t c0 = 0; c0 < bs && p0 + c0 < len; c0 += 16) { /* 16 positions at a time */
            int64_t n = len - p0 - c0 < 16 ? len - p0 - c0 : 16;
            n = bs - c0 < n ? bs - c0 : n;
            for (int64_t h = 0; h < nh; h++) {
                const v16f *q = qv + h * nv;
                const char *k = kb + (c0 * row_stride + (h / group) * hd) * esize;
                v16f acc[16];
#ifdef __AVX512BF16__
                if (q_bf16 && nv % 2 == 0) { /* bf16 pairs: exact products, fp32 sums, half the instructions */
                    __m512bh qb[16];
                    for (int64_t j = 0; j < nv / 2; j++)
                        qb[j] = _mm512_cvtne2ps_pbh((__m512)q[2 * j + 1], (__m512)q[2 * j]);
                    for (int64_t i = 0; i < 16; i++, k += rs) {
                        __m512 a = _mm512_setzero_ps();
                        if (i < n)
                            for (int64_t j = 0; j < nv / 2; j++)
                                a = _mm512_dpbf16_ps(a, qb[j], (__m512bh)_mm512_loadu_si512(k + j * 64));
                        acc[i] = (v16f)a;
                    }
                } else
#endif
                    for (int64_t i = 0; i < 16; i++, k += rs) {
                        acc[i] = (v16f){0};
                        if (i < n)
                            for (int64_t j = 0; j < nv; j++) acc[i] += q[j] * load16(k + j * 16 * esize, bf16);
                    }
                v16f dots = hsum16x16(acc) * scale;
                memcpy(s + h * len + p0 + c0, &dots, n * sizeof(float));
            }
        }
    }
    float inv[64];
    for (int64_t h = 0; h < nh; h++) {
        float *sh = s + h * len, m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < len; p++) m = sh[p] > m ? sh[p] : m;
        for (int64_t p = 0; p < len; p++) sh[p] = exp_poly(sh[p] - m);
        for (int64_t p = 0; p < len; p++) sum += sh[p];
        inv[h] = 1.0f / sum;
    }
    v16f acc[MAX_VECS];
    for (int64_t j = 0; j < nh * nv; j++) acc[j] = (v16f){0};
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
        int64_t n = len - p0 < bs ? len - p0 : bs;
        const char *vb = vc + ((int64_t)table[p0 / bs] * bs * row_stride + head_offset) * esize;
        for (int64_t h = 0; h < nh; h++) {
            v16f a[32];
            for (int64_t j = 0; j < nv; j++) a[j] = acc[h * nv + j];
            const char *v = vb + (h / group) * hd * esize;
            const float *sh = s + h * len + p0;
            for (int64_t i = 0; i < n; i++, v += rs)
                for (int64_t j = 0; j < nv; j++) a[j] += sh[i] * load16(v + j * 16 * esize, bf16);
            for (int64_t j = 0; j < nv; j++) acc[h * nv + j] = a[j];
        }
    }
    for (int64_t h = 0; h < nh; h++)
        for (int64_t j = 0; j < nv; j++) {
            v16f o = acc[h * nv + j] * inv[h];
            memcpy(out + (h * nv + j) * 16, &o, sizeof o);
        }
}

/* One decode step's attention for B sequences (one new token each), the torch path's
   apply_rotary + store_kv + paged decode attention:
   qkv: [B, (Hq + 2 Hkv) D] (q, k, v), the GEMM output (fp32 or bf16; rounded to the model dtype first);
   cos / sin: [B, D] fp32 (the RoPE table rows, already rounded to the model dtype);
   k_cache / v_cache: [num_blocks, block_size, Hkv, D] in the cache dtype; slots: [B] int64 (the new token's
   flat slot); block_tables: [B, bt_stride] int32; seq_lens: [B] int32 (context incl. the new token);
   scores: scratch, one row of scores_stride >= Hq * max(seq_lens) floats per thread; out: [B, Hq D].
   D must be a multiple of 16 and Hq * D <= 16 * MAX_VECS. Attention math in fp32. */
void decode_attention(const void *qkv, int qkv_bf16, const float *cos, const float *sin, void *k_cache,
                      void *v_cache, int cache_bf16, const int64_t *slots, const int32_t *block_tables,
                      int64_t bt_stride, const int32_t *seq_lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                      int64_t block_size, float scale, void *out, int out_bf16, int round_bf16, float *scores,
                      int64_t scores_stride) {
    int64_t width = (Hq + 2 * Hkv) * D, row = Hkv * D;
    /* RoPE on k, then the k / v writes: every head of a row must be in the cache before any head attends */
    for (int64_t b = 0; b < B; b++) {
        int64_t slot = slots[b];
        for (int64_t h = 0; h < Hkv; h++) {
            float k[512];
            for (int64_t d = 0; d < D; d++) k[d] = rnd(load(qkv, qkv_bf16, b * width + (Hq + h) * D + d), round_bf16);
            rope(k, cos + b * D, sin + b * D, D, round_bf16);
            for (int64_t d = 0; d < D; d++) {
                store(k_cache, cache_bf16, slot * row + h * D + d, k[d]);
                float v = rnd(load(qkv, qkv_bf16, b * width + (Hq + Hkv + h) * D + d), round_bf16);
                store(v_cache, cache_bf16, slot * row + h * D + d, v);
            }
        }
    }
    int64_t group = Hq / Hkv, esize = cache_bf16 ? 2 : 4, nv = D / 16, work = 0, threads = 1;
    for (int64_t b = 0; b < B; b++) work += seq_lens[b];
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* tasks: (sequence, chunk of heads); a sequence is split by heads (whole KV-head groups) only when there are
       fewer sequences than threads. A parallel region wakes the other threads: only for enough work. */
    int64_t chunks = B >= threads ? 1 : threads, kv_per_chunk = (Hkv + chunks - 1) / chunks;
    chunks = (Hkv + kv_per_chunk - 1) / kv_per_chunk;
#pragma omp parallel for schedule(static) if (work * Hq * D > (1 << 14))
    for (int64_t task = 0; task < B * chunks; task++) {
        int64_t b = task / chunks, kv0 = (task % chunks) * kv_per_chunk;
        int64_t kv1 = kv0 + kv_per_chunk < Hkv ? kv0 + kv_per_chunk : Hkv, h0 = kv0 * group, nh = (kv1 - kv0) * group;
        float *s = scores;
#ifdef _OPENMP
        s = scores + (int64_t)omp_get_thread_num() * scores_stride;
#endif
        float q[512], o[MAX_VECS * 16];
        v16f qv[MAX_VECS];
        for (int64_t h = 0; h < nh; h++) {
            for (int64_t d = 0; d < D; d++)
                q[d] = rnd(load(qkv, qkv_bf16, b * width + (h0 + h) * D + d), round_bf16);
            rope(q, cos + b * D, sin + b * D, D, round_bf16);
            memcpy(qv + h * nv, q, D * sizeof(float));
        }
        const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
        const int32_t *table = block_tables + b * bt_stride;
        int q_bf16 = cache_bf16 && round_bf16; /* the query's values are bf16 numbers */
        if (nv == 4) /* head_dim 64 (ChatTTS) */
            attend_heads(qv, nh, group, 4, kc, vc, esize, cache_bf16, q_bf16, table, block_size, seq_lens[b], row,
                         kv0 * D, scale, s, o);
        else
            attend_heads(qv, nh, group, nv, kc, vc, esize, cache_bf16, q_bf16, table, block_size, seq_lens[b], row,
                         kv0 * D, scale, s, o);
        for (int64_t i = 0; i < nh * D; i++) store(out, out_bf16, b * Hq * D + h0 * D + i, rnd(o[i], round_bf16));
    }
}
