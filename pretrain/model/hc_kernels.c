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

/* exp, expf, tanh and tanhf over SIMD lanes: glibc's vector variants (libmvec, linked with
   -lm, each within a few ulp; tanh from glibc 2.35), which math.h declares only under
   -ffast-math. */
#if defined(__GLIBC__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) double exp(double);
#if __GLIBC_PREREQ(2, 35) /* libmvec's tanh */
__attribute__((simd("notinbranch"))) float tanhf(float);
__attribute__((simd("notinbranch"))) double tanh(double);
#endif
#endif

/* The per-token helpers: inlined into each caller, so that each compiles for its clone's
   instruction set (a helper called from two kernels would otherwise be one baseline copy). */
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

#define OMP_FOR _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")
/* A sum the compiler may vectorise (reassociate) without -ffast-math. */
#define SIMD_SUM(var) _Pragma(SIMD_STR(omp simd reduction(+:var)))
#define SIMD_STR(x) #x
#define CHUNK 64 /* rows per partial sum of a projection's weight gradient */
#define VL 16    /* tokens per Sinkhorn block, one per SIMD lane; values per vector below */
#define LANES _Pragma("omp simd") for (int64_t v = 0; v < VL; v++)

/* VL values as one (GCC's vector extension): a loop's partial sums that stay in registers,
   where an array indexed in the loop goes through memory on every step. Loaded from and
   stored to any element (unaligned, aliasing the arrays). */
typedef float vf32 __attribute__((vector_size(VL * sizeof(float)), aligned(4), may_alias));
typedef double vf64 __attribute__((vector_size(VL * sizeof(double)), aligned(8), may_alias));
#define LOADV(sfx, p) (*(const v##sfx *)(p))
#define STOREV(sfx, p, val) (*(v##sfx *)(p) = (val))

/* fn(n, ...) with n a constant for the usual stream counts, so that the loops over the
   streams unroll and the per-stream partial sums stay in registers; else n as it is. */
#define BY_STREAMS(fn, n, ...)                                                              \
    do {                                                                                    \
        if ((n) == 4) fn(4, __VA_ARGS__);                                                   \
        else if ((n) == 2) fn(2, __VA_ARGS__);                                              \
        else fn(n, __VA_ARGS__);                                                            \
    } while (0)

#define KERNELS(real, sfx, EXP, TANH)                                                        \
                                                                                             \
/* The VL lanes' sum, pairwise (the same order every time). */                               \
INLINE real lanes_sum_##sfx(v##sfx a) {                                                      \
    real s[VL];                                                                              \
    memcpy(s, &a, sizeof s);                                                                 \
    for (int64_t half = VL / 2; half > 0; half /= 2)                                         \
        for (int64_t i = 0; i < half; i++) s[i] += s[i + half];                              \
    return s[0];                                                                             \
}                                                                                            \
                                                                                             \
