/* Hyper-Connections' per-token products on the CPU, each reading its inputs once
   (pretrain/model/hc_native.py builds this file with the C compiler on first use and calls
   it through ctypes; pretrain/model/hc_mix.py has the same products as torch operations and
   the equations).

   Every array is contiguous and token-major: X (T, n, H) is the n-stream state, pre and post
   (T, n), mix (T, n, n) destination-major (Y[k] = sum_l mix[k, l] X[l] + post[k] out), out
   and h (T, H). One token's n x H block is small enough to stay in the first-level cache, so
   each kernel reads and writes every large array once, where torch's batched products over
   tiny n x n matrices read them several times. Tokens are split over `threads` OpenMP
   threads (no reductions cross tokens, so every result is the same whatever the count).

   The kernels exist for float and double (suffix _f32, _f64); the hot loops are compiled
   for AVX-512, AVX2 and the baseline, picked when the library loads (target_clones). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif

/* exp and expf over SIMD lanes: glibc's vector variants (libmvec, linked with -lm, each
   within a few ulp), which math.h declares only under -ffast-math. */
#if defined(__GLIBC__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) double exp(double);
#endif

#define OMP_FOR _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
/* A sum the compiler may vectorise (reassociate) without -ffast-math. */
#define SIMD_SUM(var) _Pragma(SIMD_STR(omp simd reduction(+:var)))
#define SIMD_STR(x) #x
#define CHUNK 64 /* rows per partial sum of a projection's weight gradient */
#define VL 16    /* tokens per Sinkhorn block, one per SIMD lane */
#define LANES _Pragma("omp simd") for (int64_t v = 0; v < VL; v++)

#define KERNELS(real, sfx, EXP)                                                                   \
                                                                                             \
