/* Fused CPU kernels for the engine's decode step (fp32). Built per host by engine/ops/cpu_ops.py
 * with the machine's C compiler (-O3 -march=native -fopenmp) and called through ctypes; every
 * kernel has a pure-torch twin that the tests compare it with, and that runs when this library
 * cannot be built.
 *
 * Why C: a decode step of a small model is ~40 tiny torch ops per layer around four GEMMs;
 * each op costs a dispatch and a pass over memory. At batch 32 the paged-attention gather
 * alone copied every sequence's K/V once per layer before reading it. These kernels read the
 * paged cache in place and fuse the elementwise chains; decode_layers (at the end) runs a
 * whole pure-decode step through every layer in one call, its projections on dot-product
 * tiles or on wide tiles (which wide_linear also offers to any linear layer).
 *
 * Threads: the library links the process's libgomp (the one torch loaded), and every parallel
 * region names its thread count (torch's), so the two never oversubscribe the cores.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

/* 16 floats as one vector (GCC's vector extension: one zmm register with AVX-512, two ymm
 * with AVX2); v16u for loads and stores at any float-aligned address. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
#define LANES 16

/* Paged decode attention: one query token per sequence, K/V read in place from the cache.
 *
 * q:        [B, q_stride] rows, head h at q + b*q_stride + h*D
 * kv_cache: [num_pages, 2, block_size, KVH, W] (K at 0, V at 1): kvq 0, fp32 rows (W = D);
 *           kvq 1, int8 rows (W = D + 4 bytes: D int8 values, then their fp32 scale, the
 *           layout of engine/attention/kv_format.py), read as int8 x scale (no fp32 copy)
 * tables:   [B, max_pages] page ids; kv_lens: [B] tokens to attend (>= 1)
 * out:      [B, H, D]
 * Query head h reads KV head h / (H / KVH). Softmax is exact (max, then sum of exp) in fp32,
 * computed over tiles of TILE tokens with a running max (no buffer proportional to L).
 * Built with -ffast-math (vectorized expf), so no infinities are used as sentinels.
 */
#define TILE 128
#define PF_AHEAD 8
#define MAX_GROUP 16
#define MAX_D 256

/* Bytes of one KV head's row of one token: fp32 values, or int8 values and their scale. */
static inline int64_t kv_head_bytes(int64_t D, int kvq) { return kvq ? D + 4 : D * 4; }

/* An int8 row's scale (the 4 bytes after its D values). */
static inline __attribute__((always_inline)) float kv_row_scale_(const int8_t *r, int64_t D) {
    float sc;
    memcpy(&sc, r + D, sizeof sc);
    return sc;
}

/* One token's K (or V) of one KV head into its slot: copied (fp32), or quantized (int8:
 * round(x * 127 / max|x|), the scale max|x| / 127 after the values). Every int8 row a CPU
 * engine writes comes from here (kv_write_int8, decode_layers, and kv_quantize_rows for
 * engine/attention/kv_format.quantize_rows), so rows are the same bits whichever path wrote
 * them; the torch twin there (other devices) may differ in the last bit of a rounding. */
static inline void kv_store_(char *slot, const float *x, int64_t D, int kvq) {
    if (!kvq) {
        memcpy(slot, x, D * sizeof(float));
        return;
    }
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float inv = amax > 0.f ? 127.f / amax : 0.f, sc = amax / 127.f;
    int8_t *q = (int8_t *)slot;
    for (int64_t d = 0; d < D; d++) {
        float r = nearbyintf(x[d] * inv);
        q[d] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    }
    memcpy(q + D, &sc, sizeof sc);
}

/* One (sequence, KV head) task. Per tile of TILE tokens: the K/V rows' addresses, walking
 * the page table (an integer division per token cost as much as all the arithmetic); then
 * each K row is read once for every query head of the group (scores), the online-softmax
 * update, and each V row is read once into every head's accumulator. Inlined into copies
 * with D a compile-time constant (64, 128) and kvq (the rows' format) constant, so the D
 * loops unroll into vector registers. row, page: bytes per token slot and per page. An int8
 * row's scale multiplies its dot product (K) or its softmax weight (V), never the values. */
static inline __attribute__((always_inline)) void decode_task(
        const float *q_b, const char *kv_cache, const int64_t *tab, int64_t L, float *out_b,
        int64_t G, int64_t kvh, const int64_t D, int64_t row, int64_t page, int64_t block_size,
        float scale, const int kvq) {
    float qs[MAX_GROUP][MAX_D], acc[MAX_GROUP][MAX_D], m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][TILE];
    const char *krow[TILE];
    const int64_t hb = kv_head_bytes(D, kvq);
    for (int64_t g = 0; g < G; g++) {
        const float *qh = q_b + (kvh * G + g) * D;
        for (int64_t d = 0; d < D; d++) qs[g][d] = qh[d] * scale;
        for (int64_t d = 0; d < D; d++) acc[g][d] = 0.f;
        m[g] = l[g] = 0.f; /* m is set by the first tile (no infinities: -ffast-math) */
    }
    const int64_t v_off = block_size * row; /* V rows sit block_size rows after K's */
    int64_t p = 0, off = 0;                 /* page-table index and slot of the next token */
    for (int64_t t0 = 0; t0 < L; t0 += TILE) {
        const int64_t n = L - t0 < TILE ? L - t0 : TILE;
        for (int64_t i = 0; i < n; i++) {
            krow[i] = kv_cache + tab[p] * page + off * row + kvh * hb;
            if (++off == block_size) {
                off = 0;
                p++;
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const char *k = krow[i];
            /* Pages are scattered, so the hardware prefetcher loses the stream at every page
             * boundary: ask for the K row PF_AHEAD tokens on, and for this token's V row
             * (read after the tile's scores). Batch 32, contexts of 600-2000 tokens (K/V
             * beyond L3), 2-core AVX-512 EPYC: 14-21 -> 22-33 GB/s, 1.55x per call; with
             * the K/V cache-resident (batch 1) ~8% slower per call. */
            if (i + PF_AHEAD < n)
                for (int64_t b = 0; b < hb; b += 64) __builtin_prefetch(krow[i + PF_AHEAD] + b);
            for (int64_t b = 0; b < hb; b += 64) __builtin_prefetch(k + v_off + b);
            if (kvq) { /* the row's values as floats once, for every head of the group */
                const int8_t *kq = (const int8_t *)k;
                const float ks = kv_row_scale_(kq, D);
                float kf[MAX_D];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) kf[d] = (float)kq[d];
                for (int64_t g = 0; g < G; g++) {
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qs[g][d] * kf[d];
                    s[g][i] = dot * ks;
                }
            } else {
                const float *kf = (const float *)k;
                for (int64_t g = 0; g < G; g++) {
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; d++) dot += qs[g][d] * kf[d];
                    s[g][i] = dot;
                }
            }
        }
        for (int64_t g = 0; g < G; g++) {
            float mt = t0 ? m[g] : s[g][0];
            for (int64_t i = 0; i < n; i++) mt = s[g][i] > mt ? s[g][i] : mt;
            const float corr = t0 ? expf(m[g] - mt) : 1.f; /* acc and l are 0 on tile 0 */
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; i++) {
                s[g][i] = expf(s[g][i] - mt);
                sum += s[g][i];
            }
            l[g] = l[g] * corr + sum;
            m[g] = mt;
            if (corr != 1.f)
                for (int64_t d = 0; d < D; d++) acc[g][d] *= corr;
        }
        for (int64_t i = 0; i < n; i++) {
            if (kvq) {
                const int8_t *vq = (const int8_t *)(krow[i] + v_off);
                const float vs = kv_row_scale_(vq, D);
                float vf[MAX_D];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) vf[d] = (float)vq[d];
                for (int64_t g = 0; g < G; g++) {
                    const float w = s[g][i] * vs;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) acc[g][d] += w * vf[d];
                }
            } else {
                const float *v = (const float *)(krow[i] + v_off);
                for (int64_t g = 0; g < G; g++) {
                    const float w = s[g][i];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) acc[g][d] += w * v[d];
                }
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *o = out_b + (kvh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
    }
}

/* A step's new K and V ([T, KVH, D] fp32 each, rows of k_stride / v_stride floats) into an
 * int8 pool's slots (page_ids[t], offsets[t]), quantized as kv_store_ does: the torch twin is
 * engine/attention/kv_format.quantize_rows plus a scatter, here one pass. */
void kv_write_int8(void *kv_cache, const int64_t *page_ids, const int64_t *offsets,
                   const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t T,
                   int64_t KVH, int64_t D, int64_t block_size, int nthreads) {
    const int64_t hb = kv_head_bytes(D, 1), row = KVH * hb, page = 2 * block_size * row;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * KVH >= 256)
    for (int64_t task = 0; task < T * KVH; task++) {
        const int64_t t = task / KVH, h = task % KVH;
        char *slot = (char *)kv_cache + page_ids[t] * page + offsets[t] * row + h * hb;
        kv_store_(slot, k + t * k_stride + h * D, D, 1);
        kv_store_(slot + block_size * row, v + t * v_stride + h * D, D, 1);
    }
}

/* n rows of D floats as int8 rows of D + 4 bytes (kv_store_), into out. */
void kv_quantize_rows(const float *x, int64_t n, int64_t D, int8_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 256)
    for (int64_t i = 0; i < n; i++) kv_store_((char *)(out + i * (D + 4)), x + i * D, D, 1);
}

/* decode_task with D and the rows' format compile-time constants for the common head sizes. */
#define DECODE_TASK_D_(KVQ)                                                                     \
    do {                                                                                        \
        if (D == 64)                                                                            \
            decode_task(q_b, kv_cache, tab, L, out_b, G, kvh, 64, row, page, block_size, scale, \
                        KVQ);                                                                   \
        else if (D == 128)                                                                      \
            decode_task(q_b, kv_cache, tab, L, out_b, G, kvh, 128, row, page, block_size,       \
                        scale, KVQ);                                                            \
        else                                                                                    \
            decode_task(q_b, kv_cache, tab, L, out_b, G, kvh, D, row, page, block_size, scale,  \
                        KVQ);                                                                   \
    } while (0)

static void decode_task_d(const float *q_b, const char *kv_cache, const int64_t *tab, int64_t L,
                          float *out_b, int64_t G, int64_t kvh, int64_t D, int64_t row,
                          int64_t page, int64_t block_size, float scale, int kvq) {
    if (kvq)
        DECODE_TASK_D_(1);
    else
        DECODE_TASK_D_(0);
}

void paged_decode(const float *q, int64_t q_stride, const void *kv_cache,
                  const int64_t *tables, int64_t max_pages, const int64_t *kv_lens,
                  float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                  int64_t block_size, float scale, int nthreads, int64_t kvq) {
    /* kvq last: a caller passing it to an older build (bench/studies/kernel_ab.py times two
     * builds with one argument list) is read as that build's fp32 call */
    const int64_t G = H / KVH;
    const int64_t row = KVH * kv_head_bytes(D, (int)kvq); /* bytes per token slot (all heads) */
    const int64_t page = 2 * block_size * row;            /* bytes per page (K and V) */
    int64_t work = 0; /* K/V values read: below ~64K, waking the thread team costs more */
    for (int64_t b = 0; b < B; b++) work += kv_lens[b] * KVH * D * 2;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (work >= 65536)
    for (int64_t task = 0; task < B * KVH; task++) {
        const int64_t b = task / KVH, kvh = task % KVH;
        const float *q_b = q + b * q_stride;
        const int64_t *tab = tables + b * max_pages;
        float *out_b = out + b * H * D;
        decode_task_d(q_b, (const char *)kv_cache, tab, kv_lens[b], out_b, G, kvh, D, row,
                      page, block_size, scale, (int)kvq);
    }
}

static inline void norm_row_(const float *xr, const float *weight, float *o, int64_t n,
                             float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (xr[i] * r);
}

/* Rotary embedding of one head of D floats in place (rotate-half; c/s rows of D, halves equal). */
static inline void rope_head_(float *x, const float *c, const float *s, int64_t D) {
    const int64_t half = D / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[half + i];
        x[i] = a * c[i] - b * s[i];
        x[half + i] = b * c[half + i] + a * s[half + i];
    }
}

/* out[t, :] = weight * (x[t, :] * rsqrt(mean(x[t, :]^2) + eps)), x rows of n floats.
 * With residual != NULL, first x[t] += residual[t] in place (the layer's skip connection),
 * so one pass does "h = h + o; x = norm(h)". */
void rms_norm(float *x, const float *residual, const float *weight, float *out,
              int64_t T, int64_t n, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T * n >= 65536)
    for (int64_t t = 0; t < T; t++) {
        float *xr = x + t * n;
        if (residual) {
            const float *rr = residual + t * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) xr[i] += rr[i];
        }
        norm_row_(xr, weight, out + t * n, n, eps);
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu rows [gate (I) | up (I)].
 * exp's argument is capped at 80: under -ffast-math, g / (1 + inf) is not reliably 0. */
void silu_mul(const float *gu, float *out, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + expf(fminf(-g[i], 80.f))) * u[i];
    }
}

/* Rotary embedding in place, rotate-half convention, on the first `heads` heads of each row:
 * x[t, h, :D/2], x[t, h, D/2:] = x1*cos - x2*sin, x2*cos + x1*sin with cos/sin rows [T, D]
 * (halves equal, as the tables are cat(freqs, freqs)). x rows are `stride` floats apart. */
void rope(float *x, int64_t stride, int64_t T, int64_t heads, int64_t D,
          const float *cos_, const float *sin_, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (T * heads * D >= 65536)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++)
            rope_head_(x + t * stride + h * D, cos_ + t * D, sin_ + t * D, D);
}

/* y[m, :] = W x[m, :] (+ bias) for a few rows x (M <= 8): each weight row is streamed from
 * memory once, by one thread, and dotted with every x (in cache). MKL's and oneDNN's
 * small-M paths streamed the default model's 576-wide weights at 22-28 GB/s on a 2-core
 * AVX-512 EPYC; this loop at 36-50 GB/s. x: [M, K] contiguous; W: [N, K]; y: [M, N]. */
void gemv(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
          int64_t K, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *wr = w + n * K;
        const float b = bias ? bias[n] : 0.f;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * K;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += wr[k] * xr[k];
            y[m * N + n] = acc + b;
        }
    }
}

/* y[r * M + m] = dot(w[r], x[m * K:]) for R weight rows of K floats and M input rows
 * (R x M <= 16): each 16-float chunk of a weight row is loaded once and multiplied into M
 * accumulators, all R x M of them in vector registers (where one dot product at a time
 * does 1 FMA per 2 loads: R = 2, M = 8 does 16 FMAs per 10 loads, R = 4, M = 4 per 8).
 * Always inlined with R and M constants (the switches below), so the loops unroll. */
#define CHUNK 16
static inline __attribute__((always_inline)) void dots_(
        const float *const *w, const int64_t R, const float *x, const int64_t M, int64_t K,
        float *y) {
    float a[16][CHUNK] = {{0.f}}; /* a[r * M + m] */
    int64_t k = 0;
    for (; k + CHUNK <= K; k += CHUNK)
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K + k;
            for (int64_t r = 0; r < R; r++) {
                const float *wr = w[r] + k;
#pragma omp simd
                for (int64_t j = 0; j < CHUNK; j++) a[r * M + m][j] += wr[j] * xm[j];
            }
        }
    for (int64_t r = 0; r < R; r++)
        for (int64_t m = 0; m < M; m++) {
            float s = 0.f;
            for (int64_t j = 0; j < CHUNK; j++) s += a[r * M + m][j];
            for (int64_t q = k; q < K; q++) s += w[r][q] * x[m * K + q];
            y[r * M + m] = s;
        }
}

/* Two weight rows against M <= 8 input rows: y[r * M + m]. */
static void row_dots(const float *w0, const float *w1, const float *x, int64_t M, int64_t K,
                     float *y) {
    const float *w[2] = {w0, w1};
    switch (M) {
    case 1: dots_(w, 2, x, 1, K, y); break;
    case 2: dots_(w, 2, x, 2, K, y); break;
    case 3: dots_(w, 2, x, 3, K, y); break;
    case 4: dots_(w, 2, x, 4, K, y); break;
    case 5: dots_(w, 2, x, 5, K, y); break;
    case 6: dots_(w, 2, x, 6, K, y); break;
    case 7: dots_(w, 2, x, 7, K, y); break;
    default: dots_(w, 2, x, 8, K, y); break;
    }
}

/* Four weight rows against M <= 4 input rows: y[r * M + m]. */
static void quad_dots(const float *w0, const float *w1, const float *w2, const float *w3,
                      const float *x, int64_t M, int64_t K, float *y) {
    const float *w[4] = {w0, w1, w2, w3};
    switch (M) {
    case 1: dots_(w, 4, x, 1, K, y); break;
    case 2: dots_(w, 4, x, 2, K, y); break;
    case 3: dots_(w, 4, x, 3, K, y); break;
    default: dots_(w, 4, x, 4, K, y); break;
    }
}

/* A block of row pairs against all M input rows: pair i in [i0, i1) is the weight rows at
 * w0 + i * ws and w1 + i * ws (K floats each); their products with input row m go to
 * y0[m * ys + i * os] and y1[m * ys + i * os], assigned or (accumulate) added. Input rows in
 * tiles outside, weight rows inside: the first tile reads the block's weights from memory,
 * the other tiles find them in L2 while their input rows stay in L1. Up to 3 rows: one pair
 * at a time against all of them (row_dots); from 4 rows: two pairs against tiles of 4
 * (quad_dots: 16 FMAs per 8 loads; on a 2-core AVX-512 EPYC a 32-row step went from 48-53
 * to 42-44 ms, and tiles of 6 were slower again). */
static void pair_block(const float *w0, const float *w1, int64_t ws, const float *x, int64_t M,
                       int64_t K, int64_t i0, int64_t i1, float *y0, float *y1, int64_t os,
                       int64_t ys, int accumulate) {
    if (M >= 4) { /* two pairs (four rows) at a time against tiles of 4 input rows */
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mt = M - m0 < 4 ? M - m0 : 4;
            for (int64_t i = i0; i < i1; i += 2) {
                float a[16];
                if (i + 1 < i1)
                    quad_dots(w0 + i * ws, w1 + i * ws, w0 + (i + 1) * ws, w1 + (i + 1) * ws,
                              x + m0 * K, mt, K, a);
                else
                    row_dots(w0 + i * ws, w1 + i * ws, x + m0 * K, mt, K, a);
                const int64_t np = i + 1 < i1 ? 2 : 1;
                for (int64_t p = 0; p < np; p++)
                    for (int64_t m = 0; m < mt; m++) {
                        const int64_t at = (m0 + m) * ys + (i + p) * os;
                        const float u = a[(2 * p) * mt + m], v = a[(2 * p + 1) * mt + m];
                        y0[at] = accumulate ? y0[at] + u : u;
                        y1[at] = accumulate ? y1[at] + v : v;
                    }
            }
        }
        return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mt = M - m0 < 8 ? M - m0 : 8;
        for (int64_t i = i0; i < i1; i++) {
            float a[16];
            row_dots(w0 + i * ws, w1 + i * ws, x + m0 * K, mt, K, a);
            for (int64_t m = 0; m < mt; m++) {
                const int64_t at = (m0 + m) * ys + i * os;
                y0[at] = accumulate ? y0[at] + a[m] : a[m];
                y1[at] = accumulate ? y1[at] + a[mt + m] : a[mt + m];
            }
        }
    }
}

/* Pairs per work block: up to 16 (the block's weights stay in L2 across input tiles), fewer
 * where that would leave threads without at least 4 blocks each. */
static int64_t pairs_per_block(int64_t pairs, int nthreads) {
    const int64_t pb = pairs / (4 * (int64_t)nthreads);
    return pb < 1 ? 1 : pb > 16 ? 16 : pb;
}

