/* Fused CPU kernels for the engine's decode step (fp32). Built per host by engine/cpu_ops.py
 * with the machine's C compiler (-O3 -march=native -fopenmp) and called through ctypes; every
 * kernel has a pure-torch twin that the tests compare it with, and that runs when this library
 * cannot be built.
 *
 * Why C: a decode step of a small model is ~40 tiny torch ops per layer around four GEMMs;
 * each op costs a dispatch and a pass over memory. At batch 32 the paged-attention gather
 * alone copied every sequence's K/V once per layer before reading it. These kernels read the
 * paged cache in place and fuse the elementwise chains.
 *
 * Threads: the library links the process's libgomp (the one torch loaded), and every parallel
 * region names its thread count (torch's), so the two never oversubscribe the cores.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Paged decode attention: one query token per sequence, K/V read in place from the cache.
 *
 * q:        [B, q_stride] rows, head h at q + b*q_stride + h*D
 * kv_cache: [num_pages, 2, block_size, KVH, D] (K at 0, V at 1)
 * tables:   [B, max_pages] page ids; kv_lens: [B] tokens to attend (>= 1)
 * out:      [B, H, D]
 * Query head h reads KV head h / (H / KVH). Softmax is exact (max, then sum of exp) in fp32,
 * computed over tiles of TILE tokens with a running max (no buffer proportional to L).
 * Built with -ffast-math (vectorized expf), so no infinities are used as sentinels.
 */
#define TILE 128
#define MAX_GROUP 16
#define MAX_D 256

/* One (sequence, KV head) task. Per tile of TILE tokens: the K/V rows' addresses, walking
 * the page table (an integer division per token cost as much as all the arithmetic); then
 * each K row is read once for every query head of the group (scores), the online-softmax
 * update, and each V row is read once into every head's accumulator. Inlined into copies
 * with D a compile-time constant (64, 128), so the D loops unroll into vector registers. */
static inline __attribute__((always_inline)) void decode_task(
        const float *q_b, const float *kv_cache, const int64_t *tab, int64_t L, float *out_b,
        int64_t G, int64_t kvh, const int64_t D, int64_t row, int64_t page, int64_t block_size,
        float scale) {
    float qs[MAX_GROUP][MAX_D], acc[MAX_GROUP][MAX_D], m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][TILE];
    const float *krow[TILE];
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
            krow[i] = kv_cache + tab[p] * page + off * row + kvh * D;
            if (++off == block_size) {
                off = 0;
                p++;
            }
        }
        for (int64_t i = 0; i < n; i++) {
            const float *k = krow[i];
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qs[g][d] * k[d];
                s[g][i] = dot;
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
            const float *v = krow[i] + v_off;
            for (int64_t g = 0; g < G; g++) {
                const float w = s[g][i];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[g][d] += w * v[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *o = out_b + (kvh * G + g) * D;
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; d++) o[d] = acc[g][d] * inv;
    }
}

void paged_decode(const float *q, int64_t q_stride, const float *kv_cache,
                  const int64_t *tables, int64_t max_pages, const int64_t *kv_lens,
                  float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                  int64_t block_size, float scale, int nthreads) {
    const int64_t G = H / KVH;
    const int64_t row = KVH * D;             /* floats per token slot (all KV heads) */
    const int64_t page = 2 * block_size * row; /* floats per page (K and V) */
    int64_t work = 0; /* K/V floats read: below ~64K, waking the thread team costs more */
    for (int64_t b = 0; b < B; b++) work += kv_lens[b] * row * 2;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (work >= 65536)
    for (int64_t task = 0; task < B * KVH; task++) {
        const int64_t b = task / KVH, kvh = task % KVH;
        const float *q_b = q + b * q_stride;
        const int64_t *tab = tables + b * max_pages;
        float *out_b = out + b * H * D;
        if (D == 64)
            decode_task(q_b, kv_cache, tab, kv_lens[b], out_b, G, kvh, 64, row, page,
                        block_size, scale);
        else if (D == 128)
            decode_task(q_b, kv_cache, tab, kv_lens[b], out_b, G, kvh, 128, row, page,
                        block_size, scale);
        else
            decode_task(q_b, kv_cache, tab, kv_lens[b], out_b, G, kvh, D, row, page,
                        block_size, scale);
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
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += xr[i] * xr[i];
        const float r = 1.f / sqrtf(ss / (float)n + eps);
        float *o = out + t * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = weight[i] * (xr[i] * r);
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
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) if (T * heads * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * D, *s = sin_ + t * D;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * stride + h * D, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
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
