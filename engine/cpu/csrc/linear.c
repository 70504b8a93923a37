/* kvpilot's CPU linear layer: y[M][N] = x[M][K] W^T (+ bias), with W packed once at load time.
 *
 * Why our own: a decode step multiplies a few rows (M = running sequences) by every weight once.
 * There oneDNN's packed kernels took 1.1-1.6x this kernel's time on SmolLM2's linears (1-64 rows;
 * level at prefill's hundreds to thousands: bench/RESULTS.md).
 *
 * Packed layout (N a multiple of 16: the Python side keeps oneDNN for other widths): the output
 * columns in groups of 3 panels of 16 (the last group 1-3 panels), one after the other; a group of
 * p panels is
 *   float32:  [K][p * 16]         one row of its columns per k;
 *   bfloat16: [K/2][p * 16][2]    the same with k in pairs (K even), the operand layout of
 *                                 vdpbf16ps: each 32-bit lane holds W[n][k], W[n][k+1].
 * So a tile of up to 8 rows x 3 panels (24 zmm accumulators) reads its weights as one sequential
 * stream. Work items are (chunk of 64 rows, group), split between the OpenMP threads as
 * schedule(static) would split them: with few rows each thread streams a contiguous run of groups,
 * with many rows a chunk of x stays in cache across groups; a chunk's second and later tiles read
 * their group from L2. A thread that runs out of its own items takes the others' from the far end
 * of their runs: a thread the kernel preempts (the API process's and the clients' work shares these
 * cores while serving) no longer holds the whole call up, and on a quiet machine each thread still
 * streams its own run front to back. Measured against libgomp's schedules (bench/RESULTS.md,
 * "Where serving loses against offline"): schedule(dynamic, 1) streams 4-8 % slower at 1-8 rows,
 * schedule(guided) lost 5 % in the engine at batch 64.
 *
 * Tried and measured slower on the development VM (Zen 4), so left out:
 * - a software prefetch 1 KiB ahead in the weight stream: 3-7 % faster at 8 rows, 10 % slower at
 *   1 row, 3 % slower at 2048;
 * - a chunk's tiles over blocks of 64 k, partial sums parked in L1, so that each block of weights
 *   comes from memory once: 10-25 % slower at 16-64 rows;
 * - for 9-16 rows, tiles of 16 rows x 1 panel (the group read once): 2x slower, bound by 16
 *   broadcasts per 16 FMAs where the 8 x 3 tile has 8 per 24;
 * - the MLP's gate_up projection fused with SiLU-and-multiply (8 rows x a gate panel and its up
 *   panel per tile, only silu(gate) * up stored; bit for bit the unfused results): in a 2048-token
 *   prefill step 2 % faster than projection + silu_and_mul in float32, 1 % slower in bfloat16,
 *   the whole step level or 2 % slower;
 * - work items in group-major order (each group's weights kept in L2 across row chunks): 10 %
 *   faster at 128 rows, 2 % slower at 512-2048; 128 or 256 rows per item: level.
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
#ifdef _OPENMP
#include <omp.h>
#endif

#define LIN_MR 8  /* rows per tile */
#define LIN_NR 3  /* 16-column panels per tile */
#define LIN_MC 64 /* rows per work item */
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

/* What differs between the dtypes: k per step (KSTEP), a weight vector of panel c in the row of
 * step k (wload), x's value(s) at k broadcast (xload), the multiply-add, and the rounded store of
 * 16 outputs with the bias. */
#if HAVE_F32
#define KSTEP_f32 1
static inline __m512i wload_f32(const float *row, int c) {
    return _mm512_loadu_si512(row + c * LIN_PANEL);
}
static inline __m512i xload_f32(const float *x) {
    return _mm512_castps_si512(_mm512_set1_ps(*x));
}
static inline __m512 madd_f32(__m512 acc, __m512i xv, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(xv), _mm512_castsi512_ps(w), acc);
}
static inline void store16_f32(float *y, const float *bias, __m512 acc, const int stream) {
    if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias));
    if (stream)
        _mm512_stream_ps(y, acc);
    else
        _mm512_storeu_ps(y, acc);
}
#endif

#if HAVE_BF16
#define KSTEP_bf16 2
static inline __m512i wload_bf16(const uint16_t *row, int c) {
    return _mm512_loadu_si512(row + c * 2 * LIN_PANEL);
}
static inline __m512i xload_bf16(const uint16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
}
static inline __m512 madd_bf16(__m512 acc, __m512i xv, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)w);
}
static inline void store16_bf16(uint16_t *y, const uint16_t *bias, __m512 acc, const int stream) {
    if (bias) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)bias);
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    if (stream)
        _mm256_stream_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(acc));
    else
        _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(acc));
}
#endif

/* One tile, `rows` x `panels` (compile-time constants at every call, so unused accumulators
 * vanish). wp: the tile's group. */