/* Wide tiles (from a few rows up): the dot-product tiles above end each output in a
 * horizontal sum and load one input vector per weight vector, which held a 32-row step to
 * ~40% of the cores' FMA rate. Here the roles turn: the input rows are transposed once (xT
 * [K][MP], MP lanes = M rounded up to 16, the padding lanes zero) so each vector holds one k
 * of 16 rows, and each weight scalar, read in place from its row, is broadcast into an FMA
 * against every lane vector: NR x MV accumulators, MV vector loads and NR broadcasts per
 * NR x MV FMAs, no horizontal sums, each weight read from memory once per step. The outputs
 * come out transposed (out[r][lane]), the layout the next projection's input wants. While a
 * tile runs, the next tile's rows are prefetched into L2 (12 row streams are more than the
 * hardware prefetcher follows). 2-core AVX-512 EPYC, whole 32-row decode step: 40-44 ms on the
 * dot tiles, 28-31 on these without the prefetch, 24-27 with it (8 rows: 1.4x from the
 * prefetch); the LM head (49152 x 576) at 32 rows 360-420 GFLOP/s, near the matmul peak. Tried and
 * dropped: 8 or 16 rows per tile (0.86-1.0x), prefetching two or four tiles ahead or into L1
 * (within 3%). */
#ifdef __AVX512F__
typedef v16 wvec; /* the wide tiles' lane vector: one register */
typedef v16u wvecu;
#define WL 16      /* lanes per wvec */
#define WIDE_NR 12 /* weight rows per tile: 12 x 2 lane vectors = 24 of the 32 zmm registers */
#define WIDE_MV 2  /* lane vectors per tile */
#else
/* Without AVX-512 a 64-byte v16 is no machine vector: GCC kept the 12 x 2 tile's accumulators
 * on the stack, and the wide tiles ran at 4-15 GFLOP/s on a 2-core AMD EPYC (AVX2), a tenth
 * of torch's GEMM there. There the tile is 6 rows x 2 ymm vectors (16 lanes): 12
 * accumulators, 2 for the input, 1 for the broadcast, of the 16 ymm registers. */
typedef float wvec __attribute__((vector_size(32)));
typedef float wvecu __attribute__((vector_size(32), aligned(4)));
#define WL 8
#define WIDE_NR 6
#define WIDE_MV 2
#endif

/* out[r * os + lane] = dot(w[r * ws:], column lane of xT) for r < NR, lane < WL * MV. */
static inline __attribute__((always_inline)) void wide_tile_(
        const float *w, int64_t ws, const int NR, const float *xT, int64_t MP, const int MV,
        int64_t K, float *out, int64_t os) {
    wvec a[WIDE_NR][WIDE_MV];
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < MV; v++) a[r][v] = (wvec){0};
    for (int64_t k = 0; k < K; k++) {
        if ((k & 15) == 0) /* the next tile's rows into L2, a cache line per row */
            for (int r = 0; r < NR; r++) __builtin_prefetch(w + (r + NR) * ws + k, 0, 2);
        const float *xk = xT + k * MP;
        wvec xv[WIDE_MV];
        for (int v = 0; v < MV; v++) xv[v] = *(const wvecu *)(xk + v * WL);
        for (int r = 0; r < NR; r++) {
            const float s = w[r * ws + k];
            for (int v = 0; v < MV; v++) a[r][v] += s * xv[v];
        }
    }
    for (int r = 0; r < NR; r++)
        for (int v = 0; v < MV; v++) *(wvecu *)(out + r * os + v * WL) = a[r][v];
}

/* out[r * MP + lane] for weight rows r < nr (nr <= WIDE_NR, row r at w + r * ws) and every
 * lane < MP: WIDE_MV lane vectors at a time (the last LANES lanes alone where they remain),
 * rows WIDE_NR, then 4, then 1 at a time. */
static void wide_rows(const float *w, int64_t ws, int64_t nr, const float *xT, int64_t MP,
                      int64_t K, float *out) {
    for (int64_t c0 = 0; c0 < MP;) { /* MP: a multiple of LANES (16) */
        const int two = MP - c0 >= WIDE_MV * WL; /* a whole tile of lanes, else LANES */
        const float *xc = xT + c0;
        float *oc = out + c0;
        int64_t r = 0;
        for (; r + WIDE_NR <= nr; r += WIDE_NR)
            if (two) wide_tile_(w + r * ws, ws, WIDE_NR, xc, MP, WIDE_MV, K, oc + r * MP, MP);
            else wide_tile_(w + r * ws, ws, WIDE_NR, xc, MP, LANES / WL, K, oc + r * MP, MP);
        for (; r + 4 <= nr; r += 4)
            if (two) wide_tile_(w + r * ws, ws, 4, xc, MP, WIDE_MV, K, oc + r * MP, MP);
            else wide_tile_(w + r * ws, ws, 4, xc, MP, LANES / WL, K, oc + r * MP, MP);
        for (; r < nr; r++)
            if (two) wide_tile_(w + r * ws, ws, 1, xc, MP, WIDE_MV, K, oc + r * MP, MP);
            else wide_tile_(w + r * ws, ws, 1, xc, MP, LANES / WL, K, oc + r * MP, MP);
        c0 += two ? WIDE_MV * WL : LANES;
    }
}

/* xT[i * MP + m] = row m of x normalized (norm_row_'s formula), written transposed. */
static inline void norm_row_t_(const float *xr, const float *weight, float *xT, int64_t MP,
                               int64_t m, int64_t n, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) xT[i * MP + m] = weight[i] * (xr[i] * r);
}

static inline int64_t lanes_for(int64_t M) { return (M + LANES - 1) / LANES * LANES; }

static inline const float *wide_src_(int64_t qfmt, int64_t G, const void *w,
                                     const _Float16 *sc, const _Float16 *off, int64_t n0,
                                     int64_t nr, int64_t K, float *buf);

/* h[m * E + n] += dot(W[n], lane m of xT) for the E rows of W (K each; its layout as
 * wide_src_ takes it) and m < M: a projection into the residual stream on the wide tiles, its
 * rows shared among the team (an orphaned omp for: called inside decode_layers' parallel
 * region; tile and deq: this thread's). */
static void wide_residual_(int64_t qfmt, int64_t G, const void *w, const _Float16 *sc,
                           const _Float16 *off, int64_t K, const float *xT, int64_t MP,
                           int64_t M, int64_t E, float *tile, float *deq, float *h) {
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < E; n0 += WIDE_NR) {
        const int64_t nr = E - n0 < WIDE_NR ? E - n0 : WIDE_NR;
        wide_rows(wide_src_(qfmt, G, w, sc, off, n0, nr, K, deq), K, nr, xT, MP, K, tile);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t m = 0; m < M; m++) h[m * E + n0 + r] += tile[r * MP + m];
    }
}

/* y [M, N] = x [M, K] W^T (+ bias) by the wide tiles, for a linear layer outside the fused
 * step (the LM head: 49152 x 576 for the default model). x is transposed into work
 * (wide_linear_work_floats: MP x K floats, the padding lanes zero, plus a tile per thread),
 * then each thread takes a share of the weight rows, WIDE_NR at a time. */
int64_t wide_linear_work_floats(int64_t M, int64_t K, int nthreads) {
    const int64_t MP = lanes_for(M);
    return MP * K + (int64_t)nthreads * WIDE_NR * MP;
}

/* wide_linear for W in any layout wide_src_ takes (work: qwide_linear_work_floats). */
static void wide_linear_(int64_t qfmt, int64_t G, const float *x, const void *w,
                         const _Float16 *sc, const _Float16 *off, const float *bias, float *y,
                         int64_t M, int64_t N, int64_t K, float *work, int nthreads) {
    const int64_t MP = lanes_for(M);
    float *xT = work;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num();
        float *tile = work + MP * K + (int64_t)t * WIDE_NR * MP;
        float *deq = work + MP * K + (int64_t)nthreads * WIDE_NR * MP + (int64_t)t * WIDE_NR * K;
#pragma omp for schedule(static)
        for (int64_t k = 0; k < K; k++)
            for (int64_t m = 0; m < MP; m++) xT[k * MP + m] = m < M ? x[m * K + k] : 0.f;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += WIDE_NR) {
            const int64_t nr = N - n0 < WIDE_NR ? N - n0 : WIDE_NR;
            wide_rows(wide_src_(qfmt, G, w, sc, off, n0, nr, K, deq), K, nr, xT, MP, K, tile);
            for (int64_t m = 0; m < M; m++)
                for (int64_t r = 0; r < nr; r++)
                    y[m * N + n0 + r] = tile[r * MP + m] + (bias ? bias[n0 + r] : 0.f);
        }
    }
}

void wide_linear(const float *x, const float *w, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, float *work, int nthreads) {
    wide_linear_(0, 0, x, w, 0, 0, bias, y, M, N, K, work, nthreads);
}

/* Causal prefill attention, the wide tiles' way: 32 query rows of one head in the vector
 * lanes (QB), keys and values read in place as broadcast scalars, so neither the scores nor
 * the output need a horizontal sum and the online softmax's row max and sum are lane-wise.
 *
 * q:   [Lq, H, D] rows q_stride floats apart; k, v: [Lkv, KVH, D] rows kv_stride apart
 * out: [Lq, H, D] rows o_stride apart. Query row i sits at position q_start + i and attends
 *      keys 0 .. q_start + i (q_start = Lkv - Lq: the tokens cached before this chunk).
 * Tasks: (head, block of 32 query rows), the longest (last) blocks first. Per task, keys in
 * blocks of KB: scores S^T[key][lane] (ATT_T keys x 32 lanes per tile, over d), the causal mask
 * on the diagonal block, the online softmax (max, correction, exp, sum) lane-wise, then
 * O^T[d][lane] += P[key][lane] * V[key][d] (ATT_T d x 32 lanes per tile, over the keys).
 * Scratch on the stack per task: QB x (2 MAX_D + KB) floats, 72 KB (the Q and output tiles
 * sized for the largest head). */
#define QB 32
#define KB 64
#define ATT_V (QB / WL) /* lane vectors per tile row (wvec: the wide tiles' vector) */
#ifdef __AVX512F__
#define ATT_T 12 /* keys (scores) or head dims (values) per register tile: 24 accumulators */
#else
#define ATT_T 3 /* 3 x 4 ymm accumulators: the 12 x 2 v16 tile lived on the stack on AVX2 */
#endif

static inline __attribute__((always_inline)) void att_scores_(
        const float *qT, const float *k, int64_t kv_stride, const int NT, int64_t D,
        float *sT) {
    wvec a[ATT_T][ATT_V];
    for (int t = 0; t < NT; t++)
        for (int v = 0; v < ATT_V; v++) a[t][v] = (wvec){0};
    for (int64_t d = 0; d < D; d++) {
        wvec x[ATT_V];
        for (int v = 0; v < ATT_V; v++) x[v] = *(const wvec *)(qT + d * QB + v * WL);
        for (int t = 0; t < NT; t++) {
            const float s = k[t * kv_stride + d];
            for (int v = 0; v < ATT_V; v++) a[t][v] += s * x[v];
        }
    }
    for (int t = 0; t < NT; t++)
        for (int v = 0; v < ATT_V; v++) *(wvec *)(sT + t * QB + v * WL) = a[t][v];
}

static inline __attribute__((always_inline)) void att_values_(
        const float *pT, int64_t nk, const float *v, int64_t kv_stride, const int NT,
        float *oT) {
    wvec a[ATT_T][ATT_V];
    for (int t = 0; t < NT; t++)
        for (int u = 0; u < ATT_V; u++) a[t][u] = *(wvec *)(oT + t * QB + u * WL);
    for (int64_t j = 0; j < nk; j++) {
        wvec p[ATT_V];
        for (int u = 0; u < ATT_V; u++) p[u] = *(const wvec *)(pT + j * QB + u * WL);
        const float *vj = v + j * kv_stride;
        for (int t = 0; t < NT; t++)
            for (int u = 0; u < ATT_V; u++) a[t][u] += vj[t] * p[u];
    }
    for (int t = 0; t < NT; t++)
        for (int u = 0; u < ATT_V; u++) *(wvec *)(oT + t * QB + u * WL) = a[t][u];
}

void prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                       int64_t kv_stride, float *out, int64_t o_stride, int64_t Lq,
                       int64_t q_start, int64_t H, int64_t KVH, int64_t D, float scale,
                       int nthreads) {
    const int64_t G = H / KVH, blocks = (Lq + QB - 1) / QB;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (Lq * (q_start + Lq) * H * D >= 1 << 20)
    for (int64_t task = 0; task < blocks * H; task++) {
        const int64_t r0 = (blocks - 1 - task / H) * QB, h = task % H, kh = h / G;
        const int64_t rows = Lq - r0 < QB ? Lq - r0 : QB;
        float qT[MAX_D * QB] __attribute__((aligned(64)));
        float oT[MAX_D * QB] __attribute__((aligned(64)));
        float sT[KB * QB] __attribute__((aligned(64)));
        for (int64_t d = 0; d < D; d++)
            for (int64_t i = 0; i < QB; i++) {
                qT[d * QB + i] = i < rows ? q[(r0 + i) * q_stride + h * D + d] * scale : 0.f;
                oT[d * QB + i] = 0.f;
            }
        float m[QB] __attribute__((aligned(64))), l[QB] __attribute__((aligned(64)));
        float c[QB] __attribute__((aligned(64)));
        for (int64_t i = 0; i < QB; i++) m[i] = -1e30f, l[i] = 0.f;
        const float *kh_k = k + kh * D, *kh_v = v + kh * D;
        const int64_t first = q_start + r0; /* the block's first row's position */
        const int64_t nkeys = first + rows; /* keys the block's last row sees */
        for (int64_t j0 = 0; j0 < nkeys; j0 += KB) {
            const int64_t nk = nkeys - j0 < KB ? nkeys - j0 : KB;
            int64_t t = 0;
            for (; t + ATT_T <= nk; t += ATT_T)
                att_scores_(qT, kh_k + (j0 + t) * kv_stride, kv_stride, ATT_T, D, sT + t * QB);
            for (; t < nk; t++)
                att_scores_(qT, kh_k + (j0 + t) * kv_stride, kv_stride, 1, D, sT + t * QB);
            if (j0 + nk - 1 > first) /* keys past some row's position: masked in that lane */
                for (int64_t j = 0; j < nk; j++)
                    for (int64_t i = 0; i < QB; i++)
                        if (j0 + j > first + i) sT[j * QB + i] = -1e30f;
            /* Online softmax, lane by lane: the new max, the old sums' correction, exp. */
            for (int64_t i = 0; i < QB; i++) c[i] = m[i];
            for (int64_t j = 0; j < nk; j++)
#pragma omp simd
                for (int64_t i = 0; i < QB; i++) m[i] = fmaxf(m[i], sT[j * QB + i]);
#pragma omp simd
            for (int64_t i = 0; i < QB; i++) c[i] = expf(c[i] - m[i]);
            float sum[QB] __attribute__((aligned(64))) = {0.f};
            for (int64_t j = 0; j < nk; j++)
#pragma omp simd
                for (int64_t i = 0; i < QB; i++) {
                    const float e = expf(sT[j * QB + i] - m[i]);
                    sT[j * QB + i] = e;
                    sum[i] += e;
                }
#pragma omp simd
            for (int64_t i = 0; i < QB; i++) l[i] = l[i] * c[i] + sum[i];
            for (int64_t d = 0; d < D; d++)
#pragma omp simd
                for (int64_t i = 0; i < QB; i++) oT[d * QB + i] *= c[i];
            int64_t d0 = 0;
            for (; d0 + ATT_T <= D; d0 += ATT_T)
                att_values_(sT, nk, kh_v + j0 * kv_stride + d0, kv_stride, ATT_T, oT + d0 * QB);
            for (; d0 < D; d0++)
                att_values_(sT, nk, kh_v + j0 * kv_stride + d0, kv_stride, 1, oT + d0 * QB);
        }
        for (int64_t i = 0; i < rows; i++) {
            const float inv = 1.f / l[i];
            for (int64_t d = 0; d < D; d++)
                out[(r0 + i) * o_stride + h * D + d] = oT[d * QB + i] * inv;
        }
    }
}

/* ---- weight-only quantized products (engine/quant/layouts.py's layouts) ----------------------------
 * y[m * N + n] = sum_k x[m * K + k] * w[n][k] (+ bias[n]), the weight read in its quantized
 * layout and never expanded in memory: a decode step is bound by the bytes of weights it
 * reads, and int8 / int4 weights are a quarter / an eighth of fp32's (plus fp16 scales).
 *
 * int8: w[n][k] = q[n * K + k] * scale[n * (K / G) + k / G], G a multiple of 16.
 * int4: per 32-weight block b of row n, byte 8h + j of its 16 (h 0..1, j 0..7) holds
 *       q_{16h+j} (low nibble) and q_{16h+8+j} (high nibble): 8 bytes widened to 32-bit lanes
 *       are 8 consecutive weights after a mask and 8 more after a shift;
 *       w = q * scale[n][b] + offset[n][b]. The offset's share is
 *       offset * sum(x over the block): those sums are made once per call (xsum), so the inner
 *       loop is the unsigned nibbles times x, scaled once per block.
 * Rows of x are taken QM at a time against each weight row (the row stays in L1 between
 * chunks); each weight row is converted to floats once per chunk, 16 lanes at a time. */
#define QM 4

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* AVX2 intrinsics (8 lanes; every x86 server CPU of the last decade, AVX-512 ones included),
 * not GCC's vector extension: GCC 12 turns a conversion of bytes to floats written portably
 * into scalar conversions, slower than the fp32 GEMV it should beat.
 * R weight rows at a time against M rows of x (R * M <= 4 accumulators, each group walked in
 * two interleaved halves: 12 of the 16 registers): one accumulator chain per (row, x row)
 * left the FMA units waiting on its latency. */
static inline __attribute__((always_inline)) __m256 bytes8_(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float hsum8_(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void q8_tile_(
        const int8_t *q, const _Float16 *sc, const float *x, const int64_t R, const int64_t M,
        int64_t K, int64_t G, float *out /* [R][M] */) {
    __m256 acc[4], part[4][2];
    for (int64_t i = 0; i < R * M; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        for (int64_t i = 0; i < R * M; i++) part[i][0] = part[i][1] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + G; k += 16) {
            if (!(k & 63))  /* each 64-byte line of these rows: fetch the next tile's */
                for (int64_t r = 0; r < R; r++)
                    _mm_prefetch((const char *)(q + (r + R) * K + k), _MM_HINT_T0);
            for (int h = 0; h < 2; h++)
                for (int64_t r = 0; r < R; r++) {
                    const __m256 wf = bytes8_(q + r * K + k + 8 * h);
                    for (int64_t m = 0; m < M; m++)
                        part[r * M + m][h] = _mm256_fmadd_ps(
                            wf, _mm256_loadu_ps(x + m * K + k + 8 * h), part[r * M + m][h]);
                }
        }
        for (int64_t r = 0; r < R; r++) {
            const __m256 s = _mm256_set1_ps((float)sc[r * (K / G) + g0 / G]);
            for (int64_t m = 0; m < M; m++)
                acc[r * M + m] = _mm256_fmadd_ps(
                    s, _mm256_add_ps(part[r * M + m][0], part[r * M + m][1]), acc[r * M + m]);
        }
    }
    for (int64_t i = 0; i < R * M; i++) out[i] = hsum8_(acc[i]);
}

/* sum over blocks of a[b] * c[b] for fp16 a, fp32 c (nb values): a row's offset term. */
static inline float dot_h_(const _Float16 *a, const float *c, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= nb; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i))),
                              _mm256_loadu_ps(c + i), acc);
    float s = hsum8_(acc);
    for (; i < nb; i++) s += (float)a[i] * c[i];
    return s;
}

