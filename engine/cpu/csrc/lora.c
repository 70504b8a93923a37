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
 * Numerics: float32 products and sums (bfloat16 operands widened exactly), each dot product in
 * 8 lanes then summed across them, h kept in float32, and one rounding per output element: out
 * is read, the float32 delta added and the sum rounded to out's dtype (to nearest even).
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
 * 2 x rows sums over k in registers; each 8 rows' sums are reduced together into h. */
#define DEFINE_SHRINK(S, T)                                                                    \
    static inline __attribute__((always_inline)) void shrink_rows_##S(                         \
        const T *const *xr, const T *a, int64_t K, int64_t j0, int64_t j1, float *const *hr,    \
        const int rows) {                                                                      \
        for (int64_t j8 = j0; j8 < j1; j8 += 8) {                                              \
            __m256 sums[LORA_MT][8];                                                           \
            for (int jj = 0; jj < 8; jj += 2) {                                                \
                const T *a0 = a + (j8 + jj) * K, *a1 = a0 + K;                                 \
                __m256 acc0[LORA_MT], acc1[LORA_MT];                                           \
                for (int c = 0; c < rows; c++) acc0[c] = acc1[c] = _mm256_setzero_ps();        \
                for (int64_t k = 0; k < K; k += 8) {                                           \
                    const __m256 w0 = load8_##S(a0 + k), w1 = load8_##S(a1 + k);               \
                    for (int c = 0; c < rows; c++) {                                           \
                        const __m256 xv = load8_##S(xr[c] + k);                                \
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
    static void shrink_##S(const T *const *xr, const T *a, int64_t K, int64_t j0, int64_t j1,  \
                           float *const *hr, int rows) {                                       \
        switch (rows) {                                                                        \
        case 1: shrink_rows_##S(xr, a, K, j0, j1, hr, 1); break;                               \
        case 2: shrink_rows_##S(xr, a, K, j0, j1, hr, 2); break;                               \
        case 3: shrink_rows_##S(xr, a, K, j0, j1, hr, 3); break;                               \
        default: shrink_rows_##S(xr, a, K, j0, j1, hr, 4); break;                              \
        }                                                                                      \
    }

/* Expand of one tile into output columns [n0, n1) of one sub (whose rank-R slice of h starts at
 * h_off): per group of 8 columns, their 8 rows of B (8 x R, contiguous) widened to float32 once
 * into `wb`, then per token 8 dot products over R, summed across lanes into one vector, added to
 * out and rounded once. */
#define DEFINE_EXPAND(S, T)                                                                    \
    static void expand_##S(T *const *outr, const float *const *hr, int rows, const T *b,       \
                           int64_t R, int64_t n0, int64_t n1, int64_t h_off, float *wb) {      \
        for (int64_t n = n0; n < n1; n += 8) {                                                 \
            const T *bn = b + n * R;                                                           \
            for (int64_t i = 0; i < 8 * R; i += 8) _mm256_storeu_ps(wb + i, load8_##S(bn + i)); \
            for (int c = 0; c < rows; c++) {                                                   \
                const float *h = hr[c] + h_off;                                                \
                __m256 acc[8];                                                                 \
                for (int q = 0; q < 8; q++) acc[q] = _mm256_setzero_ps();                      \
                for (int64_t r = 0; r < R; r += 8) {                                           \
                    const __m256 hv = _mm256_loadu_ps(h + r);                                  \
                    for (int q = 0; q < 8; q++)                                                \
                        acc[q] = _mm256_fmadd_ps(_mm256_loadu_ps(wb + q * R + r), hv, acc[q]); \
                }                                                                              \
                T *o = outr[c] + n;                                                            \
                store8_##S(o, _mm256_add_ps(load8_##S(o), sum8x8(acc)));                       \
            }                                                                                  \
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