/* h[t] = sum_k pre[t, k] X[t, k] */                                                         \
HOT void hc_read_##sfx(int64_t T, int64_t n, int64_t H, const real *pre, const real *X,      \
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
HOT void hc_read_backward_##sfx(int64_t T, int64_t n, int64_t H, const real *pre,            \
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
/* One token's write: y[k] = sum_l m[k, l] x[l] + p[k] u (m destination-major, (n, n)). */   \
INLINE void write_token_##sfx(int64_t n, int64_t H, const real *m, const real *x,            \
                              const real *p, const real *u, real *y) {                       \
    for (int64_t k = 0; k < n; k++) {                                                        \
        real *yk = y + k * H;                                                                \
        const real b = p[k];                                                                 \
        for (int64_t e = 0; e < H; e++) yk[e] = b * u[e];                                    \
        for (int64_t l = 0; l < n; l++) {                                                    \
            const real w = m[k * n + l], *xl = x + l * H;                                    \
            for (int64_t e = 0; e < H; e++) yk[e] += w * xl[e];                              \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Y[t, k] = sum_l mix[t, k, l] X[t, l] + post[t, k] out[t] */                               \
HOT void hc_write_##sfx(int64_t T, int64_t n, int64_t H, const real *mix, const real *X,     \
                        const real *post, const real *out, real *Y, int threads) {           \
    OMP_FOR                                                                                  \
    for (int64_t t = 0; t < T; t++)                                                          \
        BY_STREAMS(write_token_##sfx, n, H, mix + t * n * n, X + t * n * H, post + t * n,    \
                   out + t * H, Y + t * n * H);                                              \
}                                                                                            \
                                                                                             \
/* One token's write backward for its gradient g (n, H): dx[l] = sum_k m[k, l] g[k],         \
   dm[k, l] = <g[k], x[l]>, dp[k] = <g[k], u>, du = sum_k p[k] g[k]. */                      \
INLINE void write_backward_token_##sfx(int64_t n, int64_t H, const real *m,                  \
                                       const real *x, const real *p, const real *u,          \
                                       const real *g, real *dx, real *dm, real *dp,          \
                                       real *du) {                                           \
    for (int64_t k = 0; k < n; k++) {                                                        \
        const real *gk = g + k * H;                                                          \
        real dot = 0;                                                                        \
        SIMD_SUM(dot)                                                                        \
        for (int64_t e = 0; e < H; e++) dot += gk[e] * u[e];                                 \
        dp[k] = dot;                                                                         \
        for (int64_t l = 0; l < n; l++) {                                                    \
            const real *xl = x + l * H;                                                      \
            real s = 0;                                                                      \
            SIMD_SUM(s)                                                                      \
            for (int64_t e = 0; e < H; e++) s += gk[e] * xl[e];                              \
            dm[k * n + l] = s;                                                               \
        }                                                                                    \
    }                                                                                        \
    for (int64_t e = 0; e < H; e++) du[e] = p[0] * g[e];                                     \
    for (int64_t k = 1; k < n; k++) {                                                        \
        const real b = p[k], *gk = g + k * H;                                                \
        for (int64_t e = 0; e < H; e++) du[e] += b * gk[e];                                  \
    }                                                                                        \
    for (int64_t l = 0; l < n; l++) {                                                        \
        real *d = dx + l * H;                                                                \
        const real w0 = m[l];                                                                \
        for (int64_t e = 0; e < H; e++) d[e] = w0 * g[e];                                    \
        for (int64_t k = 1; k < n; k++) {                                                    \
            const real w = m[k * n + l], *gk = g + k * H;                                    \
            for (int64_t e = 0; e < H; e++) d[e] += w * gk[e];                               \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The write's backward for the gradient dY: dX[t, l] = sum_k mix[t, k, l] dY[t, k],         \
   dmix[t, k, l] = <dY[t, k], X[t, l]>, dpost[t, k] = <dY[t, k], out[t]>,                    \
   dout[t] = sum_k post[t, k] dY[t, k]. */                                                   \
HOT void hc_write_backward_##sfx(int64_t T, int64_t n, int64_t H, const real *mix,           \
                                 const real *X, const real *post, const real *out,           \
                                 const real *dY, real *dX, real *dmix, real *dpost,          \
                                 real *dout, int threads) {                                  \
    OMP_FOR                                                                                  \
    for (int64_t t = 0; t < T; t++)                                                          \
        BY_STREAMS(write_backward_token_##sfx, n, H, mix + t * n * n, X + t * n * H,         \
                   post + t * n, out + t * H, dY + t * n * H, dX + t * n * H,                \
                   dmix + t * n * n, dpost + t * n, dout + t * H);                           \
}                                                                                            \
                                                                                             \
/* s[r] = <x[r], x[r]> over `rows` rows of `len` */                                          \
HOT void hc_sumsq_##sfx(int64_t rows, int64_t len, const real *x, real *s, int threads) {    \
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
/* One token's dynamic HC weights and read (hc_dynamic_read): x (n, H) -> h (H), p, post     \
   (n), mix (n, n), yt, zt (n, w), r (n). Each stream's w + 1 sums in one pass (VL partial   \
   sums each, in registers); the token's n w tanh in one SIMD loop. */                       \
INLINE void dynamic_read_token_##sfx(int64_t n, int64_t H, const real *x, const real *projT, \
                                     const real *Am, const real *Ar, const real *B, real sa, \
                                     real sb, double eps, real *h, real *p, real *mix,       \
                                     real *post, real *yt, real *zt, real *r) {              \
    const int64_t w = n + 2;                                                                 \
    for (int64_t l = 0; l < n; l++) {                                                        \
        const real *xl = x + l * H;                                                          \
        v##sfx s[w + 1]; /* |X[l]|^2, then the w products */                                 \
        for (int64_t j = 0; j <= w; j++) s[j] = (v##sfx){0};                                 \
        int64_t e0 = 0;                                                                      \
        for (; e0 + VL <= H; e0 += VL) {                                                     \
            const v##sfx xb = LOADV(sfx, xl + e0);                                           \
            s[0] += xb * xb;                                                                 \
            for (int64_t j = 0; j < w; j++) s[j + 1] += xb * LOADV(sfx, projT + j * H + e0); \
        }                                                                                    \
        real sums[w + 1];                                                                    \
        for (int64_t j = 0; j <= w; j++) {                                                   \
            real a = lanes_sum_##sfx(s[j]);                                                  \
            const real *pj = j == 0 ? xl : projT + (j - 1) * H;                              \
            for (int64_t e = e0; e < H; e++) a += xl[e] * pj[e];                             \
            sums[j] = a;                                                                     \
        }                                                                                    \
        r[l] = (real)(1 / sqrt((double)sums[0] / (double)H + eps));                          \
        for (int64_t j = 0; j < w; j++) yt[l * w + j] = sums[j + 1];                         \
    }                                                                                        \
    real q[n * w];                                                                           \
    for (int64_t i = 0; i < n * w; i++) q[i] = yt[i] * r[i / w];                             \
    _Pragma("omp simd")                                                                      \
    for (int64_t i = 0; i < n * w; i++) zt[i] = TANH(q[i]);                                  \
    for (int64_t l = 0; l < n; l++) {                                                        \
        p[l] = Am[l] + sa * zt[l * w];                                                       \
        post[l] = B[l] + sb * zt[l * w + n + 1];                                             \
        for (int64_t k = 0; k < n; k++)                                                      \
            mix[k * n + l] = Ar[l * n + k] + sa * zt[l * w + 1 + k];                         \
    }                                                                                        \
    for (int64_t e = 0; e < H; e++) h[e] = p[0] * x[e];                                      \
    for (int64_t l = 1; l < n; l++) {                                                        \
        const real wl = p[l], *xl = x + l * H;                                               \
        for (int64_t e = 0; e < H; e++) h[e] += wl * xl[e];                                  \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Dynamic HC's weights and read of one sub-layer, one pass over each token's state:         \
   with w = n + 2 projections per stream (projT (w, H)), scale = (s_a, s_b) and the static   \
   Am (n), Ar (n, n) source-major, B (n):                                                    \
     y[l, j] = <X[l], projT[j]>,  r[l] = 1 / sqrt(|X[l]|^2 / H + eps),  z = tanh(y r),       \
     pre[l] = Am[l] + s_a z[l, 0],  mix[k, l] = Ar[l, k] + s_a z[l, 1 + k],                  \
     post[l] = B[l] + s_b z[l, n + 1],  h = sum_l pre[l] X[l].                               \
   Writes h (T, H), pre, post (T, n), mix (T, n, n) destination-major, and for the backward  \
   y, z (T, n, w) and r (T, n). */                                                           \
HOT void hc_dynamic_read_##sfx(int64_t T, int64_t n, int64_t H, const real *X,               \
                               const real *projT, const real *Am, const real *Ar,            \
                               const real *B, const real *scale, double eps, real *h,        \
                               real *pre, real *mix, real *post, real *y, real *z, real *r,  \
                               int threads) {                                                \
    const int64_t w = n + 2;                                                                 \
    OMP_FOR                                                                                  \
    for (int64_t t = 0; t < T; t++)                                                          \
        BY_STREAMS(dynamic_read_token_##sfx, n, H, X + t * n * H, projT, Am, Ar, B,          \
                   scale[0], scale[1], eps, h + t * H, pre + t * n, mix + t * n * n,         \
                   post + t * n, y + t * n * w, z + t * n * w, r + t * n);                   \
}                                                                                            \
                                                                                             \
/* One token's dynamic read backward (hc_dynamic_read_backward): adds its sums over tokens   \
   to acc (dprojT, (w, H)) and sm (dAm, dAr, dB, dscale); writes (or adds to) dx (n, H). */  \
INLINE void dynamic_read_backward_token_##sfx(int64_t n, int64_t H, const real *x,           \
                                              const real *projT, real sa, real sb,           \
                                              const real *pre, const real *yt,               \
                                              const real *zt, const real *r,                 \
                                              const real *g, const real *dm,                 \
                                              const real *dpost, real *acc, real *sm,        \
                                              real *dx, int accumulate) {                    \
    const int64_t w = n + 2, small = n + n * n + n + 2;                                      \
    real du[w], gy[w];                                                                       \
    for (int64_t l = 0; l < n; l++) {                                                        \
        const real *xl = x + l * H, *zl = zt + l * w, rl = r[l];                             \
        real dp = 0;                                                                         \
        SIMD_SUM(dp)                                                                         \
        for (int64_t e = 0; e < H; e++) dp += xl[e] * g[e];                                  \
        const real dq = dpost[l];                                                            \
        sm[l] += dp;                                                                         \
        sm[n + n * n + l] += dq;                                                             \
        sm[small - 2] += dp * zl[0];                                                         \
        sm[small - 1] += dq * zl[n + 1];                                                     \
        du[0] = sa * dp;                                                                     \
        du[n + 1] = sb * dq;                                                                 \
        for (int64_t k = 0; k < n; k++) {                                                    \
            sm[n + l * n + k] += dm[k * n + l];                                              \
            sm[small - 2] += dm[k * n + l] * zl[1 + k];                                      \
            du[1 + k] = sa * dm[k * n + l];                                                  \
        }                                                                                    \
        real dot = 0;                                                                        \
        for (int64_t j = 0; j < w; j++) {                                                    \
            du[j] *= 1 - zl[j] * zl[j];                                                      \
            dot += du[j] * yt[l * w + j];                                                    \
            gy[j] = du[j] * rl;                                                              \
        }                                                                                    \
        const real coef = -dot * rl * rl * rl / (real)H, pl = pre[l];                        \
        real *d = dx + l * H;                                                                \
        int64_t e0 = 0;                                                                      \
        for (; e0 + VL <= H; e0 += VL) { /* a block of dX[l] summed in registers */          \
            const real *xb = xl + e0, *gb = g + e0;                                          \
            real blk[VL];                                                                    \
            LANES blk[v] = pl * gb[v] + coef * xb[v];                                        \
            for (int64_t j = 0; j < w; j++) {                                                \
                const real gj = gy[j], *pb = projT + j * H + e0;                             \
                real *ab = acc + j * H + e0;                                                 \
                LANES { blk[v] += gj * pb[v]; ab[v] += gj * xb[v]; }                         \
            }                                                                                \
            real *db = d + e0;                                                               \
            if (accumulate) { LANES db[v] += blk[v]; }                                       \
            else { LANES db[v] = blk[v]; }                                                   \
        }                                                                                    \
        for (int64_t e = e0; e < H; e++) {                                                   \
            real a = pl * g[e] + coef * xl[e];                                               \
            for (int64_t j = 0; j < w; j++) {                                                \
                a += gy[j] * projT[j * H + e];                                               \
                acc[j * H + e] += gy[j] * xl[e];                                             \
            }                                                                                \
            d[e] = (accumulate ? d[e] : 0) + a;                                              \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* The chunks' partial sums (rows of w H + small), added in order. */                        \
INLINE void dynamic_read_sums_##sfx(int64_t chunks, int64_t n, int64_t H,                    \
                                    const real *partial, real *dprojT, real *dAm,            \
                                    real *dAr, real *dB, real *dscale, int threads) {        \
    const int64_t w = n + 2, small = n + n * n + n + 2, width = w * H + small;               \
    OMP_FOR                                                                                  \
    for (int64_t i = 0; i < width; i++) {                                                    \
        real a = 0;                                                                          \
        for (int64_t c = 0; c < chunks; c++) a += partial[c * width + i];                    \
        if (i < w * H) dprojT[i] = a;                                                        \
        else {                                                                               \
            const int64_t s = i - w * H;                                                     \
            if (s < n) dAm[s] = a;                                                           \
            else if (s < n + n * n) dAr[s - n] = a;                                          \
            else if (s < small - 2) dB[s - n - n * n] = a;                                   \
            else dscale[s - (small - 2)] = a;                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
                                                                                             \
/* Its backward for dh (T, H), dmix (T, n, n) and dpost (T, n): per token                    \
     dpre[l] = <X[l], dh>, the gradient of z: dz[l, 0] = s_a dpre[l],                        \
     dz[l, 1 + k] = s_a dmix[k, l], dz[l, n + 1] = s_b dpost[l]; du = dz (1 - z^2),          \
     gy = du r[l], c[l] = -r[l]^3 / H sum_j du[l, j] y[l, j];                                \
     dX[l] = pre[l] dh + sum_j gy[l, j] projT[j] + c[l] X[l]  (added to dX if accumulate),   \
   and summed over tokens (per CHUNK tokens, then the chunks in order): dprojT[j] =          \
   sum gy[l, j] X[l], dAm = sum dpre, dAr[l, k] = sum dmix[k, l], dB = sum dpost,            \
   dscale = (sum dpre z[., 0] + dmix z[., 1 + k], sum dpost z[., n + 1]). Returns 0, or 1    \
   if out of memory. */                                                                      \
HOT int hc_dynamic_read_backward_##sfx(int64_t T, int64_t n, int64_t H, const real *X,       \
                                       const real *projT, const real *scale,                 \
                                       const real *pre, const real *y, const real *z,        \
                                       const real *r, const real *dh, const real *dmix,      \
                                       const real *dpost, real *dX, int accumulate,          \
                                       real *dprojT, real *dAm, real *dAr, real *dB,         \
                                       real *dscale, int threads) {                          \
    const int64_t w = n + 2, chunks = (T + CHUNK - 1) / CHUNK;                               \
    const int64_t width = w * H + n + n * n + n + 2;                                         \
    real *partial = calloc((size_t)(chunks * width), sizeof(real));                          \
    if (!partial) return 1;                                                                  \
    OMP_FOR                                                                                  \
    for (int64_t c = 0; c < chunks; c++) {                                                   \
        real *acc = partial + c * width;                                                     \
        const int64_t end = (c + 1) * CHUNK < T ? (c + 1) * CHUNK : T;                       \
        for (int64_t t = c * CHUNK; t < end; t++)                                            \
            BY_STREAMS(dynamic_read_backward_token_##sfx, n, H, X + t * n * H, projT,        \
                       scale[0], scale[1], pre + t * n, y + t * n * w, z + t * n * w,        \
                       r + t * n, dh + t * H, dmix + t * n * n, dpost + t * n, acc,          \
                       acc + w * H, dX + t * n * H, accumulate);                             \
    }                                                                                        \
    dynamic_read_sums_##sfx(chunks, n, H, partial, dprojT, dAm, dAr, dB, dscale, threads);   \
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
INLINE void sinkhorn_block_##sfx(int64_t n, int64_t iters, const real *a,                    \
                                 int64_t used, int keep, real *ms, real *sums) {             \
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

KERNELS(float, f32, expf, tanhf)
KERNELS(double, f64, exp, tanh)