static inline __attribute__((always_inline)) void q4_tile_(
        const uint8_t *q, const _Float16 *sc, const _Float16 *off, const float *x,
        const float *xsum, const int64_t R, const int64_t M, int64_t K, float *out) {
    const int64_t nb = K / 32;
    __m256 acc[4];
    for (int64_t i = 0; i < R * M; i++) acc[i] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int64_t b = 0; b < nb; b++)
        for (int64_t r = 0; r < R; r++) {
            const uint8_t *qb = q + r * (K / 2) + b * 16;
            if (!(b & 3))  /* each 64-byte line of these rows: fetch the next tile's */
                _mm_prefetch((const char *)(qb + R * (K / 2)), _MM_HINT_T0);
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qb));
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qb + 8)));
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(a, low4));
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
            const __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(c, low4));
            const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
            const __m256 s = _mm256_set1_ps((float)sc[r * nb + b]);
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * K + b * 32;
                __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xm));
                t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xm + 8), t);
                t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xm + 16), t);
                t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xm + 24), t);
                acc[r * M + m] = _mm256_fmadd_ps(s, t, acc[r * M + m]);
            }
        }
    for (int64_t r = 0; r < R; r++)
        for (int64_t m = 0; m < M; m++)
            out[r * M + m] = hsum8_(acc[r * M + m]) + dot_h_(off + r * nb, xsum + m * nb, nb);
}
#define Q_ROWS(MC) ((MC) == 1 ? 4 : (MC) == 2 ? 2 : 1)
#else
/* Portable twins (correct, not fast: the tuning then picks the dequantizing path). */
static inline void q8_tile_(const int8_t *q, const _Float16 *sc, const float *x, const int64_t R,
                            const int64_t M, int64_t K, int64_t G, float *out) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t g0 = 0; g0 < K; g0 += G) {
                float part = 0.f;
                for (int64_t k = g0; k < g0 + G; k++) part += (float)q[r * K + k] * x[m * K + k];
                acc += (float)sc[r * (K / G) + g0 / G] * part;
            }
            out[r * M + m] = acc;
        }
}

static inline void q4_tile_(const uint8_t *q, const _Float16 *sc, const _Float16 *off,
                            const float *x, const float *xsum, const int64_t R, const int64_t M,
                            int64_t K, float *out) {
    const int64_t nb = K / 32;
    for (int64_t r = 0; r < R; r++)
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *qb = q + r * (K / 2) + b * 16;
                const float *xb = x + m * K + b * 32;
                float part = 0.f;
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 8; j++)
                        part += (float)(qb[8 * h + j] & 15) * xb[16 * h + j]
                                + (float)(qb[8 * h + j] >> 4) * xb[16 * h + 8 + j];
                acc += (float)sc[r * nb + b] * part + (float)off[r * nb + b] * xsum[m * nb + b];
            }
            out[r * M + m] = acc;
        }
}
#define Q_ROWS(MC) 1
#endif

/* y[m * ldy + n] (+ y when acc) = sum_k x[m * K + k] w[n][k] for the rows n0 <= n < n1 of a
 * quantized weight (fmt 1: int8 in groups of G, 2: int4), the M rows of x QM at a time, the
 * weight rows in tiles of Q_ROWS(rows in the chunk); R and the chunk's rows compile-time
 * constants in each case, so the tiles' loops unroll into registers. xsum: for int4, the sums
 * of x over each 32-weight block [M, K / 32]. */
#define Q_CASES(CALL)                                                                        \
    switch (mc) {                                                                            \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break;                  \
    default: CALL(4); break;                                                                 \
    }
#define Q_TILES(TILE, ...)                                                                   \
    if (r == 4) TILE(4, __VA_ARGS__);                                                        \
    else if (r == 2) TILE(2, __VA_ARGS__);                                                   \
    else TILE(1, __VA_ARGS__);
#define Q8_TILE(R, MC) q8_tile_(q + n * K, scale + n * (K / G), x + m0 * K, R, MC, K, G, out)
#define Q4_TILE(R, MC) q4_tile_(q + n * (K / 2), scale + n * nb, offset + n * nb, x + m0 * K, \
                                xsum + m0 * nb, R, MC, K, out)
#define Q_PICK_R(MC)                                                                         \
    r = (Q_ROWS(MC) == 4 && n + 4 <= n1) ? 4 : (Q_ROWS(MC) >= 2 && n + 2 <= n1) ? 2 : 1;
#define Q8_CALL(MC) Q_PICK_R(MC) Q_TILES(Q8_TILE, MC)
#define Q4_CALL(MC) Q_PICK_R(MC) Q_TILES(Q4_TILE, MC)

static void q_rows_(int64_t fmt, int64_t G, const void *data, const _Float16 *scale,
                    const _Float16 *offset, const float *x, const float *xsum, int64_t M,
                    int64_t K, int64_t n0, int64_t n1, float *y, int64_t ldy, int acc) {
    const int64_t nb = K / 32;
    for (int64_t m0 = 0; m0 < M; m0 += QM) {
        const int64_t mc = M - m0 < QM ? M - m0 : QM;
        for (int64_t n = n0; n < n1;) {
            float out[4 * QM];
            int64_t r = 1;
            if (fmt == 1) {
                const int8_t *q = (const int8_t *)data;
                Q_CASES(Q8_CALL)
            } else {
                const uint8_t *q = (const uint8_t *)data;
                Q_CASES(Q4_CALL)
            }
            for (int64_t i = 0; i < r; i++)
                for (int64_t m = 0; m < mc; m++) {
                    float *d = y + (m0 + m) * ldy + n + i;
                    *d = acc ? *d + out[i * mc + m] : out[i * mc + m];
                }
            n += r;
        }
    }
}

/* Sums of each row of x [M, K] over its 32-weight blocks: xsum [M, K / 32] (int4's offsets). */
static void block_sums_(const float *x, int64_t M, int64_t K, float *xsum) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.f;
            for (int j = 0; j < 32; j++) s += x[m * K + b * 32 + j];
            xsum[m * nb + b] = s;
        }
}

#define Q_BLOCK 16 /* weight rows per parallel task */

static void q_linear_(int64_t fmt, const float *x, const void *q, const _Float16 *scale,
                      const _Float16 *offset, const float *bias, float *y, int64_t M, int64_t N,
                      int64_t K, int64_t G, float *xsum, int nthreads) {
    if (fmt == 2) block_sums_(x, M, K, xsum);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K >= 65536)
    for (int64_t n0 = 0; n0 < N; n0 += Q_BLOCK) {
        const int64_t n1 = n0 + Q_BLOCK < N ? n0 + Q_BLOCK : N;
        q_rows_(fmt, G, q, scale, offset, x, xsum, M, K, n0, n1, y, N, 0);
        if (bias)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = n0; n < n1; n++) y[m * N + n] += bias[n];
    }
}

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
#define DQ_512 1 /* (GCC 12 turns the portable loops' byte-to-float conversions scalar) */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DQ_256 1 /* the same on AVX2 (the qwide tiles expand every weight at every step) */
#endif

/* Row n of a quantized [N, K] weight expanded into wr [K] fp32 (fmt 1: int8 in groups of G,
 * 2: int4 with offsets, groups of 32; the layouts of engine/quant/layouts.py). */
static inline void q_dequant_row_(int64_t fmt, int64_t G, const void *data,
                                  const _Float16 *scale, const _Float16 *offset, int64_t n,
                                  int64_t K, float *wr) {
    if (fmt == 1) {
        const int8_t *q = (const int8_t *)data + n * K;
        for (int64_t g0 = 0; g0 < K; g0 += G) {
            const float s = (float)scale[n * (K / G) + g0 / G];
#ifdef DQ_512
            const __m512 vs = _mm512_set1_ps(s); /* G a multiple of 16 (the layout's rule) */
            for (int64_t k = g0; k < g0 + G; k += 16)
                _mm512_storeu_ps(wr + k, _mm512_mul_ps(vs, _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k))))));
#elif defined(DQ_256)
            const __m256 vs = _mm256_set1_ps(s);
            for (int64_t k = g0; k < g0 + G; k += 8)
                _mm256_storeu_ps(wr + k, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k))))));
#else
#pragma omp simd
            for (int64_t k = g0; k < g0 + G; k++) wr[k] = (float)q[k] * s;
#endif
        }
        return;
    }
    const uint8_t *q = (const uint8_t *)data + n * (K / 2);
    const _Float16 *sc = scale + n * (K / 32), *of = offset + n * (K / 32);
    for (int64_t b = 0; b < K / 32; b++) {
        const float s = (float)sc[b], o = (float)of[b];
#ifdef DQ_512
        /* byte j of each half h (8 bytes): its low nibble is value 16 h + j, its high one
         * 16 h + 8 + j: one half's 8 bytes, low nibbles then high, are 16 values in order */
        const __m512 vs = _mm512_set1_ps(s), vo = _mm512_set1_ps(o);
        for (int h = 0; h < 2; h++) {
            const __m128i v = _mm_loadl_epi64((const __m128i *)(q + b * 16 + 8 * h));
            const __m128i lohi = _mm_and_si128(
                _mm_unpacklo_epi64(v, _mm_srli_epi16(v, 4)), _mm_set1_epi8(15));
            _mm512_storeu_ps(wr + b * 32 + 16 * h, _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lohi)), vs, vo));
        }
#elif defined(DQ_256)
        const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
        for (int h = 0; h < 2; h++) { /* as above, 8 values a vector */
            const __m128i v = _mm_loadl_epi64((const __m128i *)(q + b * 16 + 8 * h));
            const __m128i lohi = _mm_and_si128(
                _mm_unpacklo_epi64(v, _mm_srli_epi16(v, 4)), _mm_set1_epi8(15));
            _mm256_storeu_ps(wr + b * 32 + 16 * h, _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lohi)), vs, vo));
            _mm256_storeu_ps(wr + b * 32 + 16 * h + 8, _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lohi, 8))), vs, vo));
        }
#else
        for (int h = 0; h < 2; h++)
#pragma omp simd
            for (int j = 0; j < 8; j++) {
                const uint8_t v = q[b * 16 + 8 * h + j];
                wr[b * 32 + 16 * h + j] = (float)(v & 15) * s + o;
                wr[b * 32 + 16 * h + 8 + j] = (float)(v >> 4) * s + o;
            }
#endif
    }
}

/* w [N, K] fp32 = the quantized weight expanded (fmt 1: int8 in groups of G, 2: int4): the
 * "dequant" linear path's scratch weight, one pass (torch's unpack-and-scale ops took five). */
void q_dequantize(int64_t fmt, const void *data, const _Float16 *scale, const _Float16 *offset,
                  float *w, int64_t N, int64_t K, int64_t G, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) q_dequant_row_(fmt, G, data, scale, offset, n, K, w + n * K);
}

/* Weight rows n0 .. n0 + nr of a projection [N, K] as fp32 rows K apart, for the wide tiles:
 * fp32 weights (qfmt 0) in place; quantized ones (qfmt 1: int8 in groups of G, 2: int4)
 * expanded into buf (WIDE_NR x K floats, the calling thread's). The expansion is paid once
 * per tile and step and shared by every row of the batch in the lanes: from ~16 rows the
 * step is bound by multiplies, where the wide tiles' FMA rate beats the integer tiles' (a
 * vpdpbusd, a conversion and two scalings per 64 products: no more products an instruction
 * than an FMA's 16 on 64 lanes' worth). */
static inline const float *wide_src_(int64_t qfmt, int64_t G, const void *w,
                                     const _Float16 *sc, const _Float16 *off, int64_t n0,
                                     int64_t nr, int64_t K, float *buf) {
    if (!qfmt) return (const float *)w + n0 * K;
    for (int64_t r = 0; r < nr; r++) q_dequant_row_(qfmt, G, w, sc, off, n0 + r, K, buf + r * K);
    return buf;
}

int64_t qwide_linear_work_floats(int64_t M, int64_t K, int nthreads) {
    return wide_linear_work_floats(M, K, nthreads) + (int64_t)nthreads * WIDE_NR * K;
}

/* y [M, N] = x [M, K] W^T (+ bias) for a quantized W (fmt 1: int8 in groups of G, 2: int4) on
 * the wide tiles, each tile of WIDE_NR weight rows expanded to fp32 as it is reached (work:
 * qwide_linear_work_floats(M, K, nthreads) floats): wide_linear's speed at large M with the
 * quantized bytes read, and no [N, K] fp32 scratch (the "dequant" path writes one). */
void qwide_linear(int64_t fmt, const float *x, const void *q, const _Float16 *scale,
                  const _Float16 *offset, int64_t G, const float *bias, float *y, int64_t M,
                  int64_t N, int64_t K, float *work, int nthreads) {
    wide_linear_(fmt, G, x, q, scale, offset, bias, y, M, N, K, work, nthreads);
}

void q8_linear(const float *x, const int8_t *q, const _Float16 *scale, const float *bias,
               float *y, int64_t M, int64_t N, int64_t K, int64_t G, int nthreads) {
    q_linear_(1, x, q, scale, 0, bias, y, M, N, K, G, 0, nthreads);
}

void q4_linear(const float *x, const uint8_t *q, const _Float16 *scale, const _Float16 *offset,
               const float *bias, float *y, int64_t M, int64_t N, int64_t K, float *xsum,
               int nthreads) {
    q_linear_(2, x, q, scale, offset, bias, y, M, N, K, 32, xsum, nthreads);
}

/* ---- integer products: int8 activations x int8 / int4 weights ---------------------------------
 * From a few rows up a step's projections are bound by multiplies, not bytes, and the tiles
 * above convert every weight to a float for every tile of rows. Here the activations are
 * quantized too, per 32-value block like the weights (GGUF's Q8_0 for activations, as
 * llama.cpp does): d = max |x| / 127 over the block, q = round(x / d). One scale per row
 * was measured first and halved the default model's greedy agreement with fp32 (its
 * activations have outlier channels: a row's scale set by one left the rest a few levels).
 * Each block of each output is then an integer dot product (AVX-512 VNNI vpdpbusd: 64 byte
 * products an instruction; AVX2 vpmaddubsw + vpmaddwd) scaled by both blocks' scales:
 *   int8: y[m][n] = sum_b s[n][b] d[m][b] sum_{k in b} q[m][k] w[n][k]
 *   int4: y[m][n] = sum_b (s[n][b] d[m][b] sum_k q[m][k] w[n][k] + o[n][b] d[m][b] sum_k q[m][k])
 * Blocks are taken in pairs (64 weights: one zmm of int8 weights, 32 bytes of int4 ones).
 * VNNI multiplies unsigned bytes by signed ones: int4's nibbles are unsigned as they are;
 * int8 weights are flipped to w + 128 (one xor per weight vector), and the 128 * sum(q) this
 * adds to a lane is taken off by starting its sum at -128 * sum(q) (one more vpdpbusd per row
 * of q, shared by every weight row). AVX2 takes |w| and moves w's sign onto q.
 *
 * The quantized rows (QAct): KP = K rounded up to 64 bytes each, zero past K; int8 weights'
 * q in order, int4's in the order each pair of blocks (b, b + 1) unpacks to: the low nibbles
 * of both blocks' 32 bytes, then the high ones, i.e. 8-value runs 0, 2, 4, 6 (b: 0-7, 16-23;
 * b + 1: 0-7, 16-23), then 1, 3, 5, 7. d[m][b]; for int4 xsum[m][b] = d[m][b] * sum of q
 * over block b. Integer sums cannot overflow: a block's is at most 32 * 255 * 127 < 2^20. */
typedef struct {
    const uint8_t *q;  /* [M][KP] */
    const float *d;    /* [M][nb + 1]: a spare zero block past the last (an odd last pair) */
    const float *xsum; /* [M][nb + 1] (int4 weights) */
    /* AVX-512 VNNI only, per row and pair of blocks, 16 lanes each (KP / 64 per row): the
     * two blocks' d spread as the pair's lanes are (dv), and int8 weights' starting sums
     * (-128 * each lane's 4 q, cv): made once per row here rather than for every tile. */
    const float *dv;
    const int32_t *cv;
    int64_t KP, nb;
    /* for the AMX tiles (qa_rows_ below): every block's 32 q in the order its weights unpack
     * to (int8: as they are; int4: bytes 0-15's low nibbles, then their high ones, i.e.
     * values 0-7, 16-23, 8-15, 24-31), no dv / cv, and rows past M up to a multiple of 16
     * zero (q, d and xsum: a tile takes 16 rows) */
    int amx;
} QAct;

static inline int64_t qi_kp(int64_t K) { return (K + 63) / 64 * 64; }

/* rows a QAct of M rows holds: a multiple of 16 (AMX tiles take 16 rows at a time) */
static inline int64_t qi_rows_held(int64_t M) { return (M + 15) / 16 * 16; }

/* floats of scratch for a QAct of M rows of K */
static inline int64_t qi_act_floats(int64_t M, int64_t K) {
    return qi_rows_held(M) * (qi_kp(K) / 4 + 2 * (K / 32 + 1) + 2 * (qi_kp(K) / 64) * 16) + 16;
}

static int qa_on; /* AMX granted to this process (qa_enable) and built in */

/* amx: the AMX tiles' layout, where this process may run them (qa_enable), else the vector
 * tiles'. */
static inline QAct qi_act_at(float *work, int64_t M, int64_t K, int amx) {
    QAct a;
    a.KP = qi_kp(K);
    a.nb = K / 32;
    a.amx = amx && qa_on;
    M = qi_rows_held(M);
    const int64_t pv = M * (a.KP / 64) * 16;
    /* the vectors first, on a 64-byte boundary */
    float *v = (float *)(((uintptr_t)work + 63) & ~(uintptr_t)63);
    a.dv = v;
    a.cv = (const int32_t *)(v + pv);
    a.d = v + 2 * pv;
    a.xsum = a.d + M * (a.nb + 1);
    a.q = (const uint8_t *)(a.xsum + M * (a.nb + 1));
    return a;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QI_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QI_ISA 1
#else
#define QI_ISA 0
#endif

/* Row m of x [K] into a's row m (wfmt 1: for int8 weights, 2: int4); x NULL: a zero row
 * (the AMX layout's padding). */
static void qi_quantize_row_(int64_t wfmt, const float *x, int64_t K, QAct *a, int64_t m) {
    uint8_t *dst = (uint8_t *)a->q + m * a->KP;
    float *d = (float *)a->d + m * (a->nb + 1), *xs = (float *)a->xsum + m * (a->nb + 1);
    int8_t tmp[64];
    if (!x) {
        memset(dst, 0, a->KP);
        memset(d, 0, (a->nb + 1) * sizeof(float));
        memset(xs, 0, (a->nb + 1) * sizeof(float));
        return;
    }
    d[a->nb] = xs[a->nb] = 0.f;
    for (int64_t p = 0; p < a->KP; p += 64) {
        for (int h = 0; h < 2; h++) {
            const int64_t b = p / 32 + h;
            int8_t *t = tmp + 32 * h;
            if (b >= a->nb) {
                memset(t, 0, 32);
                continue;
            }
            const float *xb = x + 32 * b;
            float amax = 0.f;
#pragma omp simd reduction(max : amax)
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            d[b] = amax / 127.f;
#if QI_ISA == 2
            const __m512 vi = _mm512_set1_ps(inv);
            _mm_storeu_si128((__m128i *)t, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(
                _mm512_mul_ps(_mm512_loadu_ps(xb), vi))));
            _mm_storeu_si128((__m128i *)(t + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(
                _mm512_mul_ps(_mm512_loadu_ps(xb + 16), vi))));
#elif QI_ISA == 1
            { /* 32 rounded int32 packed to bytes (packs works within 128-bit halves: the
               * last permute puts the four 4-byte groups of each half back in order) */
                const __m256 vi = _mm256_set1_ps(inv);
                const __m256i a = _mm256_packs_epi32(
                    _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), vi)),
                    _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), vi)));
                const __m256i b = _mm256_packs_epi32(
                    _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16), vi)),
                    _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 24), vi)));
                _mm256_storeu_si256((__m256i *)t, _mm256_permutevar8x32_epi32(
                    _mm256_packs_epi16(a, b), _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0)));
            }
