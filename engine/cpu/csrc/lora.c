/* The batched LoRA delta of one projection (Punica's shrink/expand, S-LoRA's segments), added to
 * the projection's output in place; the definition is kvpilot.engine.lora.ops:
 *
 *   out[t, bounds[i]:bounds[i+1]] += B[s, bounds[i]:bounds[i+1]] (A[s, i] x[t])   s = slots[t] >= 0
 *
 * Layout: A [num_slots][num_sub][rank][K], B [num_slots][N][rank], both contiguous; x [T][K] and
 * out [T][N] with row strides x_stride and out_stride; slots [T] int64 (-1: base model, no delta);
 * bounds [num_sub + 1] int64, bounds[0] = 0, bounds[num_sub] = N.
 *
 * The tokens are grouped by slot (a counting sort) and cut into tiles of up to LORA_MT tokens of
 * one slot, so each row of A and B is read once per tile, not once per token (a decode step's
 * tokens of one adapter are mostly one tile). Two passes, each split into work items between the
 * OpenMP threads:
 *   shrink: (tile, block of LORA_JB rows of A[s]) -> h[token][num_sub * rank] in float32;
 *   expand: (tile, block of LORA_NB output columns) -> out += B h, per group of 8 outputs.
 * Items are numbered tile-major, so with few tokens the threads split a tile's rows and columns
 * between them (decode batches), and with many each thread walks whole tiles of one slot, whose
 * A and B stay in its L2 from tile to tile (prefill).
 *
 * Numerics: float32 products and sums (bfloat16 operands widened exactly): the shrink's dot
 * products over k in 8 lanes then summed across them, the expand's over the rank in two chains
 * (even and odd r); h kept in float32, and one rounding per output element: out is read, the
 * float32 delta added and the sum rounded to out's dtype (to nearest even). The order of every
 * sum is fixed, whatever the number of threads.
 *
 * The vector path needs AVX2 and FMA (8 float32 lanes: every x86 CPU of the last decade; AVX-512
 * machines run it too) and K, rank and every bound multiples of 8 (the caller checks); without
 * AVX2 the plain loops below compute the same definition.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LORA_MT 4  /* tokens per tile: the shrink holds 2 rows x 4 tokens of sums in registers */
#define LORA_JB 16 /* rows of A (num_sub * rank of them) per shrink item */
#define LORA_NB 64 /* output columns per expand item */
#define LORA_MAX_RANK 256
/* Below this many multiply-adds the call runs on the calling thread: waking the team costs more
 * than it saves (a decode step's single token). */
#define LORA_PARALLEL_MACS (1 << 16)

typedef struct {
    int64_t slot, first, count; /* count tokens of `slot`, at order[first...] */
} lora_tile;

/* Groups the active tokens by slot, in token order within a slot, and cuts them into tiles.
 * Returns the number of active tokens, or -1 for a slot >= num_slots (nothing written). */
static int64_t group_tokens(const int64_t *slots, int64_t tokens, int64_t num_slots,
                            int64_t *counts, int64_t *order, lora_tile *tiles,
                            int64_t *num_tiles) {
    memset(counts, 0, (size_t)(num_slots + 1) * sizeof *counts);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s >= num_slots) return -1;
        if (s >= 0) counts[s + 1]++;
    }
    for (int64_t s = 0; s < num_slots; s++) counts[s + 1] += counts[s]; /* starts */
    const int64_t active = counts[num_slots];
    int64_t n = 0;
    for (int64_t s = 0; s < num_slots; s++)
        for (int64_t first = counts[s]; first < counts[s + 1]; first += LORA_MT) {
            const int64_t left = counts[s + 1] - first;
            tiles[n++] = (lora_tile){s, first, left < LORA_MT ? left : LORA_MT};
        }
    *num_tiles = n;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= 0) order[counts[slots[t]]++] = t;
    return active;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline void store8_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
/* Rounded to nearest even, NaN kept quiet: f32_to_bf16 of cpu_ops.c on 8 lanes. */
static inline void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, nan);
    /* packus works within 128-bit lanes: the 8 results are 64-bit elements 0 and 2 */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