#define DEFINE_TILE(S, T)                                                                      \
    static inline __attribute__((always_inline)) void tile_##S(                                \
        const T *x, int64_t x_stride, const T *wp, const T *bias, T *y, int64_t y_stride,      \
        int64_t K, const int rows, const int panels, const int stream) {                       \
        __m512 acc[LIN_MR][LIN_NR];                                                            \
        for (int r = 0; r < rows; r++)                                                         \
            for (int c = 0; c < panels; c++) acc[r][c] = _mm512_setzero_ps();                  \
        for (int64_t k = 0; k < K; k += KSTEP_##S) {                                           \
            const T *row = wp + k * panels * LIN_PANEL;                                        \
            __m512i w[LIN_NR];                                                                 \
            for (int c = 0; c < panels; c++) w[c] = wload_##S(row, c);                         \
            for (int r = 0; r < rows; r++) {                                                   \
                const __m512i xv = xload_##S(x + r * x_stride + k);                            \
                for (int c = 0; c < panels; c++) acc[r][c] = madd_##S(acc[r][c], xv, w[c]);    \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < rows; r++)                                                         \
            for (int c = 0; c < panels; c++)                                                   \
                store16_##S(y + r * y_stride + c * LIN_PANEL, bias ? bias + c * LIN_PANEL : NULL, \
                            acc[r][c], stream);                                                \
    }

#define TILE_CASE(S, R, P, STREAM)                                                             \
    case R:                                                                                    \
        tile_##S(x, x_stride, wp, bias, y, y_stride, K, R, P, STREAM);                         \
        break;
#define TILE_ROWS(S, P, STREAM)                                                                \
    switch (rows) {                                                                            \
        TILE_CASE(S, 1, P, STREAM)                                                             \
        TILE_CASE(S, 2, P, STREAM)                                                             \
        TILE_CASE(S, 3, P, STREAM)                                                             \
        TILE_CASE(S, 4, P, STREAM)                                                             \
        TILE_CASE(S, 5, P, STREAM)                                                             \
        TILE_CASE(S, 6, P, STREAM)                                                             \
        TILE_CASE(S, 7, P, STREAM)                                                             \
        TILE_CASE(S, 8, P, STREAM)                                                             \
    }
#define TILE_PANELS(S, STREAM)                                                                 \
    if (panels == 3) {                                                                         \
        TILE_ROWS(S, 3, STREAM)                                                                \
    } else if (panels == 2) {                                                                  \
        TILE_ROWS(S, 2, STREAM)                                                                \
    } else {                                                                                   \
        TILE_ROWS(S, 1, STREAM)                                                                \
    }

/* One work item: `rows_total` (at most LIN_MC) rows of x and y against the group at wp. */
#define DEFINE_WORK(S, T)                                                                      \
    DEFINE_TILE(S, T)                                                                          \
    static void tile_any_##S(const T *x, int64_t x_stride, const T *wp, const T *bias, T *y,   \
                             int64_t y_stride, int64_t K, int rows, int panels, int stream) {  \
        if (stream) {                                                                          \
            TILE_PANELS(S, 1)                                                                  \
        } else {                                                                               \
            TILE_PANELS(S, 0)                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void work_##S(const T *x, int64_t x_stride, const T *wp, const T *bias, T *y,       \
                         int64_t y_stride, int64_t rows_total, int64_t K, int panels,          \
                         int stream) {                                                         \
        for (int64_t m0 = 0; m0 < rows_total; m0 += LIN_MR) {                                  \
            const int rows = (int)(rows_total - m0 < LIN_MR ? rows_total - m0 : LIN_MR);       \
            tile_any_##S(x + m0 * x_stride, x_stride, wp, bias, y + m0 * y_stride, y_stride, K, \
                         rows, panels, stream);                                                \
        }                                                                                      \
        /* Streaming stores are weakly ordered: fenced before the next op may read y. */      \
        if (stream) _mm_sfence();                                                              \
    }

/* Items [lo, hi) still unclaimed in one thread's run, lo in the low 32 bits: the owner claims lo
 * and thieves claim hi - 1 with one compare-and-swap on both, so no item is taken twice. A cache
 * line each, so that the owner's claims stay in its own cache until someone steals. */
typedef struct {
    _Alignas(64) uint64_t run;
} item_run;

static inline uint64_t pack_run(uint64_t lo, uint64_t hi) { return hi << 32 | lo; }