#else
            for (int j = 0; j < 32; j++) t[j] = (int8_t)lrintf(xb[j] * inv);
#endif
            if (wfmt == 2) {
                int s = 0;
                for (int j = 0; j < 32; j++) s += t[j];
                xs[b] = d[b] * (float)s;
            }
        }
        if (wfmt == 2 && a->amx) { /* each block's values 0-7, 16-23, 8-15, 24-31 */
            static const int run[8] = {0, 2, 1, 3, 4, 6, 5, 7};
            for (int c = 0; c < 8; c++) memcpy(dst + p + 8 * c, tmp + 8 * run[c], 8);
        } else if (wfmt == 2) { /* runs of 8 (the comment above) */
            static const int run[8] = {0, 2, 4, 6, 1, 3, 5, 7};
            for (int c = 0; c < 8; c++) memcpy(dst + p + 8 * c, tmp + 8 * run[c], 8);
        } else {
            memcpy(dst + p, tmp, 64);
        }
#if QI_ISA == 2
        if (!a->amx) {
            const int64_t pair = m * (a->KP / 64) + p / 64, b = p / 32;
            const __m512i idx = wfmt == 1
                ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
            const float d1 = b + 1 < a->nb ? d[b + 1] : 0.f;
            _mm512_store_ps((float *)a->dv + 16 * pair, _mm512_permutexvar_ps(
                idx, _mm512_castps128_ps512(_mm_set_ps(0.f, 0.f, d1, d[b]))));
            if (wfmt == 1) {
                const __m512i xv = _mm512_loadu_si512(dst + p);
                _mm512_store_si512((int32_t *)a->cv + 16 * pair, _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                        _mm512_set1_epi8((char)0x80), xv)));
            }
        }
#endif
    }
}

#if QI_ISA == 2
/* Two consecutive fp16 weight scales (one when `one`, the other lane 0) into 16 lanes as idx
 * places them. */
static inline __attribute__((always_inline)) __m512 qi_wscales_(const _Float16 *s, __m512i idx,
                                                                const int one) {
    uint32_t u = 0;
    memcpy(&u, s, one ? 2 : 4);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(
        _mm_cvtph_ps(_mm_cvtsi32_si128((int)u))));
}

/* Blocks b and b + 1 (b alone when `one`) of R weight rows (row r at wr[r], its scales at
 * sr[r]) against M rows of q (row m's bytes at xq[m], its vectors at dv[m] / cv[m]) into acc.
 * Every address is a row pointer plus b: the pointers are made once per tile, so the loop
 * carries no index arithmetic (it did, and ran ~1.5x slower). */
static inline __attribute__((always_inline)) void qi_pair_(
        const int wfmt, const uint8_t *const *wr, const _Float16 *const *sr, int64_t wrow,
        const uint8_t *const *xq, const float *const *dv, const int32_t *const *cv, int64_t b,
        const int one, const int R, const int M, __m512 acc[4][8]) {
    const __m512i idx = wfmt == 1
        ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
        : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i wv[4];
    __m512 s[4];
    for (int r = 0; r < R; r++) {
        if (wfmt == 1) {
            const uint8_t *p = wr[r] + 32 * b;
            _mm_prefetch((const char *)(p + R * wrow), _MM_HINT_T0);
            const __m512i v = one ? _mm512_maskz_loadu_epi8(0xffffffffull, p)
                                  : _mm512_loadu_si512(p);
            wv[r] = _mm512_xor_si512(v, flip); /* w + 128, unsigned */
        } else {
            const uint8_t *p = wr[r] + 16 * b;
            if (!(b & 3)) _mm_prefetch((const char *)(p + R * wrow), _MM_HINT_T0);
            const __m256i v = one ? _mm256_maskz_loadu_epi8(0xffff, p)
                                  : _mm256_loadu_si256((const __m256i *)p);
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            wv[r] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        s[r] = qi_wscales_(sr[r] + b, idx, one);
    }
    for (int m = 0; m < M; m++) {
        const __m512i xv = _mm512_loadu_si512(xq[m] + 32 * b);
        const __m512 dx = _mm512_load_ps(dv[m] + 8 * b);
        /* int8: each lane's sum starts at -128 * (its 4 q), undoing the weights' + 128 */
        const __m512i start = wfmt == 1 ? _mm512_load_si512(cv[m] + 8 * b)
                                        : _mm512_setzero_si512();
        for (int r = 0; r < R; r++) {
            const __m512i dot = _mm512_dpbusd_epi32(start, wv[r], xv);
            acc[r][m] = _mm512_fmadd_ps(_mm512_mul_ps(s[r], dx), _mm512_cvtepi32_ps(dot),
                                        acc[r][m]);
        }
    }
}

/* R weight rows (int8: row r at w + r * K bytes; int4: w + r * K / 2) against rows m0 ..
 * m0 + M - 1 of a: out[r * M + m] = y for those rows (the comment above). wfmt, R and M are
 * constants where this is inlined, so acc lives in registers. */
static inline __attribute__((always_inline)) void qi_tile_(
        const int wfmt, const void *w, const _Float16 *sc, const _Float16 *off, const QAct *a,
        int64_t m0, const int R, const int M, int64_t K, float *out) {
    const int64_t nb = K / 32;
    const int64_t wrow = wfmt == 1 ? K : K / 2, pairs = a->KP / 64;
    __m512 acc[4][8];
    const uint8_t *wr[4], *xq[8];
    const _Float16 *sr[4];
    const float *dv[8];
    const int32_t *cv[8];
    for (int r = 0; r < R; r++) {
        wr[r] = (const uint8_t *)w + r * wrow;
        sr[r] = sc + r * nb;
        for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
    }
    for (int m = 0; m < M; m++) {
        xq[m] = a->q + (m0 + m) * a->KP;
        dv[m] = a->dv + (m0 + m) * pairs * 16;
        cv[m] = a->cv + (m0 + m) * pairs * 16;
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2)
        qi_pair_(wfmt, wr, sr, wrow, xq, dv, cv, b, 0, R, M, acc);
    if (b < nb)
        qi_pair_(wfmt, wr, sr, wrow, xq, dv, cv, b, 1, R, M, acc);
    if (wfmt == 2) /* offsets: sum_b o[r][b] * xsum[m][b], 16 blocks a vector */
        for (int64_t c = 0; c < nb; c += 16) {
            const __mmask16 k = nb - c >= 16 ? 0xffff : (__mmask16)((1u << (nb - c)) - 1);
            for (int r = 0; r < R; r++) {
                const __m512 o = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, off + r * nb + c));
                for (int m = 0; m < M; m++)
                    acc[r][m] = _mm512_fmadd_ps(
                        o, _mm512_maskz_loadu_ps(k, a->xsum + (m0 + m) * (nb + 1) + c),
                        acc[r][m]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r * M + m] = _mm512_reduce_add_ps(acc[r][m]);
}
/* Tiles: up to 4 weight rows x 4 rows of q; from 5 rows of q, 2 x 8 (each weight vector's
 * unpacking and scales then serve 8 rows: ~15% fewer instructions a product at 32 rows). */
#define QI_R 4
#define QI_WIDE 1
#elif QI_ISA == 1
/* AVX2 has no dot-product instruction: vpmaddubsw multiplies unsigned by signed bytes into
 * int16 pairs and vpmaddwd sums those into int32 quads. */

/* int8 weights, a block at a time: |w| unsigned, w's sign moved onto q (pairs stay under
 * 2 * 127 * 127 < 2^15: no saturation). R weight rows x M rows of q (R * M <= 8). */
static inline __attribute__((always_inline)) void qi_tile8_(
        const int8_t *w, const _Float16 *sc, const QAct *a, int64_t m0, const int R,
        const int M, int64_t K, float *out) {
    const int64_t nb = K / 32, wrow = K;
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        __m256i aw[2], sw[2];
        __m256 s[2];
        for (int r = 0; r < R; r++) {
            const int8_t *p = w + r * wrow + 32 * b;
            if (!(b & 1)) _mm_prefetch((const char *)(p + R * wrow), _MM_HINT_T0);
            sw[r] = _mm256_loadu_si256((const __m256i *)p);
            aw[r] = _mm256_sign_epi8(sw[r], sw[r]);
            s[r] = _mm256_set1_ps((float)sc[r * nb + b]);
        }
        for (int m = 0; m < M; m++) {
            const __m256i xv = _mm256_loadu_si256(
                (const __m256i *)(a->q + (m0 + m) * a->KP + 32 * b));
            const __m256 dx = _mm256_set1_ps(a->d[(m0 + m) * (nb + 1) + b]);
            for (int r = 0; r < R; r++) {
                const __m256i dot = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xv, sw[r])), ones);
                acc[r][m] = _mm256_fmadd_ps(_mm256_mul_ps(s[r], dx),
                                            _mm256_cvtepi32_ps(dot), acc[r][m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r * M + m] = hsum8_(acc[r][m]);
}

/* int4: one pair of blocks of a weight row against one row of q (the unsigned nibbles
 * against q as it is: 2 * 15 * 127 a pair, and the low and high halves' sums added in int16,
 * under 2^13). Lanes 0-3: block b's sums, 4-7: block b + 1's. */
static inline __attribute__((always_inline)) __m256i qi_pair4_(__m256i lo, __m256i hi,
                                                              const uint8_t *x, __m256i ones) {
    return _mm256_madd_epi16(_mm256_add_epi16(
        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32)))), ones);
}

/* int4 weights, four blocks a step: two pairs' int32 sums folded by one vphaddd into one
 * vector (lanes 0,1: block b; 2,3: b + 2; 4,5: b + 1; 6,7: b + 3), then one conversion and
 * one FMA against the four blocks' scales (weight x q, converted and multiplied four at a
 * time) laid out alike. A pair a step with each block's scale converted and broadcast on its
 * own ran ~3x slower on an AMD EPYC (Zen 3): the default model's int4 projections at one row
 * 7.4 -> 2.5 ms, cold weights (docs/history/2026-12-06-wave-4.md). The offsets (sum_b
 * o[r][b] * xsum[m][b]) go four blocks a step into the low lanes of the same accumulators
 * (one FMA whose upper lanes are zero: a second set of accumulators spilled registers at 4
 * rows of q). The last nb % 4 blocks go one at a time, a block b alone in its pair's half
 * (the other half's weights read as zero). */
static inline __attribute__((always_inline)) void qi_tile4_(
        const uint8_t *w, const _Float16 *sc, const _Float16 *off, const QAct *a, int64_t m0,
        const int R, const int M, int64_t K, float *out) {
    const int64_t nb = K / 32, wrow = K / 2;
    __m256 acc[4][4];
    const uint8_t *xq[4];
    const float *dm[4], *xsm[4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        xq[m] = a->q + (m0 + m) * a->KP;
        dm[m] = a->d + (m0 + m) * (nb + 1);
        xsm[m] = a->xsum + (m0 + m) * (nb + 1);
    }
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i lanes = _mm256_set_epi32(3, 3, 1, 1, 2, 2, 0, 0);
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        for (int r = 0; r < R; r++) {
            const uint8_t *p = w + r * wrow + 16 * b;
            _mm_prefetch((const char *)(p + R * wrow), _MM_HINT_T0);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)p);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
            const __m256i lo0 = _mm256_and_si256(v0, low4);
            const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
            const __m256i lo1 = _mm256_and_si256(v1, low4);
            const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
            const __m128 ws = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + r * nb + b)));
            const __m128 os = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(off + r * nb + b)));
            for (int m = 0; m < M; m++) {
                const uint8_t *x = xq[m] + 32 * b;
                const __m256i s = _mm256_hadd_epi32(qi_pair4_(lo0, hi0, x, ones),
                                                    qi_pair4_(lo1, hi1, x + 64, ones));
                const __m128 c = _mm_mul_ps(ws, _mm_loadu_ps(dm[m] + b));
                acc[r][m] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(s),
                    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(c), lanes), acc[r][m]);
                /* the offsets in the upper lanes' zeros (one FMA on four lanes) */
                acc[r][m] = _mm256_fmadd_ps(_mm256_zextps128_ps256(os),
                                            _mm256_zextps128_ps256(_mm_loadu_ps(xsm[m] + b)),
                                            acc[r][m]);
            }
        }
    }
    for (; b < nb; b++) {
        /* block b's 16 bytes as its pair's low or high half: the pair's q has block b's
         * values in lanes 0-15 (b even) or 16-31 (b odd) of both halves */
        for (int r = 0; r < R; r++) {
            const __m256i v = _mm256_zextsi128_si256(
                _mm_loadu_si128((const __m128i *)(w + r * wrow + 16 * b)));
            __m256i lo = _mm256_and_si256(v, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if (b & 1) {
                lo = _mm256_permute2x128_si256(lo, lo, 0x08);
                hi = _mm256_permute2x128_si256(hi, hi, 0x08);
            }
            const float s = (float)sc[r * nb + b], o = (float)off[r * nb + b];
            for (int m = 0; m < M; m++) {
                const uint8_t *x = xq[m] + 32 * (b & ~(int64_t)1);
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi_pair4_(lo, hi, x, ones)),
                                            _mm256_set1_ps(s * dm[m][b]), acc[r][m]);
                acc[r][m] = _mm256_add_ps(acc[r][m],
                                          _mm256_zextps128_ps256(_mm_set_ss(o * xsm[m][b])));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) out[r * M + m] = hsum8_(acc[r][m]);
}

/* R weight rows x M rows of q; wfmt, R and M constants where inlined. */
static inline __attribute__((always_inline)) void qi_tile_(
        const int wfmt, const void *w, const _Float16 *sc, const _Float16 *off, const QAct *a,
        int64_t m0, const int R, const int M, int64_t K, float *out) {
    if (wfmt == 1) qi_tile8_((const int8_t *)w, sc, a, m0, R, M, K, out);
    else qi_tile4_((const uint8_t *)w, sc, off, a, m0, R, M, K, out);
}
/* Tiles: int8 2 weight rows x up to 4 rows of q; int4 4 x 1-2, 2 x 3-4 (at most 8
 * accumulators: more spilled to the stack). */
#define QI_RM(F, MC) ((F) == 1 || (MC) > 2 ? 2 : 4)
#else
/* Portable twin (correct, not fast). */
static inline void qi_tile_(const int wfmt, const void *w, const _Float16 *sc,
                            const _Float16 *off, const QAct *a, int64_t m0, const int R,
                            const int M, int64_t K, float *out) {
    static const int run[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    const int64_t nb = K / 32;
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) {
            const uint8_t *xq = a->q + (m0 + m) * a->KP;
            const float *d = a->d + (m0 + m) * (nb + 1), *xs = a->xsum + (m0 + m) * (nb + 1);
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int k = 0; k < 32; k++) {
                    int wk, xk;
                    if (wfmt == 1) {
                        wk = ((const int8_t *)w)[r * K + 32 * b + k];
                        xk = (int8_t)xq[32 * b + k];
                    } else { /* weight k of block b: nibble (k / 8) % 2 of byte 8 (k / 16) + k % 8 */
                        const uint8_t byte = ((const uint8_t *)w)[r * (K / 2) + 16 * b + 8 * (k / 16) + k % 8];
                        wk = (k / 8) % 2 ? byte >> 4 : byte & 15;
                        /* where q's pair order put value k of block b */
                        const int run8 = 4 * (int)(b % 2) + k / 8;
                        int pos = 0;
                        for (int c = 0; c < 8; c++)
                            if (run[c] == run8) pos = c;
                        xk = (int8_t)xq[64 * (b / 2) + 8 * pos + k % 8];
                    }
                    dot += wk * xk;
                }
                acc += (float)sc[r * nb + b] * d[b] * (float)dot;
                if (wfmt == 2) acc += (float)off[r * nb + b] * xs[b];
            }
            out[r * M + m] = acc;
        }
}
#define QI_R 1
#endif

/* AMX tiles for the integer products (hosts with amx_tile / amx_int8, once Linux has granted
 * the process the tile state: qa_enable). A tile multiply (tdpbssd) takes 16 rows of q x 32
 * values (one block of each row) against the 32 values of one block of 16 weight rows and
 * leaves 16 x 16 int32 sums: 8,192 products an instruction, against 64 for vpdpbusd. Each
 * block's sums are then scaled as the vector tiles' are (the weights' and the rows' scales)
 * and added into 16 x 16 fp32 accumulators: 48 vector instructions per 8,192 products.
 *
 * Weights stay in their row layout (the vector tiles' and the dequant paths' too): a tile's
 * operand B needs 16 weight rows' block interleaved by 4 values, so each 16-row task first
 * packs its rows for the whole input (qa_pack_: an 8 x 8 transpose of 4-byte groups in each
 * half of 8 vectors a block; int4 unpacked to bytes first) and their scales, then runs every
 * 16 rows of q against them. The packing is paid once per 16 weight rows and step, shared by
 * the batch's rows: worth it from ~8 rows (the tuner times it against the vector tiles per
 * batch bucket).
 *
 * Integer sums cannot overflow: a block's is at most 32 * 127 * 127 < 2^19. */
#if QI_ISA == 2 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* ldtilecfg's 64 bytes */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) QaConfig;

/* tiles 0-1: sums (16 x 16 int32), 2-3: q (16 rows x 32 bytes), 4-5: weights (8 x 64 bytes:
 * 16 rows x 4 values a row of the tile); two of each so that one block's multiply overlaps
 * the previous block's scaling. Loaded by every call: tile configuration is per thread, and
 * another library may have changed it. */
static inline void qa_config_(void) {
    QaConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) {
        c.rows[t] = 16, c.colsb[t] = 64;
        c.rows[2 + t] = 16, c.colsb[2 + t] = 32;
        c.rows[4 + t] = 8, c.colsb[4 + t] = 64;
    }
    _tile_loadconfig(&c);
}

/* floats of one thread's packing scratch for inputs of K (qa_rows_' pack) */
static inline int64_t qa_pack_floats(int64_t K) {
    return (K / 32) * (128 + 32) + 512 + 16 * ((K / 32 + 15) / 16 * 16) + 16;
}

/* 16 weight rows (row r at w + r * wrow bytes, scales sc + r * nb, offsets off + r * nb) into
 * B (block b's operand at B + 512 b: 8 rows of 16 weight rows' 4 values), S and O (block b's
 * 16 scales and offsets at 16 b, as floats); T: 16 * (nb rounded up to 16) floats of
 * scratch. */