/* The 8 horizontal sums of a[0..7], in one vector (lane i: the sum of a[i]'s lanes). */
static inline __m256 sum8x8(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    /* lanes: a0..a3's low-half sums | a0..a3's high-half sums, and the same for a4..a7 */
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* Shrink of one tile against rows [j0, j1) of its slot's A (j over num_sub * rank), `rows`
 * tokens (a compile-time constant at each call, so the unused sums vanish): for each row pair,
 * 2 x rows sums over k in registers; each 8 rows' sums are reduced together into h. A's rows of
 * type TA, x's of type TX (NAME: the pair). */
#define DEFINE_SHRINK_ROWS(NAME, TA, LOADA, TX, LOADX)                                         \
    static inline __attribute__((always_inline)) void shrink_rows_##NAME(                      \
        const TX *const *xr, const TA *a, int64_t K, int64_t j0, int64_t j1, float *const *hr,  \
        const int rows) {                                                                      \
        for (int64_t j8 = j0; j8 < j1; j8 += 8) {                                              \
            __m256 sums[LORA_MT][8];                                                           \
            for (int jj = 0; jj < 8; jj += 2) {                                                \
                const TA *a0 = a + (j8 + jj) * K, *a1 = a0 + K;                                \
                __m256 acc0[LORA_MT], acc1[LORA_MT];                                           \
                for (int c = 0; c < rows; c++) acc0[c] = acc1[c] = _mm256_setzero_ps();        \
                for (int64_t k = 0; k < K; k += 8) {                                           \
                    const __m256 w0 = LOADA(a0 + k), w1 = LOADA(a1 + k);                       \
                    for (int c = 0; c < rows; c++) {                                           \
                        const __m256 xv = LOADX(xr[c] + k);                                    \
                        acc0[c] = _mm256_fmadd_ps(w0, xv, acc0[c]);                            \
                        acc1[c] = _mm256_fmadd_ps(w1, xv, acc1[c]);                            \
                    }                                                                          \
                }                                                                              \
                for (int c = 0; c < rows; c++) {                                               \
                    sums[c][jj] = acc0[c];                                                     \
                    sums[c][jj + 1] = acc1[c];                                                 \
                }                                                                              \
            }                                                                                  \
            for (int c = 0; c < rows; c++) _mm256_storeu_ps(hr[c] + j8, sum8x8(sums[c]));      \
        }                                                                                      \
    }                                                                                          \
    static void shrink_any_##NAME(const TX *const *xr, const TA *a, int64_t K, int64_t j0,     \
                                  int64_t j1, float *const *hr, int rows) {                    \
        switch (rows) {                                                                        \
        case 1: shrink_rows_##NAME(xr, a, K, j0, j1, hr, 1); break;                            \
        case 2: shrink_rows_##NAME(xr, a, K, j0, j1, hr, 2); break;                            \
        case 3: shrink_rows_##NAME(xr, a, K, j0, j1, hr, 3); break;                            \
        default: shrink_rows_##NAME(xr, a, K, j0, j1, hr, 4); break;                           \
        }                                                                                      \
    }

DEFINE_SHRINK_ROWS(f32, float, load8_f32, float, load8_f32)
DEFINE_SHRINK_ROWS(bf16, uint16_t, load8_bf16, uint16_t, load8_bf16)
DEFINE_SHRINK_ROWS(bf16_f32, uint16_t, load8_bf16, float, load8_f32)

/* In bfloat16, x's rows (each read once per pair of A's rows) are widened once per work item
 * into a float32 copy on the stack when they fit: up to LORA_WIDE_K features. */
#define LORA_WIDE_K 4096
#define DEFINE_SHRINK(S, T) /* shrink_##S: shrink_any_##S, bfloat16 through the widened copy */
static void shrink_f32(const float *const *xr, const float *a, int64_t K, int64_t j0, int64_t j1,
                       float *const *hr, int rows) {
    shrink_any_f32(xr, a, K, j0, j1, hr, rows);
}
static void shrink_bf16(const uint16_t *const *xr, const uint16_t *a, int64_t K, int64_t j0,
                        int64_t j1, float *const *hr, int rows) {
    if (K > LORA_WIDE_K) {
        shrink_any_bf16(xr, a, K, j0, j1, hr, rows);
        return;
    }
    float wide[LORA_MT][LORA_WIDE_K];
    const float *wr[LORA_MT];
    for (int c = 0; c < rows; c++) {
        for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(wide[c] + k, load8_bf16(xr[c] + k));
        wr[c] = wide[c];
    }
    shrink_any_bf16_f32(wr, a, K, j0, j1, hr, rows);
}