/* The next item of `run` from the front (own = 1) or the back (own = 0), or -1 when it is empty. */
static inline int64_t claim_item(item_run *run, int own) {
    uint64_t cur = __atomic_load_n(&run->run, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t lo = cur & 0xffffffffu, hi = cur >> 32;
        if (lo >= hi) return -1;
        const uint64_t next = own ? pack_run(lo + 1, hi) : pack_run(lo, hi - 1);
        if (__atomic_compare_exchange_n(&run->run, &cur, next, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return own ? (int64_t)lo : (int64_t)(hi - 1);
    }
}

/* x [M][K] (row stride x_stride), packed as above, bias [N] or NULL, y [M][N] (row stride
 * y_stride). Returns 0, or 1 when this build has no kernel for the dtype (nothing written).
 * Items (fewer than 2^32: M and N are tensor sizes) are numbered chunk-major. Every run is
 * filled before the parallel region and every thread drains every run, so all items are computed
 * whatever team size OpenMP gives. */
#if defined(KVPILOT_LINEAR_STATIC)
/* A static split, for A/B runs against the stealing one: schedule(static), no stealing. */
#define FOR_EACH_ITEM(items, ...)                                                              \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t item = 0; item < (items); item++) __VA_ARGS__
#elif defined(_OPENMP)
#define FOR_EACH_ITEM(items, ...)                                                              \
    {                                                                                          \
        const int runs = omp_get_max_threads();                                                \
        item_run run[runs];                                                                    \
        for (int t = 0; t < runs; t++)                                                         \
            run[t].run = pack_run((uint64_t)((items) * t / runs),                              \
                                  (uint64_t)((items) * (t + 1) / runs));                       \
        _Pragma("omp parallel")                                                                \
        {                                                                                      \
            const int self = omp_get_thread_num() % runs;                                      \
            for (int v = 0; v < runs; v++) {                                                   \
                item_run *from = &run[(self + v) % runs];                                      \
                for (int64_t item; (item = claim_item(from, v == 0)) >= 0;) __VA_ARGS__        \
            }                                                                                  \
        }                                                                                      \
    }
#else
#define FOR_EACH_ITEM(items, ...)                                                              \
    for (int64_t item = 0; item < (items); item++) __VA_ARGS__
#endif

/* Whether to write y with streaming (non-temporal) stores. An ordinary store that misses reads its
 * line first; a prefill step's outputs (megabytes: 2048 rows x 3072 columns is 25 MB in float32)
 * are then read in only to be overwritten, and evicted before the next op gets to them. Streaming
 * them made a 2048-token prefill step 4-6 % faster in both dtypes (bench/RESULTS.md); a decode step's outputs stay under the threshold, except the lm_head's logits,
 * where sampling after either kind of store took the same time. Each 16-column store must be
 * aligned to its width (64 B float32, 32 B bfloat16); an output that is not keeps ordinary ones. */
#ifndef LIN_STREAM_BYTES /* -DLIN_STREAM_BYTES=... builds a variant for A/B runs */
#define LIN_STREAM_BYTES (4 << 20)
#endif
int64_t kvpilot_linear_stream_bytes(void) { return LIN_STREAM_BYTES; }

static inline int streams_output(const void *y, int64_t M, int64_t N, int64_t y_stride,
                                 int64_t elem) {
    const int64_t align = LIN_PANEL * elem;
    return M * N * elem >= LIN_STREAM_BYTES && (uintptr_t)y % align == 0 &&
           (y_stride * elem) % align == 0;
}

#define DEFINE_LINEAR(S, T)                                                                    \
    DEFINE_WORK(S, T)                                                                          \
    int linear_##S(const T *x, const T *packed, const T *bias, T *y, int64_t M, int64_t N,     \
                   int64_t K, int64_t x_stride, int64_t y_stride) {                            \
        const int64_t panels_total = N / LIN_PANEL;                                            \
        const int64_t groups = (panels_total + LIN_NR - 1) / LIN_NR;                           \
        const int64_t chunks = (M + LIN_MC - 1) / LIN_MC;                                      \
        const int stream = streams_output(y, M, N, y_stride, sizeof(T));                        \
        FOR_EACH_ITEM(chunks * groups, {                                                       \
            const int64_t chunk = item / groups, g = item % groups;                            \
            const int64_t p0 = g * LIN_NR, m0 = chunk * LIN_MC;                                \
            const int panels = (int)(panels_total - p0 < LIN_NR ? panels_total - p0 : LIN_NR); \
            const int64_t rows = M - m0 < LIN_MC ? M - m0 : LIN_MC;                            \
            work_##S(x + m0 * x_stride, x_stride, packed + p0 * K * LIN_PANEL,                 \
                     bias ? bias + p0 * LIN_PANEL : NULL, y + m0 * y_stride + p0 * LIN_PANEL,  \
                     y_stride, rows, K, panels, stream);                                       \
        })                                                                                     \
        return 0;                                                                              \
    }

#if HAVE_F32
DEFINE_LINEAR(f32, float)
#else
int linear_f32(const float *x, const float *packed, const float *bias, float *y, int64_t M,
               int64_t N, int64_t K, int64_t x_stride, int64_t y_stride) {
    return 1;
}
#endif
#if HAVE_BF16
DEFINE_LINEAR(bf16, uint16_t)
#else
int linear_bf16(const uint16_t *x, const uint16_t *packed, const uint16_t *bias, uint16_t *y,
                int64_t M, int64_t N, int64_t K, int64_t x_stride, int64_t y_stride) {
    return 1;
}
#endif