static void qa_pack_(const int wfmt, const void *w, const _Float16 *sc, const _Float16 *off,
                     int64_t K, uint8_t *B, float *S, float *O, float *T) {
    const int64_t nb = K / 32, wrow = wfmt == 1 ? K : K / 2;
    const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        /* z[j]: row j's 8 groups of 4 values, then row j + 8's */
        __m512i z[8], t[8], u[8];
        for (int j = 0; j < 8; j++) {
            if (wfmt == 1) {
                const uint8_t *p = (const uint8_t *)w + j * wrow + 32 * b;
                if (!(b & 1)) { /* a line holds 2 blocks: 8 blocks ahead */
                    _mm_prefetch((const char *)(p + 256), _MM_HINT_T0);
                    _mm_prefetch((const char *)(p + 8 * wrow + 256), _MM_HINT_T0);
                }
                z[j] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                    _mm256_loadu_si256((const __m256i *)(p + 8 * wrow)), 1);
            } else { /* 16 bytes: low nibbles (values 0-15 of the order), then high ones */
                const uint8_t *p = (const uint8_t *)w + j * wrow + 16 * b;
                if (!(b & 3)) { /* a line holds 4 blocks: 8 ahead */
                    _mm_prefetch((const char *)(p + 128), _MM_HINT_T0);
                    _mm_prefetch((const char *)(p + 8 * wrow + 128), _MM_HINT_T0);
                }
                const __m512i v = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_broadcastsi128_si256(
                        _mm_loadu_si128((const __m128i *)p))),
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 8 * wrow))),
                    1);
                z[j] = _mm512_and_si512(_mm512_srlv_epi64(v, shift), low4);
            }
        }
        for (int j = 0; j < 4; j++) {
            t[2 * j] = _mm512_unpacklo_epi32(z[2 * j], z[2 * j + 1]);
            t[2 * j + 1] = _mm512_unpackhi_epi32(z[2 * j], z[2 * j + 1]);
        }
        /* u[g], g < 4: group g (lanes 0, 2) and g + 4 (lanes 1, 3) of rows 0-3 / 8-11;
         * u[4 + g]: of rows 4-7 / 12-15 */
        for (int h = 0; h < 2; h++) {
            u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
            u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
            u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
            u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
        }
        uint8_t *dst = B + 512 * b;
        for (int g = 0; g < 4; g++) {
            const __m512i lo = _mm512_shuffle_i32x4(u[g], u[4 + g], _MM_SHUFFLE(2, 0, 2, 0));
            const __m512i hi = _mm512_shuffle_i32x4(u[g], u[4 + g], _MM_SHUFFLE(3, 1, 3, 1));
            _mm512_store_si512(dst + 64 * g, _mm512_shuffle_i32x4(lo, lo, _MM_SHUFFLE(3, 1, 2, 0)));
            _mm512_store_si512(dst + 64 * (g + 4),
                               _mm512_shuffle_i32x4(hi, hi, _MM_SHUFFLE(3, 1, 2, 0)));
        }
    }
    /* scales (and offsets): each row's into T as floats, then a block's 16 gathered */
    const int64_t nbp = (nb + 15) / 16 * 16;
    for (int k = 0; k < (wfmt == 2 ? 2 : 1); k++) {
        const _Float16 *src = k ? off : sc;
        float *dst = k ? O : S;
        for (int r = 0; r < 16; r++)
            for (int64_t c = 0; c < nb; c += 16) {
                const __mmask16 mk = nb - c >= 16 ? 0xffff : (__mmask16)((1u << (nb - c)) - 1);
                _mm512_store_ps(T + r * nbp + c, _mm512_cvtph_ps(
                    _mm256_maskz_loadu_epi16(mk, src + r * nb + c)));
            }
        const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32((int)nbp));
        for (int64_t b = 0; b < nb; b++)
            _mm512_store_ps(dst + 16 * b, _mm512_i32gather_ps(idx, T + b, 4));
    }
}

/* Block b's multiply on tile set T (0 or 1: tiles T, 2 + T, 4 + T, spelled out: the tile
 * intrinsics take literal tile numbers): its sums into cb + 256 T. */
#define QA_MUL(C, QT, WT, T, b)                                                              \
    do {                                                                                     \
        _tile_loadd(QT, A + 32 * (b), a->KP);                                                \
        _tile_loadd(WT, B + 512 * (b), 64);                                                  \
        _tile_zero(C);                                                                       \
        _tile_dpbssd(C, QT, WT);                                                             \
        _tile_stored(C, cb + 256 * (T), 64);                                                 \
    } while (0)
#define QA_MUL0(b) QA_MUL(0, 2, 4, 0, b)
#define QA_MUL1(b) QA_MUL(1, 3, 5, 1, b)

/* The packed 16 weight rows against every row of a: y[m * ldy + j] (+ y when acc) for
 * m < M, j < 16. cb: 512 int32 of scratch (64-byte aligned). */
static void qa_tile16_(const int wfmt, const QAct *a, int64_t M, int64_t K, const uint8_t *B,
                       const float *S, const float *O, int32_t *cb, float *y, int64_t ldy,
                       int acc) {
    const int64_t nb = K / 32, ld = nb + 1;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const uint8_t *A = a->q + m0 * a->KP;
        const float *d = a->d + m0 * ld, *xs = a->xsum + m0 * ld;
        __m512 c[16];
        for (int i = 0; i < 16; i++) c[i] = _mm512_setzero_ps();
        QA_MUL0(0);
        for (int64_t b = 0; b < nb; b++) {
            if (b + 1 < nb) { /* the next block's multiply runs while this one's is scaled */
                if ((b + 1) & 1) QA_MUL1(b + 1);
                else QA_MUL0(b + 1);
            }
            const int32_t *s32 = cb + 256 * (b & 1);
            const __m512 sv = _mm512_load_ps(S + 16 * b);
            for (int i = 0; i < 16; i++)
                c[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s32 + 16 * i)),
                                       _mm512_mul_ps(sv, _mm512_set1_ps(d[i * ld + b])), c[i]);
            if (wfmt == 2) {
                const __m512 ov = _mm512_load_ps(O + 16 * b);
                for (int i = 0; i < 16; i++)
                    c[i] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xs[i * ld + b]), c[i]);
            }
        }
        const int64_t rows = M - m0 < 16 ? M - m0 : 16;
        for (int64_t i = 0; i < rows; i++) {
            float *dst = y + (m0 + i) * ldy;
            _mm512_storeu_ps(dst, acc ? _mm512_add_ps(c[i], _mm512_loadu_ps(dst)) : c[i]);
        }
    }
}
#undef QA_MUL
#undef QA_MUL0
#undef QA_MUL1

/* Weight rows that do not fill 16 (n0 <= n < n1), in the AMX layout, one product at a time. */
static void qa_rest_(const int wfmt, const void *w, const _Float16 *sc, const _Float16 *off,
                     const QAct *a, int64_t M, int64_t K, int64_t n0, int64_t n1, float *y,
                     int64_t ldy, int acc) {
    const int64_t nb = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            const int8_t *xq = (const int8_t *)a->q + m * a->KP;
            const float *d = a->d + m * (nb + 1), *xs = a->xsum + m * (nb + 1);
            float sum = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int dot = 0;
                for (int k = 0; k < 32; k++) {
                    int wk;
                    if (wfmt == 1) {
                        wk = ((const int8_t *)w)[n * K + 32 * b + k];
                    } else {
                        const uint8_t byte = ((const uint8_t *)w)[n * (K / 2) + 16 * b + (k & 15)];
                        wk = k < 16 ? byte & 15 : byte >> 4;
                    }
                    dot += wk * xq[32 * b + k];
                }
                sum += (float)sc[n * nb + b] * d[b] * (float)dot;
                if (wfmt == 2) sum += (float)off[n * nb + b] * xs[b];
            }
            float *dst = y + m * ldy + n;
            *dst = acc ? *dst + sum : sum;
        }
}

/* qi_rows_ on the AMX tiles (a in their layout); pack: qa_pack_floats(K) of this thread's. */
static void qa_rows_(int64_t wfmt, const void *data, const _Float16 *scale,
                     const _Float16 *offset, const QAct *a, int64_t M, int64_t K, int64_t n0,
                     int64_t n1, float *y, int64_t ldy, int acc, float *pack) {
    const int64_t nb = K / 32, wrow = wfmt == 1 ? K : K / 2;
    uint8_t *B = (uint8_t *)(((uintptr_t)pack + 63) & ~(uintptr_t)63);
    float *S = (float *)(B + 512 * nb), *O = S + 16 * nb;
    int32_t *cb = (int32_t *)(O + 16 * nb);
    float *T = (float *)(cb + 512);
    int64_t n = n0;
    if (n + 16 <= n1) qa_config_();
    for (; n + 16 <= n1; n += 16) {
        qa_pack_(wfmt, (const uint8_t *)data + n * wrow, scale + n * nb,
                 wfmt == 2 ? offset + n * nb : 0, K, B, S, O, T);
        qa_tile16_(wfmt, a, M, K, B, S, O, cb, y + n, ldy, acc);
    }
    if (n < n1) qa_rest_(wfmt, data, scale, offset, a, M, K, n, n1, y, ldy, acc);
}
#else
static inline int64_t qa_pack_floats(int64_t K) { (void)K; return 0; }
#endif

/* Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA):
 * without it a tile instruction raises SIGILL even where the CPU lists AMX. 1 when this
 * process may now run the AMX tiles (and this build holds them), else 0. */
int qa_enable(void) {
#ifdef QA_AMX
    if (!qa_on && syscall(SYS_arch_prctl, 0x1023, 18) == 0) qa_on = 1;
#endif
    return qa_on;
}

/* y[m * ldy + n] (+ y when acc) for the weight rows n0 <= n < n1 (wfmt 1: int8, 2: int4, in
 * groups of 32) against every row of a. */
#ifndef QI_RM
#define QI_RM(F, MC) QI_R /* weight rows a tile takes (wfmt F, MC rows of q; AVX2 above) */
#endif
#define QI_CASE(F, MC)                                                                       \
    if (r == QI_RM(F, MC)) qi_tile_(F, wn, sc, off, a, m0, QI_RM(F, MC), MC, K, out);        \
    else qi_tile_(F, wn, sc, off, a, m0, 1, MC, K, out);
#define QI_SWITCH(F)                                                                         \
    switch (mc) {                                                                            \
    case 1: QI_CASE(F, 1) break;                                                             \
    case 2: QI_CASE(F, 2) break;                                                             \
    case 3: QI_CASE(F, 3) break;                                                             \
    default: QI_CASE(F, 4) break;                                                            \
    }
#ifdef QI_WIDE
#define QI_CASE8(F, MC)                                                                      \
    if (r == 2) qi_tile_(F, wn, sc, off, a, m0, 2, MC, K, out);                              \
    else qi_tile_(F, wn, sc, off, a, m0, 1, MC, K, out);
#define QI_SWITCH8(F)                                                                        \
    switch (mc) {                                                                            \
    case 5: QI_CASE8(F, 5) break;                                                            \
    case 6: QI_CASE8(F, 6) break;                                                            \
    case 7: QI_CASE8(F, 7) break;                                                            \
    default: QI_CASE8(F, 8) break;                                                           \
    }
#endif
static void qi_rows_(int64_t wfmt, const void *data, const _Float16 *scale,
                     const _Float16 *offset, const QAct *a, int64_t M, int64_t K, int64_t n0,
                     int64_t n1, float *y, int64_t ldy, int acc, float *pack) {
#ifdef QA_AMX
    if (a->amx) { /* the AMX tiles */
        qa_rows_(wfmt, data, scale, offset, a, M, K, n0, n1, y, ldy, acc, pack);
        return;
    }
#endif
    (void)pack;
    const int64_t nb = K / 32, wrow = wfmt == 1 ? K : K / 2;
#ifdef QI_WIDE
    const int64_t chunk = M >= 5 ? 8 : QM;
#else
    const int64_t chunk = QM;
#endif
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        for (int64_t n = n0; n < n1;) {
            float out[4 * 8];
            const void *wn = (const uint8_t *)data + n * wrow;
            const _Float16 *sc = scale + n * nb, *off = wfmt == 2 ? offset + n * nb : 0;
            int64_t r;
#ifdef QI_WIDE
            if (mc > QM) {
                r = n + 2 <= n1 ? 2 : 1;
                if (wfmt == 1) QI_SWITCH8(1) else QI_SWITCH8(2)
            } else
#endif
            {
                const int64_t rt = QI_RM(wfmt, mc);
                r = n + rt <= n1 ? rt : 1;
                if (wfmt == 1) QI_SWITCH(1) else QI_SWITCH(2)
            }
            for (int64_t i = 0; i < r; i++)
                for (int64_t m = 0; m < mc; m++) {
                    float *dst = y + (m0 + m) * ldy + n + i;
                    *dst = acc ? *dst + out[i * mc + m] : out[i * mc + m];
                }
            n += r;
        }
    }
}

int64_t qi_linear_work_floats(int64_t M, int64_t K, int nthreads) {
    return qi_act_floats(M, K) + (int64_t)nthreads * qa_pack_floats(K);
}

/* Which integer-product code this build holds: 2 AVX-512 VNNI, 1 AVX2, 0 portable. */
int qi_isa(void) { return QI_ISA; }

/* Gives this thread's tiles back (their state then costs nothing on a context switch). */
static inline void qa_release_(const QAct *a) {
#ifdef QA_AMX
    if (a->amx) _tile_release();
#else
    (void)a;
#endif
}

static void qi_linear_(int64_t wfmt, const float *x, const void *q, const _Float16 *scale,
                       const _Float16 *offset, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, float *work, int nthreads, int amx) {
    QAct a = qi_act_at(work, M, K, amx);
    const int64_t rows = a.amx ? qi_rows_held(M) : M;
    float *packs = work + qi_act_floats(M, K);
#pragma omp parallel num_threads(nthreads) if (N * K >= 65536)
    {
        float *pack = packs + omp_get_thread_num() * qa_pack_floats(K);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++) qi_quantize_row_(wfmt, m < M ? x + m * K : 0, K, &a, m);
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += Q_BLOCK) {
            const int64_t n1 = n0 + Q_BLOCK < N ? n0 + Q_BLOCK : N;
            qi_rows_(wfmt, q, scale, offset, &a, M, K, n0, n1, y, N, 0, pack);
            if (bias)
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = n0; n < n1; n++) y[m * N + n] += bias[n];
        }
        qa_release_(&a);
    }
}

/* y [M, N] = x [M, K] W^T (+ bias) for a quantized W (wfmt 1: int8 in groups of 32; 2: int4
 * with offsets), the activations quantized first (work: qi_linear_work_floats(M, K,
 * nthreads) floats). K a multiple of 32. */
void qi_linear(int64_t wfmt, const float *x, const void *q, const _Float16 *scale,
               const _Float16 *offset, const float *bias, float *y, int64_t M, int64_t N,
               int64_t K, float *work, int nthreads) {
    qi_linear_(wfmt, x, q, scale, offset, bias, y, M, N, K, work, nthreads, 0);
}

/* qi_linear on the AMX tiles where qa_enable granted them (else the same as qi_linear). */
void qa_linear(int64_t wfmt, const float *x, const void *q, const _Float16 *scale,
               const _Float16 *offset, const float *bias, float *y, int64_t M, int64_t N,
               int64_t K, float *work, int nthreads) {
    qi_linear_(wfmt, x, q, scale, offset, bias, y, M, N, K, work, nthreads, 1);
}

/* ---- panels: integer products with 16 weight rows in the vector lanes -------------------------
 * The integer tiles above (qi_tile_) put 64 values of one weight row in a vector: each product
 * of a block pair with a row of q then costs a vpdpbusd, a conversion and two scalings, and the
 * output ends in a horizontal sum: no more products an instruction than fp32's FMA (16 on 64
 * lanes' worth), so from ~16 rows, where the multiplies bound a step, they lost to the wide
 * tiles. Here the weights are repacked once, at load, into panels of 16 rows: per block of 32
 * values, 8 vectors of 16 rows x 4 consecutive values, then the 16 rows' scales (fp32) and
 * their "-128 x sum of the block's weights" (int32: vpdpbusd multiplies unsigned bytes by
 * signed ones, so q enters as q + 128): 640 bytes, 64-byte aligned, 1.18x the row layout's.
 * int4: 4 vectors, quad v in the low nibbles and quad v + 4 in the high ones (the nibbles are
 * the unsigned operand, q the signed one: no correction), then the scales and offsets (fp16):
 * 320 bytes, the row layout's. A block of a panel against a row of q is then 8 vpdpbusd
 * with 4 of q's bytes broadcast, and one conversion and one scaling for 16 outputs (int4: one
 * more FMA for the offsets): ~3x the products an instruction, and the 16 outputs land in
 * order, no horizontal sums. Tiles: 2 panels x 6 rows (int8) or 4 (int4) of q.
 * AVX-512 VNNI only (QI_ISA 2). */
#if QI_ISA == 2
#define QR_ON 1
static inline int64_t qr_data_bytes(int wfmt) { return wfmt == 1 ? 512 : 256; }
static inline int64_t qr_block_bytes(int wfmt) { return wfmt == 1 ? 640 : 320; }
#endif

/* Bytes of the panels of an [N, K] weight (0: not built for this host). */
int64_t qr_bytes(int64_t wfmt, int64_t N, int64_t K) {
#ifdef QR_ON
    return (N + 15) / 16 * (K / 32) * qr_block_bytes((int)wfmt);
#else
    (void)wfmt; (void)N; (void)K;
    return 0;
#endif
}

/* The panels of a quantized [N, K] weight in its row layout (wfmt 1: int8 in groups of 32,
 * 2: int4), into out (qr_bytes; 64-byte aligned). Rows past N read as zero. */
void qr_pack(int64_t wfmt, const void *data, const _Float16 *scale, const _Float16 *offset,
             int64_t N, int64_t K, uint8_t *out, int nthreads) {
#ifdef QR_ON
    const int64_t nb = K / 32, PB = qr_block_bytes((int)wfmt), DB = qr_data_bytes((int)wfmt);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < (N + 15) / 16; p++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = out + (p * nb + b) * PB;
            float *sc = (float *)(blk + DB);
            int32_t *corr = (int32_t *)(sc + 16);
            _Float16 *sh = (_Float16 *)(blk + DB), *oh = sh + 16;
            memset(blk, 0, PB);
            for (int r = 0; r < 16; r++) {
                const int64_t n = 16 * p + r;
                int w[32] = {0};
                if (n >= N) continue;
                for (int k = 0; k < 32; k++) {
                    if (wfmt == 1) {
                        w[k] = ((const int8_t *)data)[n * K + 32 * b + k];
                    } else {
                        const uint8_t byte = ((const uint8_t *)data)[n * (K / 2) + 16 * b
                                                                     + 8 * (k / 16) + k % 8];
                        w[k] = (k / 8) % 2 ? byte >> 4 : byte & 15;
                    }
                }
                int sum = 0;
                for (int k = 0; k < 32; k++) sum += w[k];
                if (wfmt == 1) {
                    corr[r] = -128 * sum;
                    sc[r] = (float)scale[n * nb + b];
                } else {
                    sh[r] = scale[n * nb + b];
                    oh[r] = offset[n * nb + b];
                }
                for (int q = 0; q < (wfmt == 1 ? 8 : 4); q++)
                    for (int j = 0; j < 4; j++)
                        blk[q * 64 + r * 4 + j] = wfmt == 1
                            ? (uint8_t)(int8_t)w[4 * q + j]
                            : (uint8_t)(w[4 * q + j] | (w[4 * (q + 4) + j] << 4));
            }
        }
#else
    (void)wfmt; (void)data; (void)scale; (void)offset; (void)N; (void)K; (void)out;
    (void)nthreads;
#endif
}

#ifdef QR_ON
/* The panels' activations: row x [K] as bytes q (q = round(x / d) per block of 32, d = max |x|
 * / 127, as qi_quantize_row_; for int8 weights q + 128, the unsigned operand), d[b], and
 * xs[b] = d[b] * sum of the block's q (int4's offsets). */
typedef struct {
    uint8_t *u; /* [M][K] */
    float *d, *xs; /* [M][K / 32] */
} QrAct;

static inline QrAct qr_act_at(float *work, int64_t M, int64_t K) {
    QrAct a;
    a.d = work;
    a.xs = work + M * (K / 32);
    a.u = (uint8_t *)(a.xs + M * (K / 32));
    return a;
}

static inline int64_t qr_act_floats(int64_t M, int64_t K) { return 2 * M * (K / 32) + M * K / 4 + 16; }

static void qr_quantize_row_(int wfmt, const float *x, int64_t K, const QrAct *a, int64_t m) {
    const int64_t nb = K / 32;
    uint8_t *u = a->u + m * K;
    for (int64_t b = 0; b < nb; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0),
                                                              _mm512_abs_ps(x1)));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        const __m512 vi = _mm512_set1_ps(inv);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vi));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vi));
        const __m128i flip = _mm_set1_epi8(wfmt == 1 ? (char)0x80 : 0);
        _mm_storeu_si128((__m128i *)(u + 32 * b), _mm_xor_si128(_mm512_cvtepi32_epi8(q0), flip));
        _mm_storeu_si128((__m128i *)(u + 32 * b + 16),
                         _mm_xor_si128(_mm512_cvtepi32_epi8(q1), flip));
        a->d[m * nb + b] = amax / 127.f;
        a->xs[m * nb + b] = amax / 127.f * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* CV panels (p0, p0 + 1) x MR rows of q (m0 ..) over every block into acc[cv][m]. */