/* h[t] = sum_k pre[t, k] X[t, k] */                                                         \
HOT void hc_read_##sfx(int64_t T, int64_t n, int64_t H, const real *pre, const real *X,     \
                       real *h, int threads) {                                               \
    OMP_FOR                                                                                  \
    for (int64_t t = 0; t < T; t++) {                                                        \
        const real *x = X + t * n * H, *p = pre + t * n;                                     \
        real *o = h + t * H;                                                                 \
        for (int64_t e = 0; e < H; e++) o[e] = p[0] * x[e];                                  \
        for (int64_t k = 1; k < n; k++) {                                                    \
            const real w = p[k], *xk = x + k * H;                                            \
            for (int64_t e = 0; e < H; e++) o[e] += w * xk[e];                               \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* dpre[t, k] = <X[t, k], dh[t]>;  dX[t, k] = pre[t, k] dh[t] (+ dX[t, k] if accumulate) */  \
HOT void hc_read_backward_##sfx(int64_t T, int64_t n, int64_t H, const real *pre,           \
                                const real *X, const real *dh, real *dX, real *dpre,         \
                                int accumulate, int threads) {                               \
    OMP_FOR                                                                                  \
    for (int64_t t = 0; t < T; t++) {                                                        \
        const real *g = dh + t * H;                                                          \
        for (int64_t k = 0; k < n; k++) {                                                    \
            const real *x = X + (t * n + k) * H, w = pre[t * n + k];                         \
            real *d = dX + (t * n + k) * H, dot = 0;                                         \
            if (accumulate) {                                                                \
                SIMD_SUM(dot)                                                                \
                for (int64_t e = 0; e < H; e++) { dot += x[e] * g[e]; d[e] += w * g[e]; }    \
            } else {                                                                         \
                SIMD_SUM(dot)                                                                \
                for (int64_t e = 0; e < H; e++) { dot += x[e] * g[e]; d[e] = w * g[e]; }     \
            }                                                                                \
            dpre[t * n + k] = dot;                                                           \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Y[t, k] = sum_l mix[t, k, l] X[t, l] + post[t, k] out[t] */                               \
HOT void hc_write_##sfx(int64_t T, int64_t n, int64_t H, const real *mix, const real *X,    \
                        const real *post, const real *out, real *Y, int threads) {           \
    OMP_FOR                                                                                  \
    for (int64_t t = 0; t < T; t++) {                                                        \
        const real *x = X + t * n * H, *u = out + t * H, *m = mix + t * n * n;               \
        for (int64_t k = 0; k < n; k++) {                                                    \
            real *y = Y + (t * n + k) * H;                                                   \
            const real b = post[t * n + k];                                                  \
            for (int64_t e = 0; e < H; e++) y[e] = b * u[e];                                 \
            for (int64_t l = 0; l < n; l++) {                                                \
                const real w = m[k * n + l], *xl = x + l * H;                                \
                for (int64_t e = 0; e < H; e++) y[e] += w * xl[e];                           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The write's backward for the gradient dY: dX[t, l] = sum_k mix[t, k, l] dY[t, k],         \
   dmix[t, k, l] = <dY[t, k], X[t, l]>, dpost[t, k] = <dY[t, k], out[t]>,                   \
   dout[t] = sum_k post[t, k] dY[t, k]. */                                                   \
HOT void hc_write_backward_##sfx(int64_t T, int64_t n, int64_t H, const real *mix,          \
                                 const real *X, const real *post, const real *out,           \
                                 const real *dY, real *dX, real *dmix, real *dpost,          \
                                 real *dout, int threads) {                                  \
    OMP_FOR                                                                                  \
    for (int64_t t = 0; t < T; t++) {                                                        \
        const real *x = X + t * n * H, *u = out + t * H, *m = mix + t * n * n;               \
        const real *g = dY + t * n * H;                                                      \
        real *dx = dX + t * n * H, *du = dout + t * H;                                       \
        for (int64_t k = 0; k < n; k++) {                                                    \
            const real *gk = g + k * H;                                                      \
            real dot = 0;                                                                    \
            SIMD_SUM(dot)                                                                    \
            for (int64_t e = 0; e < H; e++) dot += gk[e] * u[e];                             \
            dpost[t * n + k] = dot;                                                          \
            for (int64_t l = 0; l < n; l++) {                                                \
                const real *xl = x + l * H;                                                  \
                real s = 0;                                                                  \
                SIMD_SUM(s)                                                                  \
                for (int64_t e = 0; e < H; e++) s += gk[e] * xl[e];                          \
                dmix[(t * n + k) * n + l] = s;                                               \
            }                                                                                \
        }                                                                                    \
        for (int64_t e = 0; e < H; e++) du[e] = post[t * n] * g[e];                          \
        for (int64_t k = 1; k < n; k++) {                                                    \
            const real b = post[t * n + k], *gk = g + k * H;                                 \
            for (int64_t e = 0; e < H; e++) du[e] += b * gk[e];                              \
        }                                                                                    \
        for (int64_t l = 0; l < n; l++) {                                                    \
            real *d = dx + l * H;                                                            \
            const real w0 = m[l];                                                            \
            for (int64_t e = 0; e < H; e++) d[e] = w0 * g[e];                                \
            for (int64_t k = 1; k < n; k++) {                                                \
                const real w = m[k * n + l], *gk = g + k * H;                                \
                for (int64_t e = 0; e < H; e++) d[e] += w * gk[e];                           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* s[r] = <x[r], x[r]> over `rows` rows of `len` */                                        \
HOT void hc_sumsq_##sfx(int64_t rows, int64_t len, const real *x, real *s, int threads) {   \
    OMP_FOR                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                     \
        const real *v = x + r * len;                                                         \
        real a = 0;                                                                          \
        SIMD_SUM(a)                                                                          \
        for (int64_t e = 0; e < len; e++) a += v[e] * v[e];                                  \
        s[r] = a;                                                                            \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The projection of RMS-normalised rows without a norm weight, before the 1 / rms factor:  \
   y[r, j] = <x[r], projT[j]> and s[r] = <x[r], x[r]> for `rows` rows of `len`, m outputs. */ \
HOT void hc_rms_project_##sfx(int64_t rows, int64_t len, int64_t m, const real *x,         \
                              const real *projT, real *y, real *s, int threads) {            \
    OMP_FOR                                                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                     \
        const real *v = x + r * len;                                                         \
        real a = 0;                                                                          \
        SIMD_SUM(a)                                                                          \
        for (int64_t e = 0; e < len; e++) a += v[e] * v[e];                                  \
        s[r] = a;                                                                            \
        for (int64_t j = 0; j < m; j++) {                                                    \
            const real *p = projT + j * len;                                                 \
            real d = 0;                                                                      \
            SIMD_SUM(d)                                                                      \
            for (int64_t e = 0; e < len; e++) d += v[e] * p[e];                              \
            y[r * m + j] = d;                                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Its backward for z = y rinv (rinv[r] = 1 / rms(x[r])) and the gradient dz: with           \
   gy = dz rinv and c[r] = -rinv^3 / len sum_j dz[r, j] y[r, j],                             \
   dx[r] = sum_j gy[r, j] projT[j] + c[r] x[r] (added to dx if accumulate) and               \
   dprojT[j] = sum_r gy[r, j] x[r], summed per CHUNK rows, then the chunks in order (the     \
   same sum whatever the thread count). Returns 0, or 1 if out of memory. */                 \
HOT int hc_rms_project_backward_##sfx(int64_t rows, int64_t len, int64_t m, const real *x,  \
                                      const real *projT, const real *dz, const real *y,      \
                                      const real *rinv, real *dx, real *dprojT,              \
                                      int accumulate, int threads) {                         \
    const int64_t chunks = (rows + CHUNK - 1) / CHUNK, width = m * len;                      \
    real *partial = calloc((size_t)(chunks * width), sizeof(real));                          \
    if (!partial) return 1;                                                                  \
    OMP_FOR                                                                                  \
    for (int64_t c = 0; c < chunks; c++) {                                                   \
        real *acc = partial + c * width;                                                     \
        const int64_t end = (c + 1) * CHUNK < rows ? (c + 1) * CHUNK : rows;                 \
        for (int64_t r = c * CHUNK; r < end; r++) {                                          \
            const real *v = x + r * len, ri = rinv[r];                                       \
            real *d = dx + r * len, dot = 0;                                                 \
            for (int64_t j = 0; j < m; j++) dot += dz[r * m + j] * y[r * m + j];             \
            const real coef = -dot * ri * ri * ri / (real)len;                               \
            if (accumulate)                                                                  \
                for (int64_t e = 0; e < len; e++) d[e] += coef * v[e];                       \
            else                                                                             \
                for (int64_t e = 0; e < len; e++) d[e] = coef * v[e];                        \
            for (int64_t j = 0; j < m; j++) {                                                \
                const real g = dz[r * m + j] * ri, *p = projT + j * len;                     \
                real *a = acc + j * len;                                                     \
                for (int64_t e = 0; e < len; e++) { d[e] += g * p[e]; a[e] += g * v[e]; }    \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    OMP_FOR                                                                                  \
    for (int64_t i = 0; i < width; i++) {                                                    \
        real a = 0;                                                                          \
        for (int64_t c = 0; c < chunks; c++) a += partial[c * width + i];                    \
        dprojT[i] = a;                                                                       \
    }                                                                                        \
    free(partial);                                                                           \
    return 0;                                                                                \
}                                                                                            \
                                                                                             \
/* The Sinkhorn kernels run VL tokens at once, one per SIMD lane: a block's n x n matrices   \
   lie lane-major ([i * n + j][v], token t0 + v), so every elementwise step is a loop over   \
   the VL lanes that the compiler vectorises across tokens. The last block's unused lanes    \
   hold zero logits (a harmless uniform matrix) and are never written back. Each lane runs   \
   the same operations in the same order as one token alone.                                 \
                                                                                             \
   The Sinkhorn iterates of the block of `used` tokens at a (token-major (used, n, n)) into  \
   ms: M_0 = exp(logits - max over the token's matrix), then rows to sum 1, columns to sum   \
   1, `iters` times; with `keep` all 2 iters + 1 iterates (each nn x VL) are kept, else      \
   the last overwrites M_0 in place. `sums` has room for n x VL values. */                   \
static inline void sinkhorn_block_##sfx(int64_t n, int64_t iters, const real *a,             \
                                        int64_t used, int keep, real *ms, real *sums) {      \
    const int64_t nn = n * n, step = keep ? nn * VL : 0;                                     \
    for (int64_t v = 0; v < VL; v++)                                                         \
        for (int64_t i = 0; i < nn; i++) ms[i * VL + v] = v < used ? a[v * nn + i] : 0;      \
    real top[VL];                                                                            \
    LANES top[v] = ms[v];                                                                    \
    for (int64_t i = 1; i < nn; i++) {                                                       \
        const real *x = ms + i * VL;                                                         \
        LANES top[v] = x[v] > top[v] ? x[v] : top[v];                                        \
    }                                                                                        \
    for (int64_t i = 0; i < nn; i++) {                                                       \
        real *x = ms + i * VL;                                                               \
        LANES x[v] = EXP(x[v] - top[v]);                                                     \
    }                                                                                        \
    for (int64_t it = 0; it < 2 * iters; it++) {                                             \
        const real *m = ms + it * step;                                                      \
        real *o = ms + (it + 1) * step;                                                      \
        if (it % 2 == 0) { /* rows */                                                        \
            for (int64_t i = 0; i < n; i++) {                                                \
                const real *mi = m + i * n * VL;                                             \
                real *oi = o + i * n * VL, inv[VL];                                          \
                LANES inv[v] = mi[v];                                                        \
                for (int64_t j = 1; j < n; j++) LANES inv[v] += mi[j * VL + v];              \
                LANES inv[v] = 1 / inv[v];                                                   \
                for (int64_t j = 0; j < n; j++)                                              \
                    LANES oi[j * VL + v] = mi[j * VL + v] * inv[v];                          \
            }                                                                                \
        } else { /* columns */                                                               \
            for (int64_t j = 0; j < n; j++) LANES sums[j * VL + v] = m[j * VL + v];          \
            for (int64_t i = 1; i < n; i++)                                                  \
                for (int64_t j = 0; j < n; j++)                                              \
                    LANES sums[j * VL + v] += m[(i * n + j) * VL + v];                       \
            for (int64_t j = 0; j < n; j++) LANES sums[j * VL + v] = 1 / sums[j * VL + v];   \
            for (int64_t i = 0; i < n; i++)                                                  \
                for (int64_t j = 0; j < n; j++) LANES {                                      \
                    const int64_t k = (i * n + j) * VL + v;                                  \
                    o[k] = m[k] * sums[j * VL + v];                                          \
                }                                                                            \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* out[t] = the last iterate of token t's logits (T, n, n). Returns 0, or 1 if out of        \
   memory. */                                                                                \
HOT int hc_sinkhorn_##sfx(int64_t T, int64_t n, int64_t iters, const real *logits,           \
                          real *out, int threads) {                                          \
    const int64_t nn = n * n, blocks = (T + VL - 1) / VL;                                    \
    int failed = 0;                                                                          \
    _Pragma("omp parallel num_threads(threads) if(threads > 1) reduction(|:failed)")         \
    {                                                                                        \
        real *ms = aligned_alloc(64, sizeof(real) * (nn + n) * VL);                          \
        if (!ms) failed = 1;                                                                 \
        else {                                                                               \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t b = 0; b < blocks; b++) {                                           \
                const int64_t t0 = b * VL, used = T - t0 < VL ? T - t0 : VL;                 \
                sinkhorn_block_##sfx(n, iters, logits + t0 * nn, used, 0, ms, ms + nn * VL); \
                for (int64_t v = 0; v < used; v++)                                           \
                    for (int64_t i = 0; i < nn; i++)                                         \
                        out[(t0 + v) * nn + i] = ms[i * VL + v];                             \
            }                                                                                \
            free(ms);                                                                        \
        }                                                                                    \
    }                                                                                        \
    return failed;                                                                           \
}                                                                                            \
                                                                                             \
/* dlogits for the gradient of the last iterate: the iterates recomputed, then the chain     \
   rule of y = x / sum x (dx = (dy - sum(dy y)) / sum x) in reverse, times M_0. Returns 0,   \
   or 1 if out of memory. */                                                                 \
HOT int hc_sinkhorn_backward_##sfx(int64_t T, int64_t n, int64_t iters, const real *logits,  \
                                   const real *grad, real *dlogits, int threads) {           \
    const int64_t nn = n * n, per = (2 * iters + 1) * nn * VL, blocks = (T + VL - 1) / VL;   \
    int failed = 0;                                                                          \
    _Pragma("omp parallel num_threads(threads) if(threads > 1) reduction(|:failed)")         \
    {                                                                                        \
        real *ms = aligned_alloc(64, sizeof(real) * (per + (nn + 2 * n) * VL));              \
        if (!ms) failed = 1;                                                                 \
        else {                                                                               \
            real *g = ms + per, *sums = g + nn * VL, *dots = sums + n * VL;                  \
            _Pragma("omp for schedule(static)")                                              \
            for (int64_t b = 0; b < blocks; b++) {                                           \
                const int64_t t0 = b * VL, used = T - t0 < VL ? T - t0 : VL;                 \
                sinkhorn_block_##sfx(n, iters, logits + t0 * nn, used, 1, ms, sums);         \
                for (int64_t v = 0; v < VL; v++)                                             \
                    for (int64_t i = 0; i < nn; i++)                                         \
                        g[i * VL + v] = v < used ? grad[(t0 + v) * nn + i] : 0;              \
                for (int64_t it = 2 * iters - 1; it >= 0; it--) {                            \
                    const real *m = ms + it * nn * VL, *y = m + nn * VL;                     \
                    if (it % 2 == 0) { /* rows */                                            \
                        for (int64_t i = 0; i < n; i++) {                                    \
                            const real *mi = m + i * n * VL, *yi = y + i * n * VL;           \
                            real *gi = g + i * n * VL, sum[VL], dot[VL];                     \
                            LANES {                                                          \
                                sum[v] = mi[v];                                              \
                                dot[v] = gi[v] * yi[v];                                      \
                            }                                                                \
                            for (int64_t j = 1; j < n; j++) LANES {                          \
                                sum[v] += mi[j * VL + v];                                    \
                                dot[v] += gi[j * VL + v] * yi[j * VL + v];                   \
                            }                                                                \
                            LANES sum[v] = 1 / sum[v];                                       \
                            for (int64_t j = 0; j < n; j++)                                  \
                                LANES gi[j * VL + v] = (gi[j * VL + v] - dot[v]) * sum[v];   \
                        }                                                                    \
                    } else { /* columns */                                                   \
                        for (int64_t j = 0; j < n; j++) LANES {                              \
                            sums[j * VL + v] = m[j * VL + v];                                \
                            dots[j * VL + v] = g[j * VL + v] * y[j * VL + v];                \
                        }                                                                    \
                        for (int64_t i = 1; i < n; i++)                                      \
                            for (int64_t j = 0; j < n; j++) LANES {                          \
                                const int64_t k = (i * n + j) * VL + v;                      \
                                sums[j * VL + v] += m[k];                                    \
                                dots[j * VL + v] += g[k] * y[k];                             \
                            }                                                                \
                        for (int64_t j = 0; j < n; j++)                                      \
                            LANES sums[j * VL + v] = 1 / sums[j * VL + v];                   \
                        for (int64_t i = 0; i < n; i++)                                      \
                            for (int64_t j = 0; j < n; j++) LANES {                          \
                                const int64_t k = (i * n + j) * VL + v;                      \
                                g[k] = (g[k] - dots[j * VL + v]) * sums[j * VL + v];         \
                            }                                                                \
                    }                                                                        \
                }                                                                            \
                for (int64_t v = 0; v < used; v++)                                           \
                    for (int64_t i = 0; i < nn; i++)                                         \
                        dlogits[(t0 + v) * nn + i] = g[i * VL + v] * ms[i * VL + v];         \
            }                                                                                \
            free(ms);                                                                        \
        }                                                                                    \
    }                                                                                        \
    return failed;                                                                           \
}

KERNELS(float, f32, expf)
KERNELS(double, f64, exp)
