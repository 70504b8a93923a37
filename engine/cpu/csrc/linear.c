/* kvpilot's CPU linear layer: y[M][N] = x[M][K] W^T (+ bias), with W packed once at load time.
 *
 * Why our own: a decode step multiplies a few rows (M = running sequences) by every weight once.
 * oneDNN's packed kernels reached 55-85 % of this VM's FMA peak there (bench/cpu_small_m_linears.py)
 * and cost a fixed overhead per call, 120 calls per step; this kernel streams each weight panel
 * once per 8 rows with every accumulator in a register.
 *
 * Packed layouts (N a multiple of 16: the Python side keeps oneDNN for other widths):
 *   float32:  [N/16][K][16]      a panel of 16 output columns, one 64-byte row per k;
 *   bfloat16: [N/16][K/2][16][2] the same with k in pairs (K even), the operand layout of
 *             vdpbf16ps: each 32-bit lane holds W[n][k], W[n][k+1].
 * Tiles of up to 8 rows x 3 panels (24 zmm accumulators); work items are (chunk of 64 rows,
 * 3 panels), split statically between the OpenMP threads, so with few rows each thread streams a
 * contiguous run of panels and with many rows a chunk of x stays in cache across panels.
 *
 * Numerics: float32 accumulation in k order per row (fused multiply-adds; bfloat16 pairs summed by
 * vdpbf16ps), bias added in float32, one rounding to the storage dtype at the end (to nearest even).
 * Results differ from oneDNN's only by its other summation order.
 *
 * Built only with AVX-512 (bfloat16: AVX512_BF16): kvpilot_linear_available() says whether this
 * build has the kernels, and the Python side keeps oneDNN where it does not.
 */
#include <stdint.h>
#include <string.h>

#define LIN_MR 8     /* rows per tile */
#define LIN_NR 3     /* 16-column panels per tile */
#ifndef LIN_MC
#define LIN_MC 64 /* rows per work item */
#endif
#define LIN_PANEL 16

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_F32 1
#else
#define HAVE_F32 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16 1
#else
#define HAVE_BF16 0
#endif

/* Bit 0: the float32 kernel is built; bit 1: the bfloat16 one. */
int kvpilot_linear_available(void) { return HAVE_F32 | (HAVE_BF16 << 1); }

#if HAVE_F32
static inline __attribute__((always_inline)) void store_row_f32(float *y, const float *bias,
                                                                 __m512 acc, int64_t n0) {
    if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + n0));
    _mm512_storeu_ps(y + n0, acc);
}