static inline __attribute__((always_inline)) void qr_tile_(
        const int wfmt, const uint8_t *w, int64_t nb, const QrAct *a, int64_t m0, int64_t K,
        const int CV, const int MR, __m512 acc[2][6]) {
    const int64_t PB = qr_block_bytes(wfmt), DB = qr_data_bytes(wfmt), panel = nb * PB;
    const __m512i low4 = _mm512_set1_epi8(15);
    const uint8_t *xq[6];
    const float *dm[6], *xsm[6];
    for (int m = 0; m < MR; m++) {
        xq[m] = a->u + (m0 + m) * K;
        dm[m] = a->d + (m0 + m) * nb;
        xsm[m] = a->xs + (m0 + m) * nb;
        for (int c = 0; c < CV; c++) acc[c][m] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512i ai[2][6];
        const uint8_t *blk[2];
        for (int c = 0; c < CV; c++) {
            blk[c] = w + c * panel + b * PB;
            const __m512i corr = wfmt == 1 ? _mm512_loadu_si512(blk[c] + DB + 64)
                                           : _mm512_setzero_si512();
            for (int m = 0; m < MR; m++) ai[c][m] = corr;
        }
        /* Prefetch: a whole tile ahead. A thread's panels are one contiguous run (the omp
         * fors hand out consecutive panel pairs), so the next tile's CV panels follow this
         * one's: CV x PB bytes of them a block lands all of it in L1 by the time the next
         * tile starts. Four blocks ahead, as before, left the loads waiting on DRAM: the
         * default model's fused int4 step took 3.4 -> 2.7 ms at 1 row, 8.3 -> 5.7 at 8 and
         * 19.3 -> 16.9 at 32 (Zen 5, docs/history/2026-12-06-wave-4.md). int8 at one row
         * keeps the short prefetch: 20 more instructions a block there cost ~5%. Only the
         * first pass of rows (m0 0) fetches: later passes read this tile again. Past the
         * buffer's end a prefetch is dropped, never a fault. */
        if (wfmt == 1 && MR == 1) {
            for (int c = 0; c < CV; c++) _mm_prefetch((const char *)(blk[c] + 4 * PB), _MM_HINT_T0);
        } else if (m0 == 0) {
            const char *next = (const char *)(w + CV * panel + CV * b * PB);
            for (int64_t o = 0; o < CV * PB; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
        }
        if (wfmt == 1) {
            for (int q = 0; q < 8; q++) {
                __m512i wv[2];
                for (int c = 0; c < CV; c++) wv[c] = _mm512_loadu_si512(blk[c] + 64 * q);
                for (int m = 0; m < MR; m++) {
                    int32_t x4;
                    memcpy(&x4, xq[m] + 32 * b + 4 * q, 4);
                    const __m512i xb = _mm512_set1_epi32(x4);
                    for (int c = 0; c < CV; c++) ai[c][m] = _mm512_dpbusd_epi32(ai[c][m], xb, wv[c]);
                }
            }
        } else {
            for (int q = 0; q < 4; q++) {
                __m512i lo[2], hi[2];
                for (int c = 0; c < CV; c++) {
                    const __m512i v = _mm512_loadu_si512(blk[c] + 64 * q);
                    lo[c] = _mm512_and_si512(v, low4);
                    hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
                for (int m = 0; m < MR; m++) {
                    int32_t xl, xh;
                    memcpy(&xl, xq[m] + 32 * b + 4 * q, 4);
                    memcpy(&xh, xq[m] + 32 * b + 16 + 4 * q, 4);
                    const __m512i bl = _mm512_set1_epi32(xl), bh = _mm512_set1_epi32(xh);
                    for (int c = 0; c < CV; c++)
                        ai[c][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ai[c][m], lo[c], bl),
                                                       hi[c], bh);
                }
            }
        }
        __m512 ws[2], os[2];
        for (int c = 0; c < CV; c++) {
            if (wfmt == 1) {
                ws[c] = _mm512_loadu_ps((const float *)(blk[c] + DB));
            } else {
                ws[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[c] + DB)));
                os[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[c] + DB + 32)));
            }
        }
        for (int m = 0; m < MR; m++) {
            const __m512 dx = _mm512_set1_ps(dm[m][b]);
            for (int c = 0; c < CV; c++) {
                acc[c][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[c][m]),
                                            _mm512_mul_ps(ws[c], dx), acc[c][m]);
                if (wfmt == 2)
                    acc[c][m] = _mm512_fmadd_ps(os[c], _mm512_set1_ps(xsm[m][b]), acc[c][m]);
            }
        }
    }
}

#define QR_MR(F) ((F) == 1 ? 6 : 4)
#define QR_T(F, CV, MR) qr_tile_(F, w, nb, a, m0, K, CV, MR, acc)
#define QR_CASES(F, CV)                                                                      \
    switch (mr) {                                                                            \
    case 1: QR_T(F, CV, 1); break;                                                           \
    case 2: QR_T(F, CV, 2); break;                                                           \
    case 3: QR_T(F, CV, 3); break;                                                           \
    case 4: QR_T(F, CV, 4); break;                                                           \
    case 5: QR_T(F, CV, 5); break;                                                           \
    default: QR_T(F, CV, 6); break;                                                          \
    }

/* y[m * ldy + n] (= or +=) for the rows n of panels p0 .. p1 - 1 below N, every m < M. */
static void qr_rows_(const int64_t wfmt, const uint8_t *panels, int64_t N, int64_t K,
                     const QrAct *a, int64_t M, int64_t p0, int64_t p1, float *y, int64_t ldy,
                     int accumulate) {
    const int64_t nb = K / 32, PB = qr_block_bytes((int)wfmt), MRmax = QR_MR(wfmt);
    for (int64_t p = p0; p < p1; p += 2) {
        const int CV = p + 1 < p1 ? 2 : 1;
        const uint8_t *w = panels + p * nb * PB;
        for (int64_t m0 = 0; m0 < M; m0 += MRmax) {
            const int64_t mr = M - m0 < MRmax ? M - m0 : MRmax;
            __m512 acc[2][6];
            if (wfmt == 1) {
                if (CV == 2) { QR_CASES(1, 2) } else { QR_CASES(1, 1) }
            } else {
                if (CV == 2) { QR_CASES(2, 2) } else { QR_CASES(2, 1) }
            }
            for (int c = 0; c < CV; c++) {
                const int64_t n = 16 * (p + c);
                const __mmask16 k = N - n >= 16 ? 0xffff : (__mmask16)((1u << (N - n)) - 1);
                for (int64_t m = 0; m < mr; m++) {
                    float *dst = y + (m0 + m) * ldy + n;
                    __m512 v = acc[c][m];
                    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, dst));
                    _mm512_mask_storeu_ps(dst, k, v);
                }
            }
        }
    }
}
#endif

#ifdef QR_ON
/* h [M, E] += x [M, K] W^T for W in panels (E rows): x's rows quantized into the shared a,
 * then two panels a task; orphaned omp fors (inside decode_layers' parallel region). */
static void qr_residual_(int64_t wfmt, const uint8_t *panels, int64_t E, int64_t K,
                         const float *x, const QrAct *a, int64_t M, float *h) {
    const int64_t EP = (E + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) qr_quantize_row_((int)wfmt, x + m * K, K, a, m);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < EP; p += 2)
        qr_rows_(wfmt, panels, E, K, a, M, p, p + 2 < EP ? p + 2 : EP, h, E, 1);
}
#endif

int64_t qr_linear_work_floats(int64_t M, int64_t K) {
#ifdef QR_ON
    return qr_act_floats(M, K);
#else
    (void)M; (void)K;
    return 0;
#endif
}

/* y [M, N] = x [M, K] W^T (+ bias) for W in panels (qr_pack), the activations quantized per
 * 32 values (work: qr_linear_work_floats). Returns 0, touching nothing, where the panels are
 * not built for this host. */
int qr_linear(int64_t wfmt, const float *x, const uint8_t *panels, const float *bias, float *y,
              int64_t M, int64_t N, int64_t K, float *work, int nthreads) {
#ifdef QR_ON
    QrAct a = qr_act_at(work, M, K);
    const int64_t NP = (N + 15) / 16, pairs = (NP + 1) / 2;
#pragma omp parallel num_threads(nthreads) if (N * K >= 65536)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) qr_quantize_row_((int)wfmt, x + m * K, K, &a, m);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs; i++) {
            const int64_t p1 = 2 * i + 2 < NP ? 2 * i + 2 : NP;
            qr_rows_(wfmt, panels, N, K, &a, M, 2 * i, p1, y, N, 0);
            if (bias)
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = 32 * i; n < 16 * p1 && n < N; n++) y[m * N + n] += bias[n];
        }
    }
    return 1;
#else
    (void)wfmt; (void)x; (void)panels; (void)bias; (void)y; (void)M; (void)N; (void)K;
    (void)work; (void)nthreads;
    return 0;
#endif
}

/* ---- LoRA: a projection's adapters, rows grouped by adapter ------------------------------------
 * y[row] += B_p (A x[row])[r0:r1] into columns o0..o1 of each part p of the row's adapter (the
 * scaling folded into B; engine/lora/rows.py). Per group g (one adapter): descs[g] points at
 * int64 [R, nparts, a, half, {o0, o1, r0, r1, bt} x nparts] (a: A [R, K]; bt: B_p transposed
 * in blocks of LORA_OUT outputs, block b [r1 - r0, its width] at b * LORA_OUT * (r1 - r0):
 * each expand task reads one contiguous run, 1.3x faster than rows of the whole transpose;
 * kind (d[3]) 0: fp32, 1: fp16, 2: int8 with a scale per rank row, float [R] at
 * d[4 + 5 nparts], A's row scale times B's (its rank row of bt: the expand reads bare
 * integers, the shrink multiplies its sums by the scale); lora_dtype, 1/2 and 1/4 the bytes)
 * or is 0 (the adapter does not adapt this projection); its rows are
 * rows[row_off[g] .. row_off[g + 1]]. Two phases in one parallel region: the shrink, (group,
 * rank row) tasks, each A row read once and dotted with the group's rows into t [rows, rmax];
 * then the expand, (group, part, LORA_OUT outputs) tasks: rows two at a time, their outputs
 * in registers across the rank rows of bt (B transposed so the outputs are contiguous: B's
 * own rows made rank-long dots, 8 values each at rank 8, and ran ~20x slower). Each thread
 * prefetches the A rows / B blocks of its next tasks LORA_PF_BYTES ahead (one task is 1-6 KB,
 * less than memory's latency at this bandwidth). On a Zen 5 host (2 threads, SmolLM2-135M's
 * shapes, 16 all-linear rank-16 adapters, 2 rows each) these made a step's LoRA 10.4 -> 6.5
 * ms in fp16 (156 MB) and 16.9 -> 12.9 ms in fp32 (313 MB). One call per projection and
 * step: the torch twin made ~5 calls per adapter and projection. */
#define LORA_OUT 64
#define LORA_ES(kind) ((kind) == 2 ? 1 : (kind) ? 2 : 4) /* bytes per value */
/* rank row r's scale of the adapter described by d (1 unless int8) */
#define LORA_SCALE(d, r) ((d)[3] == 2 ? ((const float *)(d)[4 + 5 * (d)[1]])[r] : 1.f)
#define LORA_PF_BYTES 4096 /* prefetched ahead: 16 KB was no faster, none 1.5x slower */
static inline float dot_f_(const float *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* dot_f_ and y += s * b with fp16 a / b (F16C conversions: GCC 12 left the portable
 * _Float16 loops scalar) */
static inline float dot_hf_(const _Float16 *a, const float *b, int64_t n) {
    float s = 0.f;
    int64_t i = 0;
#ifdef DQ_512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(a + i))),
                              _mm512_loadu_ps(b + i), acc);
    s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i))),
                              _mm256_loadu_ps(b + i), acc);
    s = hsum8_(acc);
#endif
    for (; i < n; i++) s += (float)a[i] * b[i];
    return s;
}

static inline void axpy_hf_(float *y, float s, const _Float16 *b, int64_t n) {
    int64_t i = 0;
#ifdef DQ_512
    const __m512 vs = _mm512_set1_ps(s);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(
            vs, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + i))),
            _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    const __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(
            vs, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i))),
            _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += s * (float)b[i];
}

static inline float dot_i8_(const int8_t *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += (float)a[i] * b[i];
    return s;
}

/* One task's rows: y[row] += t[row][r0..r1] . bt block (rn rank rows of w <= LORA_OUT outputs,
 * contiguous), two rows at a time with their LORA_OUT outputs held in registers across the
 * rank (each B value read once per pair of rows, each output loaded and stored once: the
 * axpy per rank row loaded and stored every output rn times, 2 loads + 1 store per FMA). */
#if defined(DQ_512) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LORA_512 1
#endif
#ifdef LORA_512
static inline __m512 lora_b16_(const void *b, int64_t i, int half, __mmask16 m) {
    if (half == 2) /* int8 */
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)b + i)));
    return half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const _Float16 *)b + i))
                : _mm512_maskz_loadu_ps(m, (const float *)b + i);
}

static void lora_expand_(float *y0, float *y1, const float *t0, const float *t1,
                         const void *bt, int half, int64_t rn, int64_t w) {
    __mmask16 m[4];
    __m512 a0[4], a1[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        const int64_t left = w - 16 * v;
        m[v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        a0[v] = _mm512_maskz_loadu_ps(m[v], y0 + 16 * v);
        a1[v] = y1 ? _mm512_maskz_loadu_ps(m[v], y1 + 16 * v) : _mm512_setzero_ps();
    }
    for (int64_t r = 0; r < rn; r++) {
        const __m512 s0 = _mm512_set1_ps(t0[r]), s1 = _mm512_set1_ps(t1 ? t1[r] : 0.f);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            const __m512 b = lora_b16_(bt, r * w + 16 * v, half, m[v]);
            a0[v] = _mm512_fmadd_ps(s0, b, a0[v]);
            a1[v] = _mm512_fmadd_ps(s1, b, a1[v]);
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        _mm512_mask_storeu_ps(y0 + 16 * v, m[v], a0[v]);
        if (y1) _mm512_mask_storeu_ps(y1 + 16 * v, m[v], a1[v]);
    }
}

/* t[j][r] = A row r . x rows j for up to four rows at once (A read and converted once; the
 * sums in named registers: an array of them went through the stack, ~10 cycles a step). */
static void lora_shrink_(const void *a, int half, int64_t K, const float *const *xs, int n,
                         float *const *ts, float sc) {
    const float *x0 = xs[0], *x1 = xs[n > 1 ? 1 : 0], *x2 = xs[n > 2 ? 2 : 0],
                *x3 = xs[n > 3 ? 3 : 0];
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    if (n <= 2) { /* two sums per row: FMA latency, not throughput, bounds one sum */
        for (; i + 32 <= K; i += 32) {
            const __m512 a0 = lora_b16_(a, i, half, 0xffff);
            const __m512 a1 = lora_b16_(a, i + 16, half, 0xffff);
            s0 = _mm512_fmadd_ps(a0, _mm512_loadu_ps(x0 + i), s0);
            s2 = _mm512_fmadd_ps(a1, _mm512_loadu_ps(x0 + i + 16), s2);
            s1 = _mm512_fmadd_ps(a0, _mm512_loadu_ps(x1 + i), s1);
            s3 = _mm512_fmadd_ps(a1, _mm512_loadu_ps(x1 + i + 16), s3);
        }
        for (; i < K; i += 16) {
            const __mmask16 m = K - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - i)) - 1);
            const __m512 av = lora_b16_(a, i, half, m);
            s0 = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x0 + i), s0);
            s1 = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x1 + i), s1);
        }
        *ts[0] = sc * _mm512_reduce_add_ps(_mm512_add_ps(s0, s2));
        if (n > 1) *ts[1] = sc * _mm512_reduce_add_ps(_mm512_add_ps(s1, s3));
        return;
    }
    for (; i < K; i += 16) {
        const __mmask16 m = K - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - i)) - 1);
        const __m512 av = lora_b16_(a, i, half, m);
        s0 = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x0 + i), s0);
        s1 = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x1 + i), s1);
        s2 = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x2 + i), s2);
        s3 = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x3 + i), s3);
    }
    *ts[0] = sc * _mm512_reduce_add_ps(s0);
    *ts[1] = sc * _mm512_reduce_add_ps(s1);
    *ts[2] = sc * _mm512_reduce_add_ps(s2);
    if (n > 3) *ts[3] = sc * _mm512_reduce_add_ps(s3);
}
#endif

/* Prefetch n bytes from p into the caches (the next task's A or B rows: a whole task ahead,
 * so they arrive while this one computes; the hardware prefetcher sees only short runs). */