/* m[0..7] (8 rows of 8) -> its transpose, in place. */
static inline void transpose8x8(__m256 m[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(m[0], m[1]), t1 = _mm256_unpackhi_ps(m[0], m[1]);
    const __m256 t2 = _mm256_unpacklo_ps(m[2], m[3]), t3 = _mm256_unpackhi_ps(m[2], m[3]);
    const __m256 t4 = _mm256_unpacklo_ps(m[4], m[5]), t5 = _mm256_unpackhi_ps(m[4], m[5]);
    const __m256 t6 = _mm256_unpacklo_ps(m[6], m[7]), t7 = _mm256_unpackhi_ps(m[6], m[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    m[0] = _mm256_permute2f128_ps(s0, s4, 0x20), m[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    m[1] = _mm256_permute2f128_ps(s1, s5, 0x20), m[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    m[2] = _mm256_permute2f128_ps(s2, s6, 0x20), m[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    m[3] = _mm256_permute2f128_ps(s3, s7, 0x20), m[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* Expand of one tile into output columns [n0, n1) of one sub (whose rank-R slice of h starts at
 * h_off), 8 columns at a time: their 8 rows of B (8 x R, contiguous) transposed once into `wb`
 * as R vectors of 8 columns, then per token out[8 columns] += sum_r h[r] wb[r], broadcast
 * multiply-adds with no sum across lanes (even and odd r in two chains), rounded once. The
 * tile's `rows` tokens (a compile-time constant at each call) share each load of wb. */
#define DEFINE_EXPAND(S, T)                                                                    \
    static inline __attribute__((always_inline)) void expand_rows_##S(                         \
        T *const *outr, const float *const *hr, const T *b, int64_t R, int64_t n0, int64_t n1, \
        int64_t h_off, float *wb, const int rows) {                                            \
        for (int64_t n = n0; n < n1; n += 8) {                                                 \
            const T *bn = b + n * R;                                                           \
            for (int64_t r0 = 0; r0 < R; r0 += 8) {                                            \
                __m256 m[8];                                                                   \
                for (int q = 0; q < 8; q++) m[q] = load8_##S(bn + q * R + r0);                 \
                transpose8x8(m);                                                               \
                for (int j = 0; j < 8; j++) _mm256_storeu_ps(wb + (r0 + j) * 8, m[j]);         \
            }                                                                                  \
            __m256 acc[LORA_MT][2];                                                            \
            for (int c = 0; c < rows; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();        \
            for (int64_t r = 0; r < R; r += 2) {                                               \
                const __m256 w0 = _mm256_loadu_ps(wb + r * 8);                                 \
                const __m256 w1 = _mm256_loadu_ps(wb + r * 8 + 8);                             \
                for (int c = 0; c < rows; c++) {                                               \
                    const float *h = hr[c] + h_off + r;                                        \
                    acc[c][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(h), w0, acc[c][0]);        \
                    acc[c][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(h + 1), w1, acc[c][1]);    \
                }                                                                              \
            }                                                                                  \
            for (int c = 0; c < rows; c++) {                                                   \
                T *o = outr[c] + n;                                                            \
                store8_##S(o, _mm256_add_ps(load8_##S(o), _mm256_add_ps(acc[c][0], acc[c][1]))); \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void expand_##S(T *const *outr, const float *const *hr, int rows, const T *b,       \
                           int64_t R, int64_t n0, int64_t n1, int64_t h_off, float *wb) {      \
        switch (rows) {                                                                        \
        case 1: expand_rows_##S(outr, hr, b, R, n0, n1, h_off, wb, 1); break;                  \
        case 2: expand_rows_##S(outr, hr, b, R, n0, n1, h_off, wb, 2); break;                  \
        case 3: expand_rows_##S(outr, hr, b, R, n0, n1, h_off, wb, 3); break;                  \
        default: expand_rows_##S(outr, hr, b, R, n0, n1, h_off, wb, 4); break;                 \
        }                                                                                      \
    }
#define LORA_VECTOR 1
#else
#define LORA_VECTOR 0
#endif

static inline float widen_f32(float x) { return x; }
static inline float widen_bf16(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float narrow_f32(float x) { return x; }
static inline uint16_t narrow_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

#if !LORA_VECTOR
/* The same two passes as plain loops (any K, rank and bounds), for CPUs without AVX2. */
#define DEFINE_SHRINK(S, T)                                                                    \
    static void shrink_##S(const T *const *xr, const T *a, int64_t K, int64_t j0, int64_t j1,  \
                           float *const *hr, int rows) {                                       \
        for (int c = 0; c < rows; c++)                                                         \
            for (int64_t j = j0; j < j1; j++) {                                                \
                float s = 0.0f;                                                                \
                for (int64_t k = 0; k < K; k++) s += widen_##S(a[j * K + k]) * widen_##S(xr[c][k]); \
                hr[c][j] = s;                                                                  \
            }                                                                                  \
    }
#define DEFINE_EXPAND(S, T)                                                                    \
    static void expand_##S(T *const *outr, const float *const *hr, int rows, const T *b,       \
                           int64_t R, int64_t n0, int64_t n1, int64_t h_off, float *wb) {      \
        (void)wb;                                                                              \
        for (int c = 0; c < rows; c++)                                                         \
            for (int64_t n = n0; n < n1; n++) {                                                \
                float s = 0.0f;                                                                \
                for (int64_t r = 0; r < R; r++) s += widen_##S(b[n * R + r]) * hr[c][h_off + r]; \
                outr[c][n] = narrow_##S(widen_##S(outr[c][n]) + s);                            \
            }                                                                                  \
    }
#endif

/* out, x, lora_a, lora_b, slots, bounds as above. Returns 0; 1 for a slot >= num_slots or a rank
 * above LORA_MAX_RANK (nothing written); 2 when its scratch memory could not be allocated. */
#define DEFINE_LORA(S, T)                                                                      \
    DEFINE_SHRINK(S, T)                                                                        \
    DEFINE_EXPAND(S, T)                                                                        \
    int lora_add_##S(T *out, const T *x, const T *lora_a, const T *lora_b, const int64_t *slots, \
                     const int64_t *bounds, int64_t tokens, int64_t num_slots, int64_t num_sub, \
                     int64_t rank, int64_t K, int64_t N, int64_t x_stride, int64_t out_stride) { \
        if (rank > LORA_MAX_RANK) return 1;                                                    \
        const int64_t hw = num_sub * rank; /* h's width, A[s]'s rows */                        \
        int64_t *counts = malloc((size_t)(num_slots + 1 + tokens) * sizeof *counts);            \
        lora_tile *tiles = malloc((size_t)(tokens > 0 ? tokens : 1) * sizeof *tiles);          \
        float *h = malloc((size_t)(tokens > 0 ? tokens : 1) * (size_t)hw * sizeof *h);          \
        if (!counts || !tiles || !h) {                                                         \
            free(counts), free(tiles), free(h);                                                \
            return 2;                                                                          \
        }                                                                                      \
        int64_t *order = counts + num_slots + 1, num_tiles = 0;                                \
        const int64_t active =                                                                 \
            group_tokens(slots, tokens, num_slots, counts, order, tiles, &num_tiles);          \
        if (active <= 0) {                                                                     \
            free(counts), free(tiles), free(h);                                                \
            return active < 0;                                                                 \
        }                                                                                      \
        const int64_t jblocks = (hw + LORA_JB - 1) / LORA_JB;                                  \
        const int64_t nblocks = (N + LORA_NB - 1) / LORA_NB;                                   \
        const int parallel = active * (hw * K + N * rank) >= LORA_PARALLEL_MACS;                \
        _Pragma("omp parallel if (parallel)")                                                  \
        {                                                                                      \
            float wb[8 * LORA_MAX_RANK];                                                       \
            _Pragma("omp for schedule(static)")                                                \
            for (int64_t item = 0; item < num_tiles * jblocks; item++) {                       \
                const lora_tile tile = tiles[item / jblocks];                                  \
                const int64_t j0 = item % jblocks * LORA_JB;                                   \
                const int64_t j1 = j0 + LORA_JB < hw ? j0 + LORA_JB : hw;                      \
                const T *xr[LORA_MT];                                                          \
                float *hr[LORA_MT];                                                            \
                for (int c = 0; c < tile.count; c++) {                                         \
                    xr[c] = x + order[tile.first + c] * x_stride;                              \
                    hr[c] = h + (tile.first + c) * hw;                                         \
                }                                                                              \
                shrink_##S(xr, lora_a + tile.slot * hw * K, K, j0, j1, hr, (int)tile.count);   \
            }                                                                                  \
            _Pragma("omp for schedule(static)")                                                \
            for (int64_t item = 0; item < num_tiles * nblocks; item++) {                       \
                const lora_tile tile = tiles[item / nblocks];                                  \
                const int64_t n0 = item % nblocks * LORA_NB;                                   \
                const int64_t n1 = n0 + LORA_NB < N ? n0 + LORA_NB : N;                        \
                T *outr[LORA_MT];                                                              \
                const float *hr[LORA_MT];                                                      \
                for (int c = 0; c < tile.count; c++) {                                         \
                    outr[c] = out + order[tile.first + c] * out_stride;                        \
                    hr[c] = h + (tile.first + c) * hw;                                         \
                }                                                                              \
                const T *b = lora_b + tile.slot * N * rank;                                    \
                for (int64_t i = 0; i < num_sub; i++) {                                        \
                    const int64_t lo = bounds[i] > n0 ? bounds[i] : n0;                        \
                    const int64_t hi = bounds[i + 1] < n1 ? bounds[i + 1] : n1;                \
                    if (lo < hi)                                                               \
                        expand_##S(outr, hr, (int)tile.count, b, rank, lo, hi, i * rank, wb);  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        free(counts), free(tiles), free(h);                                                    \
        return 0;                                                                              \
    }

DEFINE_LORA(f32, float)
DEFINE_LORA(bf16, uint16_t)