/* One tile: `rows` x `panels` (compile-time constants at every call, so unused accumulators
 * vanish). wp points at the tile's first panel; panels are K*16 floats apart. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t x_stride,
                                                           const float *wp, const float *bias,
                                                           float *y, int64_t y_stride, int64_t K,
                                                           int64_t n0, const int rows,
                                                           const int panels) {
    __m512 acc[LIN_MR][LIN_NR];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t panel_stride = K * LIN_PANEL;
    for (int64_t k = 0; k < K; k++) {
        __m512 w[LIN_NR];
        for (int c = 0; c < panels; c++) w[c] = _mm512_loadu_ps(wp + c * panel_stride + k * 16);
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
            for (int c = 0; c < panels; c++) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++)
            store_row_f32(y + r * y_stride, bias, acc[r][c], n0 + c * LIN_PANEL);
}

#define TILE_F32_ROWS(P)                                                                     \
    switch (rows) {                                                                          \
    case 1: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 1, P); break;                \
    case 2: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 2, P); break;                \
    case 3: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 3, P); break;                \
    case 4: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 4, P); break;                \
    case 5: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 5, P); break;                \
    case 6: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 6, P); break;                \
    case 7: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 7, P); break;                \
    default: tile_f32(x, x_stride, wp, bias, y, y_stride, K, n0, 8, P); break;               \
    }

static void dispatch_f32(const float *x, int64_t x_stride, const float *wp, const float *bias,
                         float *y, int64_t y_stride, int64_t K, int64_t n0, int rows, int panels) {
    if (panels == 3) {
        TILE_F32_ROWS(3)
    } else if (panels == 2) {
        TILE_F32_ROWS(2)
    } else {
        TILE_F32_ROWS(1)
    }
}
#endif

#if HAVE_BF16
static inline __attribute__((always_inline)) void store_row_bf16(uint16_t *y, const uint16_t *bias,
                                                                  __m512 acc, int64_t n0) {
    if (bias) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(bias + n0));
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    _mm256_storeu_si256((__m256i *)(y + n0), (__m256i)_mm512_cvtneps_pbh(acc));
}

static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, int64_t x_stride,
                                                            const uint16_t *wp,
                                                            const uint16_t *bias, uint16_t *y,
                                                            int64_t y_stride, int64_t K, int64_t n0,
                                                            const int rows, const int panels) {
    __m512 acc[LIN_MR][LIN_NR];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t panel_stride = K * LIN_PANEL;
    for (int64_t k = 0; k < K; k += 2) {
        __m512bh w[LIN_NR];
        for (int c = 0; c < panels; c++)
            w[c] = (__m512bh)_mm512_loadu_si512(wp + c * panel_stride + k * 16);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + k, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < panels; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++)
            store_row_bf16(y + r * y_stride, bias, acc[r][c], n0 + c * LIN_PANEL);
}

#define TILE_BF16_ROWS(P)                                                                    \
    switch (rows) {                                                                          \
    case 1: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 1, P); break;               \
    case 2: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 2, P); break;               \
    case 3: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 3, P); break;               \
    case 4: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 4, P); break;               \
    case 5: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 5, P); break;               \
    case 6: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 6, P); break;               \
    case 7: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 7, P); break;               \
    default: tile_bf16(x, x_stride, wp, bias, y, y_stride, K, n0, 8, P); break;              \
    }

static void dispatch_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp,
                          const uint16_t *bias, uint16_t *y, int64_t y_stride, int64_t K,
                          int64_t n0, int rows, int panels) {
    if (panels == 3) {
        TILE_BF16_ROWS(3)
    } else if (panels == 2) {
        TILE_BF16_ROWS(2)
    } else {
        TILE_BF16_ROWS(1)
    }
}
#endif

/* x [M][K] (row stride x_stride), packed as above, bias [N] or NULL, y [M][N] (row stride
 * y_stride). Returns 0, or 1 when this build has no kernel for the dtype (nothing written). */
#define DEFINE_LINEAR(SUFFIX, T, DISPATCH)                                                     \
    int linear_##SUFFIX(const T *x, const T *packed, const T *bias, T *y, int64_t M, int64_t N,   \
                        int64_t K, int64_t x_stride, int64_t y_stride) {                          \
        const int64_t panels_total = N / LIN_PANEL;                                              \
        const int64_t groups = (panels_total + LIN_NR - 1) / LIN_NR;                             \
        const int64_t chunks = (M + LIN_MC - 1) / LIN_MC;                                        \
        _Pragma("omp parallel for collapse(2) schedule(static)")                                 \
        for (int64_t chunk = 0; chunk < chunks; chunk++)                                         \
            for (int64_t g = 0; g < groups; g++) {                                               \
                const int64_t p0 = g * LIN_NR;                                                   \
                const int panels = (int)(panels_total - p0 < LIN_NR ? panels_total - p0 : LIN_NR); \
                const int64_t m_end = (chunk + 1) * LIN_MC < M ? (chunk + 1) * LIN_MC : M;       \
                for (int64_t m0 = chunk * LIN_MC; m0 < m_end; m0 += LIN_MR) {                     \
                    const int rows = (int)(m_end - m0 < LIN_MR ? m_end - m0 : LIN_MR);           \
                    DISPATCH(x + m0 * x_stride, x_stride, packed + p0 * K * LIN_PANEL, bias,     \
                             y + m0 * y_stride, y_stride, K, p0 * LIN_PANEL, rows, panels);      \
                }                                                                                \
            }                                                                                    \
        return 0;                                                                                \
    }

#if HAVE_F32
DEFINE_LINEAR(f32, float, dispatch_f32)
#else
int linear_f32(const float *x, const float *packed, const float *bias, float *y, int64_t M,
               int64_t N, int64_t K, int64_t x_stride, int64_t y_stride) {
    return 1;
}
#endif
#if HAVE_BF16
DEFINE_LINEAR(bf16, uint16_t, dispatch_bf16)
#else
int linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int64_t M, int64_t N, int64_t K, int64_t x_stride, int64_t y_stride) {
    return 1;
}
#endif