static inline void lora_prefetch_(const void *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* The shrink task's (group, rank row) and the expand task's (group, part, output block). */
static void lora_shrink_task_(const int64_t *descs, int64_t task, int64_t *g, int64_t *r) {
    *g = 0, *r = task;
    for (;; (*g)++) {
        const int64_t *d = (const int64_t *)descs[*g];
        if (!d) continue;
        if (*r < d[0]) break;
        *r -= d[0];
    }
}

static void lora_expand_task_(const int64_t *descs, int64_t task, int64_t *g, int64_t *p,
                              int64_t *blk) {
    *g = 0, *blk = task;
    for (;; (*g)++) {
        const int64_t *d = (const int64_t *)descs[*g];
        if (!d) continue;
        for (*p = 0; *p < d[1]; (*p)++) {
            const int64_t *q = d + 4 + 5 * *p;
            const int64_t nb = (q[1] - q[0] + LORA_OUT - 1) / LORA_OUT;
            if (*blk < nb) return;
            *blk -= nb;
        }
    }
}

/* This thread's share [*lo, *hi) of n tasks (omp for schedule(static)'s split). */
static inline void lora_share_(int64_t n, int64_t *lo, int64_t *hi) {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t q = n / nt, rem = n % nt;
    *lo = id * q + (id < rem ? id : rem);
    *hi = *lo + q + (id < rem);
}

/* Rows j0..j1 (rows[j], t row j) of one B block: outputs o0..o1 of bt's rn rank rows (from
 * rank r0), into y (columns below split) or y2. */
static void lora_expand_rows_(float *y, int64_t ldy, float *y2, int64_t ldy2, int64_t split,
                              const int64_t *rows, int64_t j0, int64_t j1, const float *t,
                              int64_t rmax, int64_t r0, int64_t rn, const char *bt,
                              int64_t half, int64_t o0, int64_t o1) {
#define LORA_Y(j) (o0 >= split ? y2 + rows[j] * ldy2 + (o0 - split) : y + rows[j] * ldy + o0)
#ifdef LORA_512
    for (int64_t j = j0; j < j1; j += 2) {
        const int two = j + 1 < j1;
        lora_expand_(LORA_Y(j), two ? LORA_Y(j + 1) : 0, t + j * rmax + r0,
                     two ? t + (j + 1) * rmax + r0 : 0, bt, (int)half, rn, o1 - o0);
    }
#else
    for (int64_t j = j0; j < j1; j++) {
        float *yo = LORA_Y(j);
        const float *tj = t + j * rmax + r0;
        for (int64_t r = 0; r < rn; r++) {
            const float s = tj[r];
            if (half == 1) {
                axpy_hf_(yo, s, (const _Float16 *)bt + r * (o1 - o0), o1 - o0);
                continue;
            }
            if (half == 2) {
                const int8_t *bi = (const int8_t *)bt + r * (o1 - o0);
#pragma omp simd
                for (int64_t o = 0; o < o1 - o0; o++) yo[o] += s * (float)bi[o];
                continue;
            }
            const float *br = (const float *)bt + r * (o1 - o0);
#pragma omp simd
            for (int64_t o = 0; o < o1 - o0; o++) yo[o] += s * br[o];
        }
    }
#endif
#undef LORA_Y
}

/* The bytes of group g's adapter for one projection, in the order lora_groups_ reads them:
 * region 0 its A [R, K], region 1 + p part p's blocked B; *len 0 past the last region. */
static const char *lora_region_(const int64_t *d, int64_t K, int64_t i, int64_t *len) {
    const int64_t es = LORA_ES(d[3]);
    if (i == 0) return *len = d[0] * K * es, (const char *)d[2];
    if (i > d[1]) return *len = 0, (const char *)0;
    const int64_t *q = d + 4 + 5 * (i - 1);
    *len = (q[1] - q[0]) * (q[3] - q[2]) * es;
    return (const char *)q[4];
}

/* A thread's read-ahead over its groups' regions: prefetches until LORA_PF_BYTES are on
 * their way beyond what it has read (*ahead: bytes prefetched and not yet read). */
typedef struct { const int64_t *descs; int64_t K, g, g1, i, off; } LoraAhead;
static void lora_ahead_(LoraAhead *c, int64_t *ahead) {
    while (*ahead < LORA_PF_BYTES && c->g < c->g1) {
        const int64_t *d = (const int64_t *)c->descs[c->g];
        int64_t len = 0;
        const char *p = d ? lora_region_(d, c->K, c->i, &len) : 0;
        if (!len) { c->g++, c->i = 0, c->off = 0; continue; }
        const int64_t n = len - c->off < 1024 ? len - c->off : 1024;
        lora_prefetch_(p + c->off, n);
        c->off += n, *ahead += n;
        if (c->off == len) c->i++, c->off = 0;
    }
}

/* lora_team_ with at least two adapters per thread: each thread takes whole groups (a
 * contiguous run of them holding about its share of the bytes) and does their shrink and
 * expand itself, so the team meets once, at the end, not also between the phases (4 calls
 * per layer: 120 barriers a step of a 30-layer model), and each group's t stays in L1. */
static void lora_groups_(const float *x, int64_t ldx, int64_t K, float *y, int64_t ldy,
                         float *y2, int64_t ldy2, int64_t split, int64_t G,
                         const int64_t *descs, const int64_t *rows, const int64_t *row_off,
                         float *t, int64_t rmax) {
    int64_t total = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t *d = (const int64_t *)descs[g];
        int64_t len;
        if (d)
            for (int64_t i = 0; lora_region_(d, K, i, &len), len; i++) total += len;
    }
    /* this thread's groups: those whose bytes start in its share of the total */
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t g0 = G, g1 = G, at = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t *d = (const int64_t *)descs[g];
        const int64_t who = total ? at * nt / total : 0;
        if (who == id && g0 == G) g0 = g;
        if (who > id) { g1 = g; break; }
        int64_t len;
        if (d)
            for (int64_t i = 0; lora_region_(d, K, i, &len), len; i++) at += len;
    }
    if (g0 == G) g1 = G;
    LoraAhead c = {descs, K, g0, g1, 0, 0};
    int64_t ahead = 0;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t *d = (const int64_t *)descs[g];
        if (!d) continue;
        const int64_t half = d[3], es = LORA_ES(half);
        for (int64_t r = 0; r < d[0]; r++) { /* shrink: A row r against the group's rows */
            ahead -= K * es;
            lora_ahead_(&c, &ahead);
            const char *a = (const char *)d[2] + r * K * es;
#ifdef LORA_512
            for (int64_t j = row_off[g]; j < row_off[g + 1]; j += 4) {
                const int n = row_off[g + 1] - j < 4 ? (int)(row_off[g + 1] - j) : 4;
                const float *xs[4];
                float *ts[4];
                for (int i = 0; i < n; i++)
                    xs[i] = x + rows[j + i] * ldx, ts[i] = t + (j + i) * rmax + r;
                lora_shrink_(a, (int)half, K, xs, n, ts, LORA_SCALE(d, r));
            }
#else
            for (int64_t j = row_off[g]; j < row_off[g + 1]; j++)
                t[j * rmax + r] = half == 2 ? LORA_SCALE(d, r) * dot_i8_((const int8_t *)a,
                                                                          x + rows[j] * ldx, K)
                                  : half ? dot_hf_((const _Float16 *)a, x + rows[j] * ldx, K)
                                         : dot_f_((const float *)a, x + rows[j] * ldx, K);
#endif
        }
        for (int64_t p = 0; p < d[1]; p++) { /* expand: each block of each part's B */
            const int64_t *q = d + 4 + 5 * p;
            const int64_t r0 = q[2], rn = q[3] - q[2];
            for (int64_t o0 = q[0], blk = 0; o0 < q[1]; o0 += LORA_OUT, blk++) {
                const int64_t o1 = o0 + LORA_OUT < q[1] ? o0 + LORA_OUT : q[1];
                ahead -= rn * (o1 - o0) * es;
                lora_ahead_(&c, &ahead);
                const char *bt = (const char *)q[4] + blk * LORA_OUT * rn * es;
                lora_expand_rows_(y, ldy, y2, ldy2, split, rows, row_off[g], row_off[g + 1],
                                  t, rmax, r0, rn, bt, half, o0, o1);
            }
        }
    }
#pragma omp barrier
}

/* The LoRA of one projection for rows grouped by adapter, shared among the calling team (
 * inside a parallel region every thread of it must call this; it ends with a barrier).
 * x: row m at x + m * ldx (K values); y: output column o < split of row m at y + m * ldy + o,
 * column o >= split at y2 + m * ldy2 + o - split (gate/up land in two arrays; no part
 * straddles split). */
static void lora_team_(const float *x, int64_t ldx, int64_t K, float *y, int64_t ldy,
                       float *y2, int64_t ldy2, int64_t split, int64_t G,
                       const int64_t *descs, const int64_t *rows, const int64_t *row_off,
                       float *t, int64_t rmax) {
    int64_t shrink_n = 0, expand_n = 0, held = 0;
    for (int64_t g = 0; g < G; g++) {
        const int64_t *d = (const int64_t *)descs[g];
        if (!d) continue;
        held++;
        shrink_n += d[0];
        for (int64_t p = 0; p < d[1]; p++) {
            const int64_t *q = d + 4 + 5 * p;
            expand_n += (q[1] - q[0] + LORA_OUT - 1) / LORA_OUT;
        }
    }
    if (held >= 2 * omp_get_num_threads() && omp_get_num_threads() > 1) {
        lora_groups_(x, ldx, K, y, ldy, y2, ldy2, split, G, descs, rows, row_off, t, rmax);
        return;
    }
    int64_t lo, hi, pf, ahead = 0;
    lora_share_(shrink_n, &lo, &hi);
    pf = lo;
    for (int64_t task = lo; task < hi; task++) {
        int64_t g, r;
        lora_shrink_task_(descs, task, &g, &r);
        const int64_t *d = (const int64_t *)descs[g];
        const int64_t es = LORA_ES(d[3]);
        /* A rows LORA_PF_BYTES ahead of the one read now (a row is 1-6 KB: one task ahead
         * is less than memory's latency at this bandwidth) */
        ahead -= K * es;
        while (pf < hi && ahead < LORA_PF_BYTES) {
            int64_t g2, r2;
            lora_shrink_task_(descs, pf++, &g2, &r2);
            const int64_t *d2 = (const int64_t *)descs[g2];
            const int64_t e2 = LORA_ES(d2[3]);
            lora_prefetch_((const char *)d2[2] + r2 * K * e2, K * e2);
            ahead += K * e2;
        }
#ifdef LORA_512
        for (int64_t j = row_off[g]; j < row_off[g + 1]; j += 4) {
            const int n = row_off[g + 1] - j < 4 ? (int)(row_off[g + 1] - j) : 4;
            const float *xs[4];
            float *ts[4];
            for (int i = 0; i < n; i++)
                xs[i] = x + rows[j + i] * ldx, ts[i] = t + (j + i) * rmax + r;
            lora_shrink_((const char *)d[2] + r * K * es, (int)d[3], K, xs, n, ts,
                         LORA_SCALE(d, r));
        }
#else
        for (int64_t j = row_off[g]; j < row_off[g + 1]; j++)
            t[j * rmax + r] =
                d[3] == 2 ? LORA_SCALE(d, r) * dot_i8_((const int8_t *)d[2] + r * K,
                                                       x + rows[j] * ldx, K)
                : d[3]    ? dot_hf_((const _Float16 *)d[2] + r * K, x + rows[j] * ldx, K)
                          : dot_f_((const float *)d[2] + r * K, x + rows[j] * ldx, K);
#endif
    }
#pragma omp barrier
    lora_share_(expand_n, &lo, &hi);
    pf = lo, ahead = 0;
    for (int64_t task = lo; task < hi; task++) {
        int64_t g, p, blk;
        lora_expand_task_(descs, task, &g, &p, &blk);
        const int64_t half = ((const int64_t *)descs[g])[3], es = LORA_ES(half);
        const int64_t *q = (const int64_t *)descs[g] + 4 + 5 * p;
        const int64_t o0 = q[0] + blk * LORA_OUT;
        const int64_t o1 = o0 + LORA_OUT < q[1] ? o0 + LORA_OUT : q[1];
        const int64_t r0 = q[2], rn = q[3] - q[2];
        ahead -= rn * (o1 - o0) * es;
        while (pf < hi && ahead < LORA_PF_BYTES) { /* blocks of B as far ahead */
            int64_t g2, p2, b2;
            lora_expand_task_(descs, pf++, &g2, &p2, &b2);
            const int64_t *q2 = (const int64_t *)descs[g2] + 4 + 5 * p2;
            const int64_t e2 = LORA_ES(((const int64_t *)descs[g2])[3]), n2 = q2[3] - q2[2];
            const int64_t w2 = q2[1] - q2[0] - b2 * LORA_OUT;
            const int64_t n = n2 * (w2 < LORA_OUT ? w2 : LORA_OUT) * e2;
            lora_prefetch_((const char *)q2[4] + b2 * LORA_OUT * n2 * e2, n);
            ahead += n;
        }
        /* block blk of bt: rn rows of (o1 - o0) outputs, contiguous */
        const char *bt = (const char *)q[4] + blk * LORA_OUT * rn * es;
        lora_expand_rows_(y, ldy, y2, ldy2, split, rows, row_off[g], row_off[g + 1], t, rmax,
                          r0, rn, bt, half, o0, o1);
    }
#pragma omp barrier
}

/* lora_team_ for one projection outside any parallel region: x [M, K], y [M, N]. */
void lora_apply(const float *x, int64_t K, float *y, int64_t N, int64_t G,
                const int64_t *descs, const int64_t *rows, const int64_t *row_off, float *t,
                int64_t rmax, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    lora_team_(x, K, K, y, N, 0, 0, N, G, descs, rows, row_off, t, rmax);
}

/* A whole pure-decode step through every decoder layer, in one parallel region.
 *
 * At batch 1-8 the layers' weights stream in ~20 ms on two cores, but the layer-by-layer path
 * pays a Python call, a tensor allocation and an OpenMP team wake-up per op (about ten per
 * layer, 300 a step): 5-12 ms of a 25-35 ms step on the hosts measured. Here the threads stay
 * in one team for all layers and meet at four barriers per layer. The math is the kernels'
 * above (the same row helpers as rms_norm and rope, the same decode_task as paged_decode,
 * silu_mul's formula), the projections dots_ tiles (weights read from memory once per
 * step), and the new K/V are written into the cache in place.
 *
 * h:      [M, E] residual stream in, the last layer's sum out (before the final norm)
 * ptrs:   per layer DL_PTRS addresses: input norm, post norm, QKV weight [(H + 2 KVH) D, E],
 *         QKV bias (0: none), O weight [E, H D], gate/up weight [2 I, E], down weight [E, I],
 *         query-head norm [D] and key-head norm [D] (Qwen3; 0: none), KV cache
 *         [pages, 2, block_size, KVH, D]; then for quantized weights (qfmt 1: int8 in groups
 *         of qgroup, 2: int4; the four weight addresses above are then their data) each
 *         weight's fp16 scales and offsets (int4) in the order QKV, O, gate/up, down (0 when
 *         qfmt is 0). Quantized projections (qfmt 1 / 2) take the dot-product tiles (q_rows_)
 *         below wide_from rows and the wide tiles from it, each tile's rows expanded first;
 *         qfmt 3 / 4 are int8 / int4 weights (groups of 32) against int8 activations (the
 *         integer products, qi_rows_: each projection's input quantized first); 5 / 6 the
 *         same on the AMX tiles (where qa_enable granted them; else as 3 / 4).
 * cos/sin:[M, D] rows at each sequence's new position; tables [M, max_pages];
 * kv_lens [M]: tokens to attend including the new one (its slot: position kv_lens - 1)
 * wide_from: from this many rows the projections run the wide tiles (wide_rows: rows in
 *         vector lanes), below it the dot-product tiles (pair_block / q_rows_); chosen per
 *         host (not for the integer products)
 * work:   scratch of decode_layers_work_floats(...) floats
 */
#define DL_PTRS 18

/* act[m][i] = silu(act[m][i]) * up[m][i] for columns i0 <= i < i1 of the M rows (I wide). */
static inline void silu_gate_(float *act, const float *up, int64_t M, int64_t I, int64_t i0,
                              int64_t i1) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = i0; i < i1; i++) {
            const float g = act[m * I + i];
            act[m * I + i] = g / (1.f + expf(fminf(-g, 80.f))) * up[m * I + i];
        }
}

/* act = silu(act) * up over [M, I], shared among the calling team (an orphaned omp for). */
static void lora_silu_(float *act, const float *up, int64_t M, int64_t I) {
#pragma omp for schedule(static)
    for (int64_t i0 = 0; i0 < I; i0 += LORA_OUT)
        silu_gate_(act, up, M, I, i0, i0 + LORA_OUT < I ? i0 + LORA_OUT : I);
}
/* Per thread: int4's block sums of the widest input of a projection. */
static int64_t dl_xsum_floats(int64_t M, int64_t E, int64_t HD, int64_t I) {
    const int64_t k = E > HD ? (E > I ? E : I) : (HD > I ? HD : I);
    return M * (k / 32 + 1);
}

/* Per thread: the wide tiles' expanded weight rows (quantized weights) for the widest input. */
static int64_t dl_deq_floats(int64_t E, int64_t HD, int64_t I) {
    return WIDE_NR * (E > HD ? (E > I ? E : I) : (HD > I ? HD : I));
}

/* The panels' quantized rows of M x K (0 where the panels are not built). */
static int64_t dl_qr_floats(int64_t M, int64_t K) { return qr_linear_work_floats(M, K); }

/* Per thread: the AMX tiles' packing scratch for the widest input of a projection. */
static int64_t dl_pack_floats(int64_t E, int64_t HD, int64_t I) {
    return qa_pack_floats(E > HD ? (E > I ? E : I) : (HD > I ? HD : I));
}

int64_t decode_layers_work_floats(int64_t M, int64_t E, int64_t H, int64_t KVH, int64_t D,
                                  int64_t I, int nthreads) {
    /* per thread: its normed copy of the rows (transposed, MP lanes, in the wide layout), two
     * wide tiles' outputs and one attention task's heads; shared: qkv, attention out (wide:
     * transposed), gate (then the activations; wide: transposed) and up */
    const int64_t MP = lanes_for(M), HD = H * D;
    return (int64_t)nthreads * (MP * E + 2 * WIDE_NR * MP + H * D + dl_xsum_floats(M, E, H * D, I)
                                + qi_act_floats(M, E) + dl_pack_floats(E, HD, I)
                                + dl_deq_floats(E, HD, I) + dl_qr_floats(M, E))
           + M * (H + 2 * KVH) * D + MP * H * D + MP * I + M * I
           + qi_act_floats(M, HD > I ? HD : I) + dl_qr_floats(M, HD > I ? HD : I);
}

void decode_layers(float *h, const int64_t *ptrs, int64_t num_layers, int64_t M, int64_t E,
                   int64_t H, int64_t KVH, int64_t D, int64_t I, const float *cos_,
                   const float *sin_, const int64_t *tables, int64_t max_pages,
                   const int64_t *kv_lens, int64_t block_size, float eps, float scale,
                   int64_t wide_from, int64_t qfmt, int64_t qgroup, int64_t kvq,
                   const int64_t *lora, float *work, int nthreads) {
    const int64_t NQKV = (H + 2 * KVH) * D, G = H / KVH, MP = lanes_for(M);
    /* bytes per token slot and per page of the caches (kvq: int8 rows, as paged_decode) */
    const int64_t row = KVH * kv_head_bytes(D, (int)kvq), page = 2 * block_size * row;
    /* qint: integer products (amx: on the AMX tiles); wfmt: the weights' layout for q_rows_ /
     * qi_rows_ (1 or 2); wide: the wide tiles (quantized weights expanded a tile at a time) */
#ifdef QR_ON
    const int panel = qfmt >= 7;
#else
    const int panel = 0;
    if (qfmt >= 7) qfmt -= 4; /* no panels built here: the integer tiles (the caller checks) */
#endif
    const int qint = qfmt >= 3 && !panel, amx = qint && qfmt >= 5;
    const int wide = !qint && !panel && M >= wide_from && !lora; /* LoRA: row layouts only */
    /* LoRA (lora_team_): [G, rmax, rows, row_off, t, descs [num_layers, 4, G]] */
    const int64_t lg = lora ? lora[0] : 0, lrmax = lora ? lora[1] : 0;
    const int64_t *lrows = lora ? (const int64_t *)lora[2] : 0;
    const int64_t *loff = lora ? (const int64_t *)lora[3] : 0;
    float *lt = lora ? (float *)lora[4] : 0;
    const int64_t *ldesc = lora ? (const int64_t *)lora[5] : 0;
#define LORA_DESCS(l, j) (ldesc + ((l) * 4 + (j)) * lg)
/* gate/up's share (gate columns into act, up's into up), then the SiLU gate the projection
 * loops left undone; down's share into the residual */
#define LORA_GATE_UP()                                                                       \
    if (lora) {                                                                              \
        lora_team_(x, E, E, act, I, up, I, I, lg, LORA_DESCS(l, 2), lrows, loff, lt, lrmax); \
        lora_silu_(act, up, M, I);                                                           \
    }
#define LORA_DOWN()                                                                          \
    if (lora)                                                                                \
        lora_team_(act, I, I, h, E, 0, 0, E, lg, LORA_DESCS(l, 3), lrows, loff, lt, lrmax)
    const int64_t wfmt = panel ? qfmt - 6 : amx ? qfmt - 4 : qint ? qfmt - 2 : qfmt;
    const int64_t per_thread = MP * E + 2 * WIDE_NR * MP + H * D + dl_xsum_floats(M, E, H * D, I)
                               + qi_act_floats(M, E) + dl_pack_floats(E, H * D, I)
                               + dl_deq_floats(E, H * D, I) + dl_qr_floats(M, E);
    float *qkv = work + (int64_t)nthreads * per_thread, *att = qkv + M * NQKV;
    float *act = att + MP * H * D, *up = act + MP * I;
    const int64_t HD = H * D;
    /* the quantized attention output, then the quantized activations (shared) */
    QAct sa_att = qi_act_at(up + M * I, M, HD, amx), sa_act = qi_act_at(up + M * I, M, I, amx);
#ifdef QR_ON
    /* the panels' quantized attention output, then activations (shared) */
    const float *shared_end = up + M * I + qi_act_floats(M, HD > I ? HD : I);
    const QrAct ra_att = qr_act_at((float *)shared_end, M, HD),
                ra_act = qr_act_at((float *)shared_end, M, I);
    const int64_t NQP = (NQKV + 15) / 16, IP = I / 16;
#endif
    /* rows each QAct is quantized for: the AMX layout's zero rows past M too */
    const int64_t qrows = sa_att.amx ? qi_rows_held(M) : M;
    const int64_t pb_qkv = pairs_per_block(NQKV / 2, nthreads),
                  pb_e = pairs_per_block(E / 2, nthreads), pb_i = pairs_per_block(I, nthreads);
    if (wide) /* the lanes past M stay zero: every wide product of them is zero */
        memset(att, 0, MP * HD * sizeof(float));
#pragma omp parallel num_threads(nthreads)
    {
        float *x = work + (int64_t)omp_get_thread_num() * per_thread; /* normed rows */
        float *tile = x + MP * E, *heads = tile + 2 * WIDE_NR * MP, *xs = heads + H * D;
        QAct xa = qi_act_at(xs + dl_xsum_floats(M, E, H * D, I), M, E, amx); /* x quantized */
        float *pack = xs + dl_xsum_floats(M, E, H * D, I) + qi_act_floats(M, E);
        float *deq = pack + dl_pack_floats(E, H * D, I); /* wide tiles' expanded weights */
#ifdef QR_ON
        const QrAct rx = qr_act_at(deq + dl_deq_floats(E, H * D, I), M, E); /* x, panels' */
#endif
        if (wide) memset(x, 0, MP * E * sizeof(float));
        for (int64_t l = 0; l < num_layers; l++) {
            const int64_t *p = ptrs + DL_PTRS * l;
            typedef const _Float16 *h16;
            const float *in_norm = (const float *)p[0], *post_norm = (const float *)p[1];
            const float *wqkv = (const float *)p[2], *bqkv = (const float *)p[3];
            const float *wo = (const float *)p[4], *wgu = (const float *)p[5];
            const float *wdown = (const float *)p[6];
            const float *qnorm = (const float *)p[7], *knorm = (const float *)p[8];
            char *cache = (char *)p[9];
            /* Every thread normalizes the rows itself (M x E floats: cheaper than a barrier). */
            for (int64_t m = 0; m < M; m++)
                if (wide) norm_row_t_(h + m * E, in_norm, x, MP, m, E, eps);
                else norm_row_(h + m * E, in_norm, x + m * E, E, eps);
#ifdef QR_ON
            if (panel) { /* two panels (32 rows) a task */
                for (int64_t m = 0; m < M; m++) qr_quantize_row_((int)wfmt, x + m * E, E, &rx, m);
#pragma omp for schedule(static)
                for (int64_t p = 0; p < NQP; p += 2) {
                    const int64_t p1 = p + 2 < NQP ? p + 2 : NQP;
                    qr_rows_(wfmt, (const uint8_t *)wqkv, NQKV, E, &rx, M, p, p1, qkv, NQKV, 0);
                    if (bqkv)
                        for (int64_t m = 0; m < M; m++)
                            for (int64_t n = 16 * p; n < 16 * p1 && n < NQKV; n++)
                                qkv[m * NQKV + n] += bqkv[n];
                }
            } else
#endif
            if (qint) {
                for (int64_t m = 0; m < qrows; m++)
                    qi_quantize_row_(wfmt, m < M ? x + m * E : 0, E, &xa, m);
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < NQKV; n0 += Q_BLOCK) {
                    const int64_t n1 = n0 + Q_BLOCK < NQKV ? n0 + Q_BLOCK : NQKV;
                    qi_rows_(wfmt, wqkv, (h16)p[10], (h16)p[11], &xa, M, E, n0, n1, qkv,
                             NQKV, 0, pack);
                    if (bqkv)
                        for (int64_t m = 0; m < M; m++)
                            for (int64_t n = n0; n < n1; n++) qkv[m * NQKV + n] += bqkv[n];
                }
            } else if (wide) {
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < NQKV; n0 += WIDE_NR) {
                    const int64_t nr = NQKV - n0 < WIDE_NR ? NQKV - n0 : WIDE_NR;
                    wide_rows(wide_src_(qfmt, qgroup, wqkv, (h16)p[10], (h16)p[11], n0, nr, E, deq), E,
                              nr, x, MP, E, tile);
                    for (int64_t r = 0; r < nr; r++) {
                        const float b = bqkv ? bqkv[n0 + r] : 0.f;
                        for (int64_t m = 0; m < M; m++)
                            qkv[m * NQKV + n0 + r] = tile[r * MP + m] + b;
                    }
                }
            } else if (qfmt) {
                if (qfmt == 2) block_sums_(x, M, E, xs);
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < NQKV; n0 += Q_BLOCK) {
                    const int64_t n1 = n0 + Q_BLOCK < NQKV ? n0 + Q_BLOCK : NQKV;
                    q_rows_(qfmt, qgroup, wqkv, (h16)p[10], (h16)p[11], x, xs, M, E, n0, n1,
                            qkv, NQKV, 0);
                    if (bqkv)
                        for (int64_t m = 0; m < M; m++)
                            for (int64_t n = n0; n < n1; n++) qkv[m * NQKV + n] += bqkv[n];
                }
            } else {
#pragma omp for schedule(static)
                for (int64_t i0 = 0; i0 < NQKV / 2; i0 += pb_qkv) {
                    const int64_t i1 = i0 + pb_qkv < NQKV / 2 ? i0 + pb_qkv : NQKV / 2;
                    pair_block(wqkv, wqkv + E, 2 * E, x, M, E, i0, i1, qkv, qkv + 1, 2, NQKV, 0);
                    if (bqkv)
                        for (int64_t m = 0; m < M; m++)
                            for (int64_t n = 2 * i0; n < 2 * i1; n++)
                                qkv[m * NQKV + n] += bqkv[n];
                }
            }
            if (lora) /* the adapters' share of QKV, before the rotation reads it */
                lora_team_(x, E, E, qkv, NQKV, 0, 0, NQKV, lg, LORA_DESCS(l, 0), lrows, loff,
                           lt, lrmax);
            /* One task per (row, KV head): rotate its query heads and key and write K/V
             * into the new token's slot; then, every slot written, attend (the new slot
             * included). Two loops, because rows may be consecutive positions of one
             * sequence (speculative decoding verifies drafts as rows): a row attends to
             * the slots of the rows before it. */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < M * KVH; task++) {
                const int64_t b = task / KVH, kvh = task % KVH;
                float *qb = qkv + b * NQKV;
                const float *c = cos_ + b * D, *s = sin_ + b * D;
                float *k = qb + (H + kvh) * D;
                if (qnorm) { /* Qwen3: each query head and the key normed before rotation */
                    for (int64_t g = 0; g < G; g++)
                        norm_row_(qb + (kvh * G + g) * D, qnorm, qb + (kvh * G + g) * D, D, eps);
                    norm_row_(k, knorm, k, D, eps);
                }
                for (int64_t g = 0; g < G; g++) rope_head_(qb + (kvh * G + g) * D, c, s, D);
                rope_head_(k, c, s, D);
                const int64_t *tab = tables + b * max_pages;
                const int64_t pos = kv_lens[b] - 1;
                char *slot = cache + tab[pos / block_size] * page + (pos % block_size) * row
                             + kvh * kv_head_bytes(D, (int)kvq);
                kv_store_(slot, k, D, (int)kvq);
                kv_store_(slot + block_size * row, k + KVH * D, D, (int)kvq);
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < M * KVH; task++) {
                const int64_t b = task / KVH, kvh = task % KVH;
                float *qb = qkv + b * NQKV;
                const int64_t *tab = tables + b * max_pages;
                if (wide) { /* this task's heads, then into their lanes of the transpose */
                    decode_task_d(qb, cache, tab, kv_lens[b], heads, G, kvh, D, row, page,
                                  block_size, scale, (int)kvq);
                    for (int64_t j = kvh * G * D; j < (kvh + 1) * G * D; j++)
                        att[j * MP + b] = heads[j];
                } else {
                    decode_task_d(qb, cache, tab, kv_lens[b], att + b * HD, G, kvh, D, row,
                                  page, block_size, scale, (int)kvq);
                }
            }
#ifdef QR_ON
            if (panel) {
                qr_residual_(wfmt, (const uint8_t *)wo, E, HD, att, &ra_att, M, h);
            } else
#endif
            if (qint) {
#pragma omp for schedule(static)
                for (int64_t m = 0; m < qrows; m++)
                    qi_quantize_row_(wfmt, m < M ? att + m * HD : 0, HD, &sa_att, m);
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < E; n0 += Q_BLOCK)
                    qi_rows_(wfmt, wo, (h16)p[12], (h16)p[13], &sa_att, M, HD, n0,
                             n0 + Q_BLOCK < E ? n0 + Q_BLOCK : E, h, E, 1, pack);
            } else if (wide) {
                wide_residual_(qfmt, qgroup, wo, (h16)p[12], (h16)p[13], HD, att, MP, M, E,
                               tile, deq, h);
            } else if (qfmt) {
                if (qfmt == 2) block_sums_(att, M, HD, xs);
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < E; n0 += Q_BLOCK)
                    q_rows_(qfmt, qgroup, wo, (h16)p[12], (h16)p[13], att, xs, M, HD, n0,
                            n0 + Q_BLOCK < E ? n0 + Q_BLOCK : E, h, E, 1);
            } else {
#pragma omp for schedule(static)
                for (int64_t i0 = 0; i0 < E / 2; i0 += pb_e)
                    pair_block(wo, wo + HD, 2 * HD, att, M, HD, i0,
                               i0 + pb_e < E / 2 ? i0 + pb_e : E / 2, h, h + 1, 2, E, 1);
            }
            if (lora) /* the adapters' share of O, into the residual */
                lora_team_(att, HD, HD, h, E, 0, 0, E, lg, LORA_DESCS(l, 1), lrows, loff, lt,
                           lrmax);
            for (int64_t m = 0; m < M; m++)
                if (wide) norm_row_t_(h + m * E, post_norm, x, MP, m, E, eps);
                else norm_row_(h + m * E, post_norm, x + m * E, E, eps);
            if (wide) { /* gate and up tiles, SiLU-gated straight into the transposed act */
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < I; n0 += WIDE_NR) {
                    const int64_t nr = I - n0 < WIDE_NR ? I - n0 : WIDE_NR;
                    float *gt = tile, *ut = tile + WIDE_NR * MP;
                    /* gate rows n0.., then up rows I + n0.. (deq reused: gt is done) */
                    wide_rows(wide_src_(qfmt, qgroup, wgu, (h16)p[14], (h16)p[15], n0, nr, E,
                                        deq), E, nr, x, MP, E, gt);
                    wide_rows(wide_src_(qfmt, qgroup, wgu, (h16)p[14], (h16)p[15], I + n0, nr,
                                        E, deq), E, nr, x, MP, E, ut);
                    for (int64_t r = 0; r < nr; r++) {
                        float *o = act + (n0 + r) * MP;
#pragma omp simd
                        for (int64_t m = 0; m < MP; m++) {
                            const float g = gt[r * MP + m];
                            o[m] = g / (1.f + expf(fminf(-g, 80.f))) * ut[r * MP + m];
                        }
                    }
                }
                wide_residual_(qfmt, qgroup, wdown, (h16)p[16], (h16)p[17], I, act, MP, M, E,
                               tile, deq, h);
                continue;
            }
#ifdef QR_ON
            if (panel) { /* gate panels p.., up panels IP + p.. (I a multiple of 16) */
                const int64_t gpb = (E / 32) * qr_block_bytes((int)wfmt); /* a panel's bytes */
                for (int64_t m = 0; m < M; m++) qr_quantize_row_((int)wfmt, x + m * E, E, &rx, m);
#pragma omp for schedule(static)
                for (int64_t p = 0; p < IP; p += 2) {
                    const int64_t p1 = p + 2 < IP ? p + 2 : IP;
                    qr_rows_(wfmt, (const uint8_t *)wgu, I, E, &rx, M, p, p1, act, I, 0);
                    qr_rows_(wfmt, (const uint8_t *)wgu + IP * gpb, I, E, &rx, M, p, p1, up, I,
                             0);
                    if (!lora) silu_gate_(act, up, M, I, 16 * p, 16 * p1);
                }
                LORA_GATE_UP();
                qr_residual_(wfmt, (const uint8_t *)wdown, E, I, act, &ra_act, M, h);
                LORA_DOWN();
                continue;
            }
#endif
            if (qint) { /* as below, on the integer products */
                const int64_t up_data = wfmt == 1 ? I * E : I * E / 2, up_scales = I * (E / 32);
                for (int64_t m = 0; m < qrows; m++)
                    qi_quantize_row_(wfmt, m < M ? x + m * E : 0, E, &xa, m);
#pragma omp for schedule(static)
                for (int64_t i0 = 0; i0 < I; i0 += Q_BLOCK) {
                    const int64_t i1 = i0 + Q_BLOCK < I ? i0 + Q_BLOCK : I;
                    qi_rows_(wfmt, wgu, (h16)p[14], (h16)p[15], &xa, M, E, i0, i1, act, I, 0,
                             pack);
                    qi_rows_(wfmt, (const int8_t *)wgu + up_data, (h16)p[14] + up_scales,
                             p[15] ? (h16)p[15] + up_scales : 0, &xa, M, E, i0, i1, up, I, 0,
                             pack);
                    if (!lora) silu_gate_(act, up, M, I, i0, i1);
                }
                LORA_GATE_UP();
#pragma omp for schedule(static)
                for (int64_t m = 0; m < qrows; m++)
                    qi_quantize_row_(wfmt, m < M ? act + m * I : 0, I, &sa_act, m);
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < E; n0 += Q_BLOCK)
                    qi_rows_(wfmt, wdown, (h16)p[16], (h16)p[17], &sa_act, M, I, n0,
                             n0 + Q_BLOCK < E ? n0 + Q_BLOCK : E, h, E, 1, pack);
                LORA_DOWN();
                continue;
            }
            if (qfmt) {
                /* gate rows i0..i1 into act, up rows (I + i0 ..) into up, then SiLU-gated */
                const int64_t up_data = qfmt == 1 ? I * E : I * E / 2;
                const int64_t up_scales = qfmt == 1 ? I * (E / qgroup) : I * (E / 32);
                if (qfmt == 2) block_sums_(x, M, E, xs);
#pragma omp for schedule(static)
                for (int64_t i0 = 0; i0 < I; i0 += Q_BLOCK) {
                    const int64_t i1 = i0 + Q_BLOCK < I ? i0 + Q_BLOCK : I;
                    q_rows_(qfmt, qgroup, wgu, (h16)p[14], (h16)p[15], x, xs, M, E, i0, i1,
                            act, I, 0);
                    q_rows_(qfmt, qgroup, (const int8_t *)wgu + up_data, (h16)p[14] + up_scales,
                            p[15] ? (h16)p[15] + up_scales : 0, x, xs, M, E, i0, i1, up, I, 0);
                    if (!lora) silu_gate_(act, up, M, I, i0, i1);
                }
                LORA_GATE_UP();
                if (qfmt == 2) block_sums_(act, M, I, xs);
#pragma omp for schedule(static)
                for (int64_t n0 = 0; n0 < E; n0 += Q_BLOCK)
                    q_rows_(qfmt, qgroup, wdown, (h16)p[16], (h16)p[17], act, xs, M, I, n0,
                            n0 + Q_BLOCK < E ? n0 + Q_BLOCK : E, h, E, 1);
                LORA_DOWN();
                continue;
            }
#pragma omp for schedule(static)
            for (int64_t i0 = 0; i0 < I; i0 += pb_i) {
                const int64_t i1 = i0 + pb_i < I ? i0 + pb_i : I;
                pair_block(wgu, wgu + I * E, E, x, M, E, i0, i1, act, up, 1, I, 0);
                if (!lora) silu_gate_(act, up, M, I, i0, i1);
            }
            LORA_GATE_UP();
#pragma omp for schedule(static)
            for (int64_t i0 = 0; i0 < E / 2; i0 += pb_e)
                pair_block(wdown, wdown + I, 2 * I, act, M, I, i0,
                           i0 + pb_e < E / 2 ? i0 + pb_e : E / 2, h, h + 1, 2, E, 1);
            LORA_DOWN();
        }
        qa_release_(&xa);
    }
#undef LORA_DESCS
#undef LORA_GATE_UP
#undef LORA_DOWN
}

/* Runs the code of every instruction set this build holds on a tiny input: the library's
 * check before it is used, run in a child process (engine/ops/cpu_ops.py), because a host may
 * list instructions it cannot execute (VMs listing AMX raise SIGILL on a tile instruction),
 * and that must kill a child, not a server. Returns qi_isa(). */
int isa_probe(void) {
    enum { M = 5, N = 6, K = 96, NB = K / 32 };
    static float x[M * K], y[M * N], xsum[M * NB], work[8192], wf[N * K];
    static int8_t q8[N * K];
    static uint8_t q4[N * K / 2];
    static _Float16 sc[N * NB], off[N * NB];
    for (int i = 0; i < M * K; i++) x[i] = (float)(i % 7) - 3.f;
    for (int i = 0; i < N * K; i++) { q8[i] = (int8_t)(i % 11 - 5); wf[i] = 0.01f * (i % 5); }
    for (int i = 0; i < N * K / 2; i++) q4[i] = (uint8_t)(i * 37);
    for (int i = 0; i < N * NB; i++) { sc[i] = (_Float16)0.01f; off[i] = (_Float16)-0.05f; }
    qi_linear(1, x, q8, sc, off, 0, y, M, N, K, work, 1);
    qi_linear(2, x, q4, sc, off, 0, y, M, N, K, work, 1);
    if (qa_enable()) { /* the AMX tiles, 16 weight rows (and 2 more for qa_rest_) */
        static int8_t w8[18 * K];
        static uint8_t w4[18 * K / 2];
        static _Float16 s18[18 * NB], o18[18 * NB];
        static float y18[M * 18];
        for (int i = 0; i < 18 * NB; i++) { s18[i] = (_Float16)0.01f; o18[i] = (_Float16)-0.05f; }
        qa_linear(1, x, w8, s18, o18, 0, y18, M, 18, K, work, 1);
        qa_linear(2, x, w4, s18, o18, 0, y18, M, 18, K, work, 1);
    }
#ifdef QR_ON
    { /* the panels (qr_linear): 6 rows, one panel short of 16 */
        static uint8_t panels[640 * NB] __attribute__((aligned(64)));
        qr_pack(1, q8, sc, off, N, K, panels, 1);
        qr_linear(1, x, panels, 0, y, M, N, K, work, 1);
        qr_pack(2, q4, sc, off, N, K, panels, 1);
        qr_linear(2, x, panels, 0, y, M, N, K, work, 1);
    }
#endif
    q8_linear(x, q8, sc, 0, y, M, N, K, 32, 1);
    q4_linear(x, q4, sc, off, 0, y, M, N, K, xsum, 1);
    gemv(x, wf, 0, y, M, N, K, 1);
    wide_linear(x, wf, 0, y, M, N, K, work, 1);
    rms_norm(x, 0, wf, x, M, K, 1e-6f, 1);
    volatile float sink = y[0] + x[0];
    (void)sink;
    return QI_ISA;
}

/* Grammar masks: in logits row rows[r] (rows `stride` floats apart) every token i whose bit
 * (mask[r * words + i / 32] >> i % 32) & 1 is 0 becomes -inf. A word of all ones (the common
 * case in a permissive state) is skipped whole, one of all zeros filled whole. -inf is
 * written as its bit pattern: -ffast-math assumes no infinities in arithmetic. */
void apply_bitmask(float *logits, int64_t stride, const int64_t *rows, int64_t nrows,
                   const int32_t *mask, int64_t words, int64_t vocab) {
    const uint32_t neg_inf = 0xFF800000u;
    for (int64_t r = 0; r < nrows; r++) {
        uint32_t *row = (uint32_t *)(logits + rows[r] * stride);
        const uint32_t *m = (const uint32_t *)(mask + r * words);
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, end = base + 32 < vocab ? base + 32 : vocab;
            if (bits == 0) {
#pragma omp simd
                for (int64_t i = base; i < end; i++) row[i] = neg_inf;
                continue;
            }
            for (int64_t i = base; i < end; i++)
                if (!((bits >> (i - base)) & 1u)) row[i] = neg_inf;
        }
    }
}
