/* kvpilot's CPU kernels, built at run time by kvpilot.engine.cpu.build with the host's C compiler
 * and called through ctypes:
 * - paged decode attention: one query token per sequence, read straight from the paged KV cache
 *   (no gather into a contiguous copy), with an online softmax over chunks of the context;
 * - varlen paged attention: every sequence of a step (prefill chunks and decodes) in one call,
 *   flash-attention style, each key and value read once per tile of query rows;
 * - three of the decoder's elementwise steps (rotary embedding, the KV-cache write, RMSNorm around
 *   torch's mean), in float32 math with the result rounded to the storage dtype at the points where
 *   the torch ops of kvpilot.engine.model.layers round.
 *
 * Built with -ffp-contract=off so that a*b - c*d rounds as torch rounds it; the attention kernel
 * asks for its fused multiply-adds explicitly.
 *
 * Plain C that the compiler vectorizes, with an AVX-512 path for the attention inner loops; OpenMP
 * when the compiler has it, sharing torch's OpenMP runtime (same soname, already loaded).
 *
 * Attention layout (element strides, so any cache layout with a contiguous head_dim works):
 *   query [num_seqs, num_heads, head_dim] contiguous; out the same.
 *   k/v cache: element (block, slot, kv_head, d) at block*sb + slot*ss + kv_head*sh + d.
 *   block_tables [num_seqs, table_stride] int32; seq_lens [num_seqs] int32 (>= 1).
 *   The cache is in the query's dtype, or FP8 (e4m3fn or e5m2 bytes) with per-kv-head float32
 *   scales: a cached value is float(byte) * scale[kv_head] (kvpilot.engine.attention.kv_quant).
 *   Attention folds the scales out of the inner loops: q . (k * ks) = (q * ks) . k, and
 *   sum_t w[t] (v[t] * vs) = vs * sum_t w[t] v[t]; k_scale/v_scale NULL means 1.
 * Limits checked by the caller: group <= 16, head_dim <= 256 and a multiple of 16,
 * block_size <= 256.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256
/* Scores are kept for up to MAX_CHUNK tokens at a time, so the softmax runs over long vectors and
 * the online rescaling happens once per chunk, not once per block. */
#define MAX_CHUNK 512
#define LANES 16

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even, as torch does */
    return (uint16_t)(u >> 16);
}

/* p(r) * 2^(n + bias - 127) for x clamped to [-87, hi], x = n ln2 + r, |r| <= ln(2)/2, p the
 * degree-6 Taylor polynomial of e^r: the body of exp_approx and exp_wide (constant arguments,
 * inlined, so each compiles to its own straight-line code). */
static inline float exp_scaled(float x, float hi, int32_t bias) {
    if (x < -87.0f) x = -87.0f;
    if (x > hi) x = hi;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + bias) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp(x) within ~2 ulp for x in [-87, 88] (clamped outside): 2^n * p(r), written so the compiler
 * vectorizes it (libm's expf is a scalar call per element, which would dominate these loops). */
static inline float exp_approx(float x) { return exp_scaled(x, 88.0f, 127); }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

/* Every FP8 byte's value, filled when the library loads: decoding is one table read (or one
 * gather of 16 with AVX-512), exact, NaN and infinity included. */
static float e4m3_table[256], e5m2_table[256];

/* The value of an FP8 byte with `exp_bits` exponent bits (bias 2^(exp_bits-1) - 1) and the rest
 * mantissa. e4m3fn has no infinities and one NaN pattern (all ones); e5m2 follows IEEE. */
static float fp8_value(uint32_t x, int exp_bits, int fn) {
    const int man_bits = 7 - exp_bits, bias = (1 << (exp_bits - 1)) - 1;
    const uint32_t e = (x >> man_bits) & ((1u << exp_bits) - 1), m = x & ((1u << man_bits) - 1);
    const float sign = x & 0x80u ? -1.0f : 1.0f;
    const uint32_t e_max = (1u << exp_bits) - 1;
    if (fn && e == e_max && m == (1u << man_bits) - 1) return NAN;
    if (!fn && e == e_max) return m ? NAN : sign * INFINITY;
    if (e == 0) return sign * ldexpf((float)m, 1 - bias - man_bits);
    return sign * ldexpf((float)(m | (1u << man_bits)), (int)e - bias - man_bits);
}

__attribute__((constructor)) static void fill_fp8_tables(void) {
    for (uint32_t x = 0; x < 256; x++) {
        e4m3_table[x] = fp8_value(x, 4, 1);
        e5m2_table[x] = fp8_value(x, 5, 0);
    }
}

#define E4M3_TO_F32(x) (e4m3_table[(x)])
#define E5M2_TO_F32(x) (e5m2_table[(x)])

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    _Pragma("omp simd reduction(+ : s)")
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* One cache block of n tokens for one (sequence, kv head): scores p[j][t] = q[j] . k[t], and
 * acc[j] += sum_t w[j][t] * v[t] once the weights are in p. The AVX-512 versions keep each key and
 * value row in registers across the query heads of the group; the portable ones are plain loops. */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16_f32(const float *x) { return _mm512_loadu_ps(x); }

static inline __m512 load16_bf16(const uint16_t *x) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m512 load16_e4m3(const uint8_t *x) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm512_i32gather_ps(idx, e4m3_table, 4);
}

static inline __m512 load16_e5m2(const uint8_t *x) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm512_i32gather_ps(idx, e5m2_table, 4);
}

/* Calls CALL with G_ and D_ bound to constants, then returns, when (group, head_dim) is one of the
 * common shapes (SmolLM2 3/64, Llama 3.2 4/64, Qwen2 7/64, Llama 3 8B and Mistral 4/128, Qwen2.5
 * 7B 7/128, Llama 2 1/128, ...); otherwise falls through to the generic call. */
#define SPECIALIZE_SHAPE(CALL, GROUP, HEAD_DIM)                                                   \
    if (group == GROUP && D == HEAD_DIM) {                                                        \
        const int64_t G_ = GROUP, D_ = HEAD_DIM;                                                  \
        CALL;                                                                                     \
        return;                                                                                   \
    }
#define SPECIALIZE(CALL)                                                                          \
    SPECIALIZE_SHAPE(CALL, 1, 64)                                                                 \
    SPECIALIZE_SHAPE(CALL, 2, 64)                                                                 \
    SPECIALIZE_SHAPE(CALL, 3, 64)                                                                 \
    SPECIALIZE_SHAPE(CALL, 4, 64)                                                                 \
    SPECIALIZE_SHAPE(CALL, 7, 64)                                                                 \
    SPECIALIZE_SHAPE(CALL, 8, 64)                                                                 \
    SPECIALIZE_SHAPE(CALL, 1, 128)                                                                \
    SPECIALIZE_SHAPE(CALL, 2, 128)                                                                \
    SPECIALIZE_SHAPE(CALL, 4, 128)                                                                \
    SPECIALIZE_SHAPE(CALL, 5, 128)                                                                \
    SPECIALIZE_SHAPE(CALL, 7, 128)                                                                \
    SPECIALIZE_SHAPE(CALL, 8, 128)

/* The four sums of a, b, c and d's lanes: unpack, shuffle and two halvings shared by the four,
 * where four full reductions cost twice the instructions. */
static inline __m128 sum4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* One query row's dot product with a key row (already loaded, `slices` vectors of 16), lanes not
 * yet added. */
static inline __attribute__((always_inline)) __m512 dot_lanes(const float *q, const __m512 *row,
                                                              int64_t slices) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), row[0]);
    for (int64_t c = 1; c < slices; c++)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), row[c], acc);
    return acc;
}

/* Scores: up to 4 heads share a kv head in the common shapes, and their keys go four at a time
 * (sum4_ps). P.V: with group x D/16 accumulators in registers (<= 16: the common shapes), each
 * value row updates them all, group x D/16 independent FMA chains where one 16-dim slice at a
 * time had group, which waited on each other's latency; each accumulator adds the same terms in
 * the same order either way. */
#define ACC_REGS 16
#define DEFINE_BLOCK_OPS(SUFFIX, T, LOAD16)                                                       \
    static inline __attribute__((always_inline)) void scores_impl_##SUFFIX(                      \
        const float (*q)[MAX_HEAD_DIM], const T *kb, int64_t ss, int64_t n, int64_t group,        \
        int64_t D, float (*p)[MAX_CHUNK], int64_t t0) {                                           \
        __m512 row[MAX_HEAD_DIM / 16];                                                            \
        int64_t t = 0;                                                                            \
        if (group <= 4) {                                                                         \
            for (; t + 4 <= n; t += 4) {                                                          \
                __m512 dots[4][4];                                                                \
                for (int64_t u = 0; u < 4; u++) {                                                 \
                    for (int64_t c = 0; c < D / 16; c++)                                          \
                        row[c] = LOAD16(kb + (t + u) * ss + 16 * c);                              \
                    for (int64_t j = 0; j < group; j++)                                           \
                        dots[j][u] = dot_lanes(q[j], row, D / 16);                                \
                }                                                                                 \
                for (int64_t j = 0; j < group; j++)                                               \
                    _mm_storeu_ps(p[j] + t0 + t,                                                  \
                                  sum4_ps(dots[j][0], dots[j][1], dots[j][2], dots[j][3]));       \
            }                                                                                     \
        }                                                                                         \
        for (; t < n; t++) {                                                                      \
            for (int64_t c = 0; c < D / 16; c++) row[c] = LOAD16(kb + t * ss + 16 * c);           \
            for (int64_t j = 0; j < group; j++)                                                   \
                p[j][t0 + t] = _mm512_reduce_add_ps(dot_lanes(q[j], row, D / 16));                \
        }                                                                                         \
    }                                                                                             \
    static inline __attribute__((always_inline)) void accumulate_impl_##SUFFIX(                  \
        float (*acc)[MAX_HEAD_DIM], const T *vb, int64_t ss, int64_t n, int64_t group, int64_t D, \
        const float (*p)[MAX_CHUNK], int64_t t0) {                                                \
        const int64_t slices = D / 16;                                                            \
        if (group * slices <= ACC_REGS) {                                                         \
            __m512 sums[ACC_REGS];                                                                \
            for (int64_t j = 0; j < group; j++)                                                   \
                for (int64_t c = 0; c < slices; c++)                                              \
                    sums[j * slices + c] = _mm512_loadu_ps(acc[j] + 16 * c);                      \
            for (int64_t t = 0; t < n; t++) {                                                     \
                __m512 v[ACC_REGS];                                                               \
                for (int64_t c = 0; c < slices; c++) v[c] = LOAD16(vb + t * ss + 16 * c);        \
                for (int64_t j = 0; j < group; j++) {                                             \
                    const __m512 w = _mm512_set1_ps(p[j][t0 + t]);                                \
                    for (int64_t c = 0; c < slices; c++)                                          \
                        sums[j * slices + c] = _mm512_fmadd_ps(w, v[c], sums[j * slices + c]);    \
                }                                                                                 \
            }                                                                                     \
            for (int64_t j = 0; j < group; j++)                                                   \
                for (int64_t c = 0; c < slices; c++)                                              \
                    _mm512_storeu_ps(acc[j] + 16 * c, sums[j * slices + c]);                      \
            return;                                                                               \
        }                                                                                         \
        for (int64_t c = 0; c < slices; c++) {                                                    \
            __m512 sums[MAX_GROUP];                                                               \
            for (int64_t j = 0; j < group; j++) sums[j] = _mm512_loadu_ps(acc[j] + 16 * c);       \
            for (int64_t t = 0; t < n; t++) {                                                     \
                const __m512 v = LOAD16(vb + t * ss + 16 * c);                                    \
                for (int64_t j = 0; j < group; j++)                                               \
                    sums[j] = _mm512_fmadd_ps(_mm512_set1_ps(p[j][t0 + t]), v, sums[j]);          \
            }                                                                                     \
            for (int64_t j = 0; j < group; j++) _mm512_storeu_ps(acc[j] + 16 * c, sums[j]);       \
        }                                                                                         \
    }                                                                                             \
    /* The common shapes get their own copies, with the group and head size known at compile      \
     * time, so the accumulators live in registers and the loops unroll. */                      \
    static void scores_##SUFFIX(const float (*q)[MAX_HEAD_DIM], const T *kb, int64_t ss,          \
                                int64_t n, int64_t group, int64_t D, float (*p)[MAX_CHUNK],       \
                                int64_t t0) {                                                     \
        SPECIALIZE(scores_impl_##SUFFIX(q, kb, ss, n, G_, D_, p, t0))                             \
        scores_impl_##SUFFIX(q, kb, ss, n, group, D, p, t0);                                      \
    }                                                                                             \
    static void accumulate_##SUFFIX(float (*acc)[MAX_HEAD_DIM], const T *vb, int64_t ss,          \
                                    int64_t n, int64_t group, int64_t D,                          \
                                    const float (*p)[MAX_CHUNK], int64_t t0) {                    \
        SPECIALIZE(accumulate_impl_##SUFFIX(acc, vb, ss, n, G_, D_, p, t0))                       \
        accumulate_impl_##SUFFIX(acc, vb, ss, n, group, D, p, t0);                                \
    }

DEFINE_BLOCK_OPS(f32, float, load16_f32)
DEFINE_BLOCK_OPS(bf16, uint16_t, load16_bf16)
DEFINE_BLOCK_OPS(e4m3, uint8_t, load16_e4m3)
DEFINE_BLOCK_OPS(e5m2, uint8_t, load16_e5m2)
#else
#define DEFINE_BLOCK_OPS(SUFFIX, T, LOAD)                                                         \
    static inline void scores_##SUFFIX(const float (*q)[MAX_HEAD_DIM], const T *kb, int64_t ss,   \
                                       int64_t n, int64_t group, int64_t D,                       \
                                       float (*p)[MAX_CHUNK], int64_t t0) {                       \
        float row[MAX_HEAD_DIM];                                                                  \
        for (int64_t t = 0; t < n; t++) {                                                         \
            for (int64_t d = 0; d < D; d++) row[d] = LOAD(kb[t * ss + d]);                        \
            for (int64_t j = 0; j < group; j++) p[j][t0 + t] = dot(q[j], row, D);                 \
        }                                                                                         \
    }                                                                                             \
    static inline void accumulate_##SUFFIX(float (*acc)[MAX_HEAD_DIM], const T *vb, int64_t ss,   \
                                           int64_t n, int64_t group, int64_t D,                   \
                                           const float (*p)[MAX_CHUNK], int64_t t0) {             \
        float row[MAX_HEAD_DIM];                                                                  \
        for (int64_t t = 0; t < n; t++) {                                                         \
            for (int64_t d = 0; d < D; d++) row[d] = LOAD(vb[t * ss + d]);                        \
            for (int64_t j = 0; j < group; j++) {                                                 \
                const float w = p[j][t0 + t];                                                     \
                for (int64_t d = 0; d < D; d++) acc[j][d] += w * row[d];                          \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_BLOCK_OPS(f32, float, LOAD_F32)
DEFINE_BLOCK_OPS(bf16, uint16_t, bf16_to_f32)
DEFINE_BLOCK_OPS(e4m3, uint8_t, E4M3_TO_F32)
DEFINE_BLOCK_OPS(e5m2, uint8_t, E5M2_TO_F32)
#endif

/* Asks for one cache block's keys and values of one kv head (a row of each token) ahead of
 * their use. A sequence's blocks lie anywhere in the pool, and one head's rows are strided by the
 * other heads': the hardware prefetcher restarts at every block, and a decode, which reads each
 * cached key and value once, would wait on memory at every one of them. A decode keeps the
 * blocks of its next PREFETCH_TOKENS tokens requested (into L2: 512 float32 rows of 64, keys and
 * values, are 256 KB), so their misses overlap each other and the arithmetic.
 * -DKVPILOT_NO_PREFETCH builds without (the A/B in bench/RESULTS.md). */
#define PREFETCH_TOKENS 512
static inline void prefetch_block(const char *k, const char *v, int64_t k_stride, int64_t v_stride,
                                  int64_t n, int64_t row_bytes) {
#ifdef KVPILOT_NO_PREFETCH
    return;
#endif
    for (int64_t t = 0; t < n; t++)
        for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k + t * k_stride + b, 0, 2);
            __builtin_prefetch(v + t * v_stride + b, 0, 2);
        }
}

/* Inside decode_unit: block b of a unit (its table, cached length and kv head; the last block may
 * be partly filled): the unit's own, or the one its thread runs next. */
#define PREFETCH_UNIT_BLOCK(TABLE, LEN, KVH, b)                                                   \
    prefetch_block((const char *)(k_cache + (TABLE)[b] * k_sb + (KVH) * k_sh),                    \
                   (const char *)(v_cache + (TABLE)[b] * v_sb + (KVH) * v_sh),                    \
                   k_ss * (int64_t)sizeof(*k_cache), v_ss * (int64_t)sizeof(*v_cache),            \
                   (LEN) - (b) * block_size < block_size ? (LEN) - (b) * block_size : block_size, \
                   D * (int64_t)sizeof(*k_cache))

/* Units go to the threads one at a time, as they finish (units differ in length, and a thread may
 * lose its core for a while), and each thread claims its next unit before it works on the one in
 * hand, whose P.V pass asks for that next unit's first blocks, one per block it adds up: their
 * misses overlap this unit's arithmetic instead of stalling the next unit's start
 * (bench/RESULTS.md). */
#define NEXT_PREFETCH_BLOCKS 4
#define DECODE_LOOP(SUFFIX)                                                                       \
    const int64_t num_units = num_seqs * num_kv_heads;                                            \
    int64_t next_unit = 0;                                                                        \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
        int64_t unit = __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED);                       \
        while (unit < num_units) {                                                                \
            const int64_t claimed = __atomic_fetch_add(&next_unit, 1, __ATOMIC_RELAXED);          \
            const int64_t s = unit / num_kv_heads, kvh = unit % num_kv_heads;                     \
            decode_unit_##SUFFIX(query + s * num_heads * head_dim, out + s * num_heads * head_dim, \
                                 k_cache, v_cache, block_tables + s * table_stride, seq_lens[s],  \
                                 kvh, group, head_dim, block_size, k_sb, k_sh, k_ss, v_sb, v_sh,  \
                                 v_ss, scale, k_scale, v_scale,                                   \
                                 claimed < num_units                                              \
                                     ? block_tables + (claimed / num_kv_heads) * table_stride     \
                                     : NULL,                                                      \
                                 claimed < num_units ? seq_lens[claimed / num_kv_heads] : 0,      \
                                 claimed % num_kv_heads);                                         \
            unit = claimed;                                                                       \
        }                                                                                         \
    }
/* SUFFIX names the (query dtype, cache dtype) pair; C is the cache's element type and OPS the
 * suffix of its block ops. */
#define DEFINE_DECODE(NAME, SUFFIX, T, LOAD, STORE, C, OPS)                                       \
    /* One (sequence, kv head) with a single query token: qtok and otok point at that token's     \
     * heads, table at the sequence's block table; len >= 0 cached tokens. next_table, next_len   \
     * and next_kvh: the unit this thread runs next, whose first blocks it prefetches (next_table \
     * NULL: none). */                                                                            \
    static void decode_unit_##SUFFIX(const T *qtok, T *otok, const C *k_cache, const C *v_cache,  \
                                     const int32_t *table, int64_t len, int64_t kvh,              \
                                     int64_t group, int64_t D, int64_t block_size, int64_t k_sb,  \
                                     int64_t k_sh, int64_t k_ss, int64_t v_sb, int64_t v_sh,      \
                                     int64_t v_ss, float scale, const float *k_scale,             \
                                     const float *v_scale, const int32_t *next_table,             \
                                     int64_t next_len, int64_t next_kvh) {                        \
        float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                           \
        const float qscale = scale * (k_scale != NULL ? k_scale[kvh] : 1.0f);                     \
        const float vscale = v_scale != NULL ? v_scale[kvh] : 1.0f;                               \
        float p[MAX_GROUP][MAX_CHUNK];                                                            \
        float m[MAX_GROUP], l[MAX_GROUP];                                                         \
        for (int64_t j = 0; j < group; j++) {                                                     \
            const T *qr = qtok + (kvh * group + j) * D;                                           \
            for (int64_t d = 0; d < D; d++) {                                                     \
                q[j][d] = LOAD(qr[d]) * qscale;                                                   \
                acc[j][d] = 0.0f;                                                                 \
            }                                                                                     \
            m[j] = 0.0f;                                                                          \
            l[j] = 0.0f;                                                                          \
        }                                                                                         \
        const int64_t num_blocks = (len + block_size - 1) / block_size;                           \
        const int64_t window = PREFETCH_TOKENS > block_size ? PREFETCH_TOKENS / block_size : 1;   \
        for (int64_t b = 0; b < num_blocks && b < window; b++)                                    \
            PREFETCH_UNIT_BLOCK(table, len, kvh, b);                                              \
        const int64_t chunk = (MAX_CHUNK / block_size) * block_size;                              \
        for (int64_t start = 0; start < len; start += chunk) {                                    \
            const int64_t n = len - start < chunk ? len - start : chunk;                          \
            for (int64_t t0 = 0; t0 < n; t0 += block_size) {                                      \
                const int64_t block = table[(start + t0) / block_size];                           \
                const int64_t bn = n - t0 < block_size ? n - t0 : block_size;                     \
                if ((start + t0) / block_size + window < num_blocks)                              \
                    PREFETCH_UNIT_BLOCK(table, len, kvh, (start + t0) / block_size + window);     \
                scores_##OPS(q, k_cache + block * k_sb + kvh * k_sh, k_ss, bn, group, D, p, t0);  \
            }                                                                                     \
            for (int64_t j = 0; j < group; j++) {                                                 \
                float chunk_max = p[j][0];                                                        \
                _Pragma("omp simd reduction(max : chunk_max)")                                    \
                for (int64_t t = 1; t < n; t++)                                                   \
                    chunk_max = p[j][t] > chunk_max ? p[j][t] : chunk_max;                        \
                const float new_max = start == 0 || chunk_max > m[j] ? chunk_max : m[j];          \
                const float rescale = start == 0 ? 0.0f : exp_approx(m[j] - new_max);             \
                float sum = 0.0f;                                                                 \
                _Pragma("omp simd reduction(+ : sum)")                                            \
                for (int64_t t = 0; t < n; t++) {                                                 \
                    p[j][t] = exp_approx(p[j][t] - new_max);                                      \
                    sum += p[j][t];                                                               \
                }                                                                                 \
                l[j] = l[j] * rescale + sum;                                                      \
                m[j] = new_max;                                                                   \
                for (int64_t d = 0; d < D; d++) acc[j][d] *= rescale;                             \
            }                                                                                     \
            for (int64_t t0 = 0; t0 < n; t0 += block_size) {                                      \
                const int64_t block = table[(start + t0) / block_size];                           \
                const int64_t bn = n - t0 < block_size ? n - t0 : block_size;                     \
                const int64_t b = (start + t0) / block_size;                                      \
                if (next_table != NULL && b < NEXT_PREFETCH_BLOCKS && b * block_size < next_len)  \
                    PREFETCH_UNIT_BLOCK(next_table, next_len, next_kvh, b);                       \
                accumulate_##OPS(acc, v_cache + block * v_sb + kvh * v_sh, v_ss, bn, group, D, p, \
                                 t0);                                                             \
            }                                                                                     \
        }                                                                                         \
        for (int64_t j = 0; j < group; j++) {                                                     \
            T *o = otok + (kvh * group + j) * D;                                                  \
            const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f; /* len 0: zeros */                \
            for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[j][d] * inv * vscale);               \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    void NAME(const T *query, const C *k_cache, const C *v_cache, const int32_t *block_tables,    \
              const int32_t *seq_lens, T *out, int64_t num_seqs, int64_t num_heads,               \
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t table_stride,   \
              int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss, int64_t v_sh, \
              float scale, const float *k_scale, const float *v_scale) {                          \
        const int64_t group = num_heads / num_kv_heads;                                           \
        DECODE_LOOP(SUFFIX)                                                                       \
    }

DEFINE_DECODE(paged_decode_f32, f32, float, LOAD_F32, STORE_F32, float, f32)
DEFINE_DECODE(paged_decode_bf16, bf16, uint16_t, bf16_to_f32, f32_to_bf16, uint16_t, bf16)
DEFINE_DECODE(paged_decode_f32_e4m3, f32_e4m3, float, LOAD_F32, STORE_F32, uint8_t, e4m3)
DEFINE_DECODE(paged_decode_bf16_e4m3, bf16_e4m3, uint16_t, bf16_to_f32, f32_to_bf16, uint8_t, e4m3)
DEFINE_DECODE(paged_decode_f32_e5m2, f32_e5m2, float, LOAD_F32, STORE_F32, uint8_t, e5m2)
DEFINE_DECODE(paged_decode_bf16_e5m2, bf16_e5m2, uint16_t, bf16_to_f32, f32_to_bf16, uint8_t, e5m2)

/* Varlen paged attention: every sequence of a step (prefill chunks, over a cached prefix or not,
 * and decodes) in one call. The step's keys and values are already in the cache.
 *   query/out [num_tokens, num_heads, head_dim] contiguous; sequence s owns tokens
 *   query_start_loc[s] .. query_start_loc[s + 1] - 1, the last ones of its seq_lens[s] positions.
 * A sequence with one query token goes through decode_unit; a longer one is cut into tiles of
 * TILE_ROWS query rows (tokens x the query heads of one kv head), and each tile streams its keys
 * once, KEY_CHUNK at a time, with an online softmax. Inside a tile the rows sit in vector lanes
 * (q and the output transposed: [head_dim][rows]), so both products are broadcast-FMAs of one
 * key (or value) element against 16 rows, each key and value read once for the whole tile. */
/* GCC notes that 64-byte vectors change the ABI without AVX-512: these never cross the library's
 * boundary (static functions only). */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

#define TILE_VECS 3
#define TILE_ROWS (TILE_VECS * LANES)
#define KEY_CHUNK 64
#define KEY_UNROLL 8
#define DIM_UNROLL 8

static inline v16 vsplat(float x) { return (v16){0} + x; }

static inline v16 vfma(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, c);
#else
    return a * b + c;
#endif
}

static inline v16 vselect(vi16 mask, v16 a, v16 b) {
    return (v16)((mask & (vi16)a) | (~mask & (vi16)b));
}

static inline v16 vmax(v16 a, v16 b) { return vselect(a > b, a, b); }

/* exp_approx on 16 lanes, and exactly 0 below -87 (a masked score, -inf, gives 0). */
static inline v16 vexp(v16 x) {
    const vi16 tiny = x < vsplat(-87.0f);
    x = vselect(tiny, vsplat(-87.0f), x);
    x = vselect(x > vsplat(88.0f), vsplat(88.0f), x);
    const v16 magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 n = (x * 1.44269504088896341f + magic) - magic;
    const v16 r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    v16 p = vsplat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return (v16)((vi16)(p * (v16)bits) & ~tiny);
}

/* st[t] = q . kf[t] for the npad keys of a chunk (npad a multiple of KEY_UNROLL). */
static void tile_scores(const v16 (*qt)[TILE_VECS], const float (*kf)[MAX_HEAD_DIM], int64_t npad,
                        int64_t D, v16 (*st)[TILE_VECS]) {
    for (int64_t t0 = 0; t0 < npad; t0 += KEY_UNROLL) {
        v16 acc[KEY_UNROLL][TILE_VECS];
        for (int u = 0; u < KEY_UNROLL; u++)
            for (int v = 0; v < TILE_VECS; v++) acc[u][v] = vsplat(0.0f);
        for (int64_t d = 0; d < D; d++) {
            v16 q[TILE_VECS];
            for (int v = 0; v < TILE_VECS; v++) q[v] = qt[d][v];
            for (int u = 0; u < KEY_UNROLL; u++) {
                const v16 k = vsplat(kf[t0 + u][d]);
                for (int v = 0; v < TILE_VECS; v++) acc[u][v] = vfma(k, q[v], acc[u][v]);
            }
        }
        for (int u = 0; u < KEY_UNROLL; u++)
            for (int v = 0; v < TILE_VECS; v++) st[t0 + u][v] = acc[u][v];
    }
}

/* The online softmax over one chunk of scores, in place (scores -> weights): masks the keys past
 * each row's position when `mask`, updates the running max m and sum l, rescales the output. */
static void tile_softmax(v16 (*st)[TILE_VECS], int64_t npad, int64_t k0, const v16 *qpos, int mask,
                         v16 *m, v16 *l, v16 (*ot)[TILE_VECS], int64_t D) {
    v16 new_max[TILE_VECS], alpha[TILE_VECS], sum[TILE_VECS];
    for (int v = 0; v < TILE_VECS; v++) new_max[v] = m[v];
    for (int64_t t = 0; t < npad; t++) {
        const v16 key_pos = vsplat((float)(k0 + t));
        for (int v = 0; v < TILE_VECS; v++) {
            v16 s = st[t][v];
            if (mask) s = vselect(key_pos > qpos[v], vsplat(-INFINITY), s);
            st[t][v] = s;
            new_max[v] = vmax(new_max[v], s);
        }
    }
    for (int v = 0; v < TILE_VECS; v++) {
        alpha[v] = vexp(m[v] - new_max[v]); /* 0 on the first chunk (m = -inf) */
        m[v] = new_max[v];
        sum[v] = vsplat(0.0f);
    }
    for (int64_t t = 0; t < npad; t++)
        for (int v = 0; v < TILE_VECS; v++) {
            const v16 p = vexp(st[t][v] - new_max[v]);
            st[t][v] = p;
            sum[v] += p;
        }
    for (int v = 0; v < TILE_VECS; v++) l[v] = l[v] * alpha[v] + sum[v];
    for (int64_t d = 0; d < D; d++)
        for (int v = 0; v < TILE_VECS; v++) ot[d][v] *= alpha[v];
}

/* ot[d] += sum_t p[t] * vf[t][d] over the n keys of a chunk (D a multiple of DIM_UNROLL). */
static void tile_pv(v16 (*ot)[TILE_VECS], const v16 (*p)[TILE_VECS],
                    const float (*vf)[MAX_HEAD_DIM], int64_t n, int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += DIM_UNROLL) {
        v16 acc[DIM_UNROLL][TILE_VECS];
        for (int u = 0; u < DIM_UNROLL; u++)
            for (int v = 0; v < TILE_VECS; v++) acc[u][v] = ot[d0 + u][v];
        for (int64_t t = 0; t < n; t++) {
            v16 w[TILE_VECS];
            for (int v = 0; v < TILE_VECS; v++) w[v] = p[t][v];
            for (int u = 0; u < DIM_UNROLL; u++) {
                const v16 x = vsplat(vf[t][d0 + u]);
                for (int v = 0; v < TILE_VECS; v++) acc[u][v] = vfma(x, w[v], acc[u][v]);
            }
        }
        for (int u = 0; u < DIM_UNROLL; u++)
            for (int v = 0; v < TILE_VECS; v++) ot[d0 + u][v] = acc[u][v];
    }
}

/* One unit of work: a tile of a prefill chunk under one kv head, or one decode under one. */
typedef struct {
    int32_t seq, kvh, tile;
} WorkItem;

typedef struct {
    int64_t cost;
    int32_t seq;
} SeqCost;

static int heavier_first(const void *a, const void *b) {
    const int64_t ca = ((const SeqCost *)a)->cost, cb = ((const SeqCost *)b)->cost;
    return (ca < cb) - (ca > cb);
}

/* The step's work items in the order the threads take them (dynamically): sequences heaviest
 * first, so that a long prefill does not finish last on one thread; within a sequence, kv head by
 * kv head and its tiles from the last (longest context) back, so that consecutive items on a
 * thread read the same keys and values, which then stay in its L2 cache. NULL when out of memory;
 * *count: the number of items. */
static WorkItem *plan_work(const int32_t *query_start_loc, const int32_t *seq_lens,
                           int64_t num_seqs, int64_t num_kv_heads, int64_t group,
                           int64_t tile_tokens, int64_t *count) {
    SeqCost *order = malloc(sizeof(SeqCost) * (num_seqs > 0 ? num_seqs : 1));
    if (order == NULL) return NULL;
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        const int64_t pos0 = seq_lens[s] - q_len;
        int64_t cost = 0;
        if (q_len == 1) {
            cost = (int64_t)seq_lens[s] * group; /* its keys x its rows */
            total += num_kv_heads;
        } else {
            /* A tile's keys (causal: up to its last token) x a full tile of rows. */
            for (int64_t first = 0; first < q_len; first += tile_tokens) {
                const int64_t last = first + tile_tokens < q_len ? first + tile_tokens : q_len;
                cost += (pos0 + last) * TILE_ROWS;
                total += num_kv_heads;
            }
        }
        order[s] = (SeqCost){cost, (int32_t)s};
    }
    qsort(order, num_seqs, sizeof(SeqCost), heavier_first);
    WorkItem *items = malloc(sizeof(WorkItem) * (total > 0 ? total : 1));
    if (items != NULL) {
        int64_t next = 0;
        for (int64_t i = 0; i < num_seqs; i++) {
            const int32_t s = order[i].seq;
            const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
            const int64_t tiles = q_len == 1 ? 1 : (q_len + tile_tokens - 1) / tile_tokens;
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
                for (int64_t tile = tiles - 1; tile >= 0; tile--)
                    items[next++] = (WorkItem){s, (int32_t)kvh, (int32_t)tile};
        }
    }
    free(order);
    *count = total;
    return items;
}

#if defined(__AVX512BF16__)
/* bfloat16 on CPUs with AVX512_BF16: both products as pairwise bf16 dot products (vdpbf16ps: two
 * products per f32 lane and instruction, accumulated in f32) on the cache's own values. q and k
 * are exact (the scale multiplies the f32 scores); the softmax weights are rounded to bf16 for
 * the second product, as torch's bf16 attention rounds them. */
#define BF16_PAIRS(x) ((__m512bh)(x))

/* Lane i of the result: (bf16(lo[i]), bf16(hi[i])), the pair for keys t and t + 1. */
static inline __m512i pack_pairs(__m512 lo, __m512 hi) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* 16 bf16 values zero-extended to 32-bit lanes. */
static inline __m512i widen16(const uint16_t *x) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
}

/* Stands in for the keys and values past the end of a chunk. */
static const uint32_t zero_pairs[MAX_HEAD_DIM / 2];

static void prefill_tile_bf16_pairs(const uint16_t *query, uint16_t *out, const uint16_t *k_cache,
                                    const uint16_t *v_cache, const int32_t *table, int64_t tok0,
                                    int64_t ntok, int64_t pos0, int64_t kvh, int64_t num_heads,
                                    int64_t group, int64_t D, int64_t block_size, int64_t k_sb,
                                    int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss,
                                    int64_t v_sh, float scale, float vscale) {
    /* qp[d / 2][v]: lane r holds row r's (q[d], q[d + 1]); vp[t / 2][d]: (v[t][d], v[t + 1][d]). */
    __m512i qp[MAX_HEAD_DIM / 2][TILE_VECS], pp[KEY_CHUNK / 2][TILE_VECS];
    v16 ot[MAX_HEAD_DIM][TILE_VECS], st[KEY_CHUNK][TILE_VECS];
    uint32_t vp[KEY_CHUNK / 2][MAX_HEAD_DIM] __attribute__((aligned(64)));
    const uint32_t *krow[KEY_CHUNK];
    v16 qpos[TILE_VECS], m[TILE_VECS], l[TILE_VECS];
    uint32_t *qf = (uint32_t *)qp;
    float *of = (float *)ot, *pos = (float *)qpos, *lf = (float *)l;
    const int64_t rows = ntok * group, half = D / 2;
    memset(qp, 0, sizeof(__m512i) * TILE_VECS * half);
    memset(ot, 0, sizeof(v16) * TILE_VECS * D);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src =
            query + ((tok0 + r / group) * num_heads + kvh * group + r % group) * D;
        for (int64_t i = 0; i < half; i++) {
            uint32_t pair;
            memcpy(&pair, src + 2 * i, sizeof pair);
            qf[i * TILE_ROWS + r] = pair;
        }
    }
    for (int64_t r = 0; r < TILE_ROWS; r++)
        pos[r] = (float)(pos0 + (r < rows ? r / group : ntok - 1));
    for (int v = 0; v < TILE_VECS; v++) {
        m[v] = vsplat(-INFINITY);
        l[v] = vsplat(0.0f);
    }
    const int64_t kv_end = pos0 + ntok;
    for (int64_t k0 = 0; k0 < kv_end; k0 += KEY_CHUNK) {
        const int64_t n = kv_end - k0 < KEY_CHUNK ? kv_end - k0 : KEY_CHUNK;
        const int64_t npad = (n + KEY_UNROLL - 1) / KEY_UNROLL * KEY_UNROLL;
        const int64_t npairs = (n + 1) / 2;
        for (int64_t t = 0; t < npad; t++) {
            const int64_t key = k0 + t;
            krow[t] = t < n ? (const uint32_t *)(k_cache + table[key / block_size] * k_sb +
                                                 (key % block_size) * k_ss + kvh * k_sh)
                            : zero_pairs;
        }
        for (int64_t i = 0; i < npairs; i++) {
            const uint16_t *rows2[2];
            for (int64_t h = 0; h < 2; h++) {
                const int64_t key = k0 + 2 * i + h;
                rows2[h] = 2 * i + h < n ? v_cache + table[key / block_size] * v_sb +
                                               (key % block_size) * v_ss + kvh * v_sh
                                         : (const uint16_t *)zero_pairs;
            }
            for (int64_t d = 0; d < D; d += 16) {
                const __m512i lo = widen16(rows2[0] + d), hi = widen16(rows2[1] + d);
                _mm512_store_si512(vp[i] + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
        for (int64_t t0 = 0; t0 < npad; t0 += KEY_UNROLL) {
            __m512 acc[KEY_UNROLL][TILE_VECS];
            for (int u = 0; u < KEY_UNROLL; u++)
                for (int v = 0; v < TILE_VECS; v++) acc[u][v] = _mm512_setzero_ps();
            for (int64_t i = 0; i < half; i++) {
                __m512i q[TILE_VECS];
                for (int v = 0; v < TILE_VECS; v++) q[v] = qp[i][v];
                for (int u = 0; u < KEY_UNROLL; u++) {
                    const __m512i k = _mm512_set1_epi32((int)krow[t0 + u][i]);
                    for (int v = 0; v < TILE_VECS; v++)
                        acc[u][v] = _mm512_dpbf16_ps(acc[u][v], BF16_PAIRS(q[v]), BF16_PAIRS(k));
                }
            }
            for (int u = 0; u < KEY_UNROLL; u++)
                for (int v = 0; v < TILE_VECS; v++) st[t0 + u][v] = acc[u][v] * scale;
        }
        tile_softmax(st, npad, k0, qpos, k0 + npad - 1 > pos0, m, l, ot, D);
        for (int64_t i = 0; i < npairs; i++)
            for (int v = 0; v < TILE_VECS; v++)
                pp[i][v] = pack_pairs(st[2 * i][v], st[2 * i + 1][v]);
        for (int64_t d0 = 0; d0 < D; d0 += DIM_UNROLL) {
            __m512 acc[DIM_UNROLL][TILE_VECS];
            for (int u = 0; u < DIM_UNROLL; u++)
                for (int v = 0; v < TILE_VECS; v++) acc[u][v] = ot[d0 + u][v];
            for (int64_t i = 0; i < npairs; i++) {
                __m512i w[TILE_VECS];
                for (int v = 0; v < TILE_VECS; v++) w[v] = pp[i][v];
                for (int u = 0; u < DIM_UNROLL; u++) {
                    const __m512i x = _mm512_set1_epi32((int)vp[i][d0 + u]);
                    for (int v = 0; v < TILE_VECS; v++)
                        acc[u][v] = _mm512_dpbf16_ps(acc[u][v], BF16_PAIRS(w[v]), BF16_PAIRS(x));
                }
            }
            for (int u = 0; u < DIM_UNROLL; u++)
                for (int v = 0; v < TILE_VECS; v++) ot[d0 + u][v] = acc[u][v];
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = out + ((tok0 + r / group) * num_heads + kvh * group + r % group) * D;
        const float inv = 1.0f / lf[r];
        for (int64_t d = 0; d < D; d++)
            dst[d] = f32_to_bf16(of[d * TILE_ROWS + r] * inv * vscale);
    }
}
#define PREFILL_TILE_BF16 prefill_tile_bf16_pairs
#else
#define PREFILL_TILE_BF16 prefill_tile_bf16
#endif

/* SUFFIX names the (query dtype, cache dtype) pair: C is the cache's element type, CLOAD its
 * decoding to float; TILE the prefill tile (the generic one below, or bf16's pairs). */
#define DEFINE_VARLEN(SUFFIX, T, LOAD, STORE, TILE, C, CLOAD)                                     \
    /* ntok query tokens (flat index tok0, absolute positions pos0..) under kv head kvh; scale    \
     * already holds the key scale, vscale multiplies the output. */                              \
    __attribute__((unused)) static void prefill_tile_##SUFFIX(                                    \
        const T *query, T *out, const C *k_cache, const C *v_cache,                               \
                                      const int32_t *table, int64_t tok0, int64_t ntok,           \
                                      int64_t pos0, int64_t kvh, int64_t num_heads, int64_t group, \
                                      int64_t D, int64_t block_size, int64_t k_sb, int64_t k_ss,  \
                                      int64_t k_sh, int64_t v_sb, int64_t v_ss, int64_t v_sh,     \
                                      float scale, float vscale) {                                \
        v16 qt[MAX_HEAD_DIM][TILE_VECS], ot[MAX_HEAD_DIM][TILE_VECS], st[KEY_CHUNK][TILE_VECS];   \
        float kf[KEY_CHUNK][MAX_HEAD_DIM], vf[KEY_CHUNK][MAX_HEAD_DIM];                           \
        v16 qpos[TILE_VECS], m[TILE_VECS], l[TILE_VECS];                                          \
        float *qf = (float *)qt, *of = (float *)ot, *pos = (float *)qpos, *lf = (float *)l;       \
        const int64_t rows = ntok * group;                                                        \
        memset(qt, 0, sizeof(v16) * TILE_VECS * D);                                               \
        memset(ot, 0, sizeof(v16) * TILE_VECS * D);                                               \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const T *src = query + ((tok0 + r / group) * num_heads + kvh * group + r % group) * D; \
            for (int64_t d = 0; d < D; d++) qf[d * TILE_ROWS + r] = LOAD(src[d]) * scale;         \
        }                                                                                         \
        /* Padding rows take the last token's position: finite scores, never written out. */      \
        for (int64_t r = 0; r < TILE_ROWS; r++)                                                   \
            pos[r] = (float)(pos0 + (r < rows ? r / group : ntok - 1));                           \
        for (int v = 0; v < TILE_VECS; v++) {                                                     \
            m[v] = vsplat(-INFINITY);                                                             \
            l[v] = vsplat(0.0f);                                                                  \
        }                                                                                         \
        const int64_t kv_end = pos0 + ntok;                                                       \
        for (int64_t k0 = 0; k0 < kv_end; k0 += KEY_CHUNK) {                                      \
            const int64_t n = kv_end - k0 < KEY_CHUNK ? kv_end - k0 : KEY_CHUNK;                  \
            const int64_t npad = (n + KEY_UNROLL - 1) / KEY_UNROLL * KEY_UNROLL;                  \
            for (int64_t t = 0; t < n; t++) {                                                     \
                const int64_t key = k0 + t;                                                       \
                const int64_t block = table[key / block_size], slot = key % block_size;           \
                const C *ks = k_cache + block * k_sb + slot * k_ss + kvh * k_sh;                  \
                const C *vs = v_cache + block * v_sb + slot * v_ss + kvh * v_sh;                  \
                for (int64_t d = 0; d < D; d++) {                                                 \
                    kf[t][d] = CLOAD(ks[d]);                                                      \
                    vf[t][d] = CLOAD(vs[d]);                                                      \
                }                                                                                 \
            }                                                                                     \
            for (int64_t t = n; t < npad; t++) memset(kf[t], 0, sizeof(float) * D);               \
            tile_scores(qt, kf, npad, D, st);                                                     \
            tile_softmax(st, npad, k0, qpos, k0 + npad - 1 > pos0, m, l, ot, D);                  \
            tile_pv(ot, st, vf, n, D);                                                            \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            T *dst = out + ((tok0 + r / group) * num_heads + kvh * group + r % group) * D;        \
            const float inv = 1.0f / lf[r];                                                       \
            for (int64_t d = 0; d < D; d++) dst[d] = STORE(of[d * TILE_ROWS + r] * inv * vscale); \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* Returns 0, or 1 (computing nothing) when the work list cannot be allocated. */             \
    int paged_attention_##SUFFIX(const T *query, const C *k_cache, const C *v_cache,              \
                                 const int32_t *block_tables, const int32_t *query_start_loc,     \
                                 const int32_t *seq_lens, T *out, int64_t num_seqs,               \
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,       \
                                 int64_t block_size, int64_t table_stride, int64_t k_sb,          \
                                 int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss,          \
                                 int64_t v_sh, float scale, const float *k_scale,                 \
                                 const float *v_scale) {                                          \
        const int64_t group = num_heads / num_kv_heads, D = head_dim;                             \
        const int64_t tile_tokens = TILE_ROWS / group;                                            \
        int64_t count = 0;                                                                        \
        WorkItem *items = plan_work(query_start_loc, seq_lens, num_seqs, num_kv_heads, group,     \
                                    tile_tokens, &count);                                         \
        if (items == NULL) return 1;                                                              \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
        for (int64_t unit = 0; unit < count; unit++) {                                            \
            const WorkItem item = items[unit];                                                    \
            const int64_t kvh = item.kvh, s = item.seq;                                           \
            const int64_t tok = query_start_loc[s];                                               \
            const int64_t q_len = query_start_loc[s + 1] - tok;                                   \
            const int32_t *table = block_tables + s * table_stride;                               \
            if (q_len == 1) {                                                                     \
                decode_unit_##SUFFIX(query + tok * num_heads * D, out + tok * num_heads * D,      \
                                     k_cache, v_cache, table, seq_lens[s], kvh, group, D,         \
                                     block_size, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, scale,       \
                                     k_scale, v_scale, NULL, 0, 0);                               \
                continue;                                                                         \
            }                                                                                     \
            const int64_t first = item.tile * tile_tokens;                                        \
            const int64_t ntok = q_len - first < tile_tokens ? q_len - first : tile_tokens;       \
            TILE(query, out, k_cache, v_cache, table, tok + first, ntok,                          \
                 seq_lens[s] - q_len + first, kvh, num_heads, group, D, block_size, k_sb, k_ss,   \
                 k_sh, v_sb, v_ss, v_sh, scale * (k_scale != NULL ? k_scale[kvh] : 1.0f),         \
                 v_scale != NULL ? v_scale[kvh] : 1.0f);                                          \
        }                                                                                         \
        free(items);                                                                              \
        return 0;                                                                                 \
    }

DEFINE_VARLEN(f32, float, LOAD_F32, STORE_F32, prefill_tile_f32, float, LOAD_F32)
DEFINE_VARLEN(bf16, uint16_t, bf16_to_f32, f32_to_bf16, PREFILL_TILE_BF16, uint16_t, bf16_to_f32)
DEFINE_VARLEN(f32_e4m3, float, LOAD_F32, STORE_F32, prefill_tile_f32_e4m3, uint8_t, E4M3_TO_F32)
DEFINE_VARLEN(bf16_e4m3, uint16_t, bf16_to_f32, f32_to_bf16, prefill_tile_bf16_e4m3, uint8_t,
              E4M3_TO_F32)
DEFINE_VARLEN(f32_e5m2, float, LOAD_F32, STORE_F32, prefill_tile_f32_e5m2, uint8_t, E5M2_TO_F32)
DEFINE_VARLEN(bf16_e5m2, uint16_t, bf16_to_f32, f32_to_bf16, prefill_tile_bf16_e5m2, uint8_t,
              E5M2_TO_F32)

/* Rounds a float32 to the storage dtype and back: torch rounds every op's result to the tensor's
 * dtype, so the float32 path rounds nowhere and the bfloat16 path after each op. */
#define ROUND_F32(x) (x)
#define ROUND_BF16(x) bf16_to_f32(f32_to_bf16(x))

#define DEFINE_LAYER_OPS(SUFFIX, T, LOAD, STORE, ROUND)                                           \
    /* Returns 0, or 1 (writing nothing) when a position lies outside the cos/sin table. */       \
    int rotary_##SUFFIX(const T *q, const T *k, const int64_t *positions,                         \
                        const float *cos_sin, int64_t num_positions, T *q_out, T *k_out,          \
                        int64_t tokens, int64_t num_heads, int64_t num_kv_heads,                  \
                        int64_t head_dim, int64_t q_stride, int64_t k_stride) {                   \
        for (int64_t t = 0; t < tokens; t++)                                                      \
            if (positions[t] < 0 || positions[t] >= num_positions) return 1;                      \
        const int64_t half = head_dim / 2;                                                        \
        _Pragma("omp parallel for if (tokens > 8)")                                               \
        for (int64_t t = 0; t < tokens; t++) {                                                    \
            const float *cs = cos_sin + positions[t] * head_dim;                                  \
            for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {                              \
                const T *src = h < num_heads ? q + t * q_stride + h * head_dim                    \
                                             : k + t * k_stride + (h - num_heads) * head_dim;     \
                T *dst = h < num_heads ? q_out + (t * num_heads + h) * head_dim                   \
                                       : k_out + (t * num_kv_heads + h - num_heads) * head_dim;   \
                for (int64_t i = 0; i < half; i++) {                                              \
                    const float x1 = LOAD(src[i]), x2 = LOAD(src[half + i]);                      \
                    dst[i] = STORE(x1 * cs[i] - x2 * cs[half + i]);                               \
                    dst[half + i] = STORE(x2 * cs[i] + x1 * cs[half + i]);                        \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }                                                                                             \
                                                                                                  \
    /* Returns 0, or 1 (writing nothing) when a slot lies outside the cache's num_slots. */       \
    int write_kv_##SUFFIX(const T *key, const T *value, T *k_cache, T *v_cache,                   \
                          const int64_t *slots, int64_t num_slots, int64_t tokens, int64_t row,   \
                          int64_t k_stride, int64_t v_stride) {                                   \
        for (int64_t t = 0; t < tokens; t++)                                                      \
            if (slots[t] < 0 || slots[t] >= num_slots) return 1;                                  \
        for (int64_t t = 0; t < tokens; t++) {                                                    \
            memcpy(k_cache + slots[t] * row, key + t * k_stride, row * sizeof(T));                \
            memcpy(v_cache + slots[t] * row, value + t * v_stride, row * sizeof(T));              \
        }                                                                                         \
        return 0;                                                                                 \
    }

/* The sum of a contiguous float32 row in exactly the order torch's CPU sum kernel adds it
 * (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum), for
 * vectors of `lanes` floats (torch's Vectorized<float>::size() for the CPU capability it dispatched
 * to: 16 with AVX-512, 8 with AVX2). The row is read as vectors; four interleaved accumulators of
 * vectors (ILP) are summed in a cascade of levels of 2^level_power steps; then the leftover
 * vectors, the accumulators into the first, the leftover scalars and last the lanes one by one.
 * Every add is a plain float add in that order, so the result is torch's bit for bit (checked
 * against torch at load: kvpilot.engine.cpu.layer_ops.fused_rms_norm_lanes). */
#define TORCH_SUM_ILP 4
#define TORCH_SUM_LEVELS 4

static int64_t torch_ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t last = 63 - __builtin_clzll((unsigned long long)(x - 1));
    return last + 1;
}

/* One function per width, so the compiler keeps each lane loop in one vector register. */
#define DEFINE_TORCH_ORDER_SUM(LANES)                                                             \
    static float torch_order_sum_##LANES(const float *x, int64_t n) {                             \
        const int64_t vec_size = n / LANES;                                                       \
        const int64_t size = vec_size / TORCH_SUM_ILP;                                            \
        float acc[TORCH_SUM_LEVELS][TORCH_SUM_ILP][LANES];                                        \
        memset(acc, 0, sizeof(acc));                                                              \
        int64_t level_power = torch_ceil_log2(size) / TORCH_SUM_LEVELS;                           \
        if (level_power < 4) level_power = 4;                                                     \
        const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;        \
        int64_t i = 0;                                                                            \
        while (i + level_step <= size) {                                                          \
            for (int64_t j = 0; j < level_step; ++j, ++i)                                         \
                for (int64_t k = 0; k < TORCH_SUM_ILP; ++k)                                       \
                    for (int64_t l = 0; l < LANES; ++l)                                           \
                        acc[0][k][l] += x[(i * TORCH_SUM_ILP + k) * LANES + l];                   \
            for (int64_t j = 1; j < TORCH_SUM_LEVELS; ++j) {                                      \
                for (int64_t k = 0; k < TORCH_SUM_ILP; ++k)                                       \
                    for (int64_t l = 0; l < LANES; ++l) {                                         \
                        acc[j][k][l] += acc[j - 1][k][l];                                         \
                        acc[j - 1][k][l] = 0.0f;                                                  \
                    }                                                                             \
                if ((i & (level_mask << (j * level_power))) != 0) break;                          \
            }                                                                                     \
        }                                                                                         \
        for (; i < size; ++i)                                                                     \
            for (int64_t k = 0; k < TORCH_SUM_ILP; ++k)                                           \
                for (int64_t l = 0; l < LANES; ++l)                                               \
                    acc[0][k][l] += x[(i * TORCH_SUM_ILP + k) * LANES + l];                       \
        for (int64_t j = 1; j < TORCH_SUM_LEVELS; ++j)                                            \
            for (int64_t k = 0; k < TORCH_SUM_ILP; ++k)                                           \
                for (int64_t l = 0; l < LANES; ++l) acc[0][k][l] += acc[j][k][l];                 \
        for (int64_t v = size * TORCH_SUM_ILP; v < vec_size; ++v)                                 \
            for (int64_t l = 0; l < LANES; ++l) acc[0][0][l] += x[v * LANES + l];                 \
        for (int64_t k = 1; k < TORCH_SUM_ILP; ++k)                                               \
            for (int64_t l = 0; l < LANES; ++l) acc[0][0][l] += acc[0][k][l];                     \
        float total = 0.0f;                                                                       \
        for (int64_t t = vec_size * LANES; t < n; ++t) total += x[t];                             \
        for (int64_t l = 0; l < LANES; ++l) total += acc[0][0][l];                                \
        return total;                                                                             \
    }

DEFINE_TORCH_ORDER_SUM(4)
DEFINE_TORCH_ORDER_SUM(8)
DEFINE_TORCH_ORDER_SUM(16)

/* lanes is 4, 8 or 16 (rms_norm_fused checks). */
static float torch_order_sum(const float *x, int64_t n, int64_t lanes) {
    if (lanes == 8) return torch_order_sum_8(x, n);
    if (lanes == 16) return torch_order_sum_16(x, n);
    return torch_order_sum_4(x, n);
}

/* The sums of `rows` contiguous rows of n floats, in torch's order (for the load-time check). */
void torch_order_sums(const float *x, float *out, int64_t rows, int64_t n, int64_t lanes) {
    if (lanes != 4 && lanes != 8 && lanes != 16) return;
    for (int64_t r = 0; r < rows; r++) out[r] = torch_order_sum(x + r * n, n, lanes);
}

/* RMSNorm in two passes around torch's own mean of the squares (its summation order is torch's
 * business; a sum in another order changes the variance in the last bit). Together with that mean
 * they compute exactly what kvpilot.engine.model.layers.rms_norm computes:
 *   prepare: sum = x + residual (rounded to T, the next residual), squares = float(sum)^2;
 *   apply:   out = weight * T(float(sum) * (1 / sqrt(variance + eps))).
 * Every tensor is contiguous: element (t, i) at t * hidden + i. */
#define DEFINE_RMS_NORM(SUFFIX, T, LOAD, STORE, ROUND)                                            \
    void rms_norm_prepare_##SUFFIX(const T *x, const T *residual, T *sum, float *squares,         \
                                   int64_t tokens, int64_t hidden) {                              \
        _Pragma("omp parallel for if (tokens > 64)")                                              \
        for (int64_t t = 0; t < tokens; t++) {                                                    \
            const T *xr = x + t * hidden;                                                         \
            float *sq = squares + t * hidden;                                                     \
            if (residual == NULL) {                                                               \
                for (int64_t i = 0; i < hidden; i++) {                                            \
                    const float v = LOAD(xr[i]);                                                  \
                    sq[i] = v * v;                                                                \
                }                                                                                 \
                continue;                                                                         \
            }                                                                                     \
            const T *rr = residual + t * hidden;                                                  \
            T *out = sum + t * hidden;                                                            \
            for (int64_t i = 0; i < hidden; i++) {                                                \
                const T s = STORE(LOAD(xr[i]) + LOAD(rr[i]));                                     \
                const float v = LOAD(s);                                                          \
                out[i] = s;                                                                       \
                sq[i] = v * v;                                                                    \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    void rms_norm_apply_##SUFFIX(const T *sum, const float *variance, const T *weight, float eps, \
                                 T *out, int64_t tokens, int64_t hidden) {                        \
        _Pragma("omp parallel for if (tokens > 64)")                                              \
        for (int64_t t = 0; t < tokens; t++) {                                                    \
            const float scale = 1.0f / sqrtf(variance[t] + eps);                                  \
            const T *sr = sum + t * hidden;                                                       \
            T *o = out + t * hidden;                                                              \
            for (int64_t i = 0; i < hidden; i++)                                                  \
                o[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(sr[i]) * scale));                       \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* prepare, torch's mean (its sum in torch's order over `lanes`-float vectors, then divided \
     * by hidden) and apply in one call, each row by one thread. Returns 0, or 1 (writing       \
     * nothing) when lanes is out of range or a row buffer could not be allocated. */            \
    int rms_norm_fused_##SUFFIX(const T *x, const T *residual, T *sum, const T *weight,          \
                                float eps, T *out, int64_t tokens, int64_t hidden,               \
                                int64_t lanes) {                                                  \
        if ((lanes != 4 && lanes != 8 && lanes != 16) || hidden < lanes) return 1;              \
        int failed = 0;                                                                           \
        _Pragma("omp parallel if (tokens > 64)")                                                  \
        {                                                                                         \
            float *sq = malloc(hidden * sizeof(float));                                           \
            if (sq == NULL) {                                                                     \
                _Pragma("omp atomic write")                                                       \
                failed = 1;                                                                       \
            }                                                                                     \
            _Pragma("omp barrier")                                                                \
            if (!failed) {                                                                        \
                _Pragma("omp for")                                                                \
                for (int64_t t = 0; t < tokens; t++) {                                            \
                    const T *xr = x + t * hidden;                                                 \
                    const T *sr = xr;                                                             \
                    if (residual != NULL) {                                                       \
                        const T *rr = residual + t * hidden;                                      \
                        T *s = sum + t * hidden;                                                  \
                        for (int64_t i = 0; i < hidden; i++) {                                    \
                            s[i] = STORE(LOAD(xr[i]) + LOAD(rr[i]));                              \
                            const float v = LOAD(s[i]);                                           \
                            sq[i] = v * v;                                                        \
                        }                                                                         \
                        sr = s;                                                                   \
                    } else {                                                                      \
                        for (int64_t i = 0; i < hidden; i++) {                                    \
                            const float v = LOAD(xr[i]);                                          \
                            sq[i] = v * v;                                                        \
                        }                                                                         \
                    }                                                                             \
                    const float variance = torch_order_sum(sq, hidden, lanes) / (float)hidden;    \
                    const float scale = 1.0f / sqrtf(variance + eps);                             \
                    T *o = out + t * hidden;                                                      \
                    for (int64_t i = 0; i < hidden; i++)                                          \
                        o[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(sr[i]) * scale));               \
                }                                                                                 \
            }                                                                                     \
            free(sq);                                                                             \
        }                                                                                         \
        return failed;                                                                            \
    }

DEFINE_RMS_NORM(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_RMS_NORM(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)

DEFINE_LAYER_OPS(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_LAYER_OPS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)

/* Per row of `n` >= 1 floats (rows `stride` apart), the index of the first largest value, a NaN
 * counting as larger than any number (the first NaN): what torch's max(-1).indices returns, which
 * on CPU is a scalar loop (~40 us per 49,152-float row, against ~3 us here). Two passes: the
 * largest value, then the first element equal to it (-0.0 == 0.0, as torch's comparisons have it). */
static int64_t argmax_row(const float *row, int64_t n) {
    int64_t i = 0;
    float best = row[0];
    int any_nan = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 vbest = _mm512_loadu_ps(row);
        __mmask16 nan = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vbest = _mm512_max_ps(vbest, v);
        }
        any_nan = nan != 0;
        best = _mm512_reduce_max_ps(vbest);
    }
#endif
    for (; i < n; i++) {
        any_nan |= row[i] != row[i];
        best = row[i] > best ? row[i] : best;
    }
    i = 0;
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        const __mmask16 hit = any_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                      : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (any_nan ? row[i] != row[i] : row[i] == best) return i;
    return 0; /* not reached: some element equals the largest */
}

void argmax_rows_f32(const float *x, int64_t *out, int64_t rows, int64_t n, int64_t stride) {
    _Pragma("omp parallel for if (rows >= 8)")
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
}

int kvpilot_openmp_threads(void) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Sets the calling thread's OpenMP team size for the parallel regions it starts next (torch's
 * included: they share this runtime) and returns the one it replaces. Without OpenMP it changes
 * nothing and returns 1. */
int kvpilot_set_openmp_threads(int threads) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    extern void omp_set_num_threads(int);
    int previous = omp_get_max_threads();
    omp_set_num_threads(threads);
    return previous;
#else
    (void)threads;
    return 1;
#endif
}

/* ---- The MLP's dense path ---------------------------------------------------------------- */

/* SiLU-and-multiply over the merged gate_up projection: gate_up [tokens, 2 * inter] (row stride
 * `stride` elements, gate first), out [tokens, inter] contiguous:
 *   out = T(T(silu(gate)) * up), silu(g) = g / (1 + exp(-g)),
 * rounded where kvpilot.engine.model.layers.silu_and_mul rounds (F.silu's result, then the
 * product), with exp_wide in place of torch's vectorized exp: a float32 result may differ from
 * torch's in the last bits, a bfloat16 one only where that lands on a rounding boundary.
 * The AVX-512 loop computes exp_wide's very operations (no fused multiply-adds), so the vector
 * body and the scalar tail agree bit for bit. */

/* exp_approx's polynomial over [-87, 89], overflowing to +inf past 88.72 as expf does: a gate
 * below -88.72 then gives silu = -0, as torch's does (clamping at 88 would leave ~1e-37). The
 * scale is applied as 2^(n-1) * 2 so that n = 128 still has an exponent field. */
static inline float exp_wide(float x) { return exp_scaled(x, 89.0f, 126) * 2.0f; }

#if defined(__AVX512F__)
static inline __m512 exp_wide16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(89.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187045e-06f)));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    const __m512i bits =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23);
    return _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(bits)), _mm512_set1_ps(2.0f));
}

/* f32_to_bf16 on 16 lanes: each result in the low half of a 32-bit lane. */
static inline __m512i to_bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

static inline __m512 silu16(__m512 x) {
    const __m512 e = exp_wide16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline int64_t silu_and_mul_vec_f32(const float *g, const float *u, float *o, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
    return i;
}

static inline int64_t silu_and_mul_vec_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o,
                                            int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 silu = _mm512_castsi512_ps(
            _mm512_slli_epi32(to_bf16_bits16(silu16(load16_bf16(g + i))), 16));
        const __m512 prod = _mm512_mul_ps(silu, load16_bf16(u + i));
        _mm256_storeu_si256((__m256i *)(o + i), _mm512_cvtepi32_epi16(to_bf16_bits16(prod)));
    }
    return i;
}
#else
#define silu_and_mul_vec_f32(g, u, o, n) ((int64_t)0)
#define silu_and_mul_vec_bf16(g, u, o, n) ((int64_t)0)
#endif

#define DEFINE_SILU_AND_MUL(SUFFIX, T, LOAD, STORE, ROUND)                                        \
    void silu_and_mul_##SUFFIX(const T *gate_up, T *out, int64_t tokens, int64_t inter,           \
                               int64_t stride) {                                                  \
        _Pragma("omp parallel for if (tokens * inter > 32768)")                                   \
        for (int64_t t = 0; t < tokens; t++) {                                                    \
            const T *g = gate_up + t * stride, *u = g + inter;                                    \
            T *o = out + t * inter;                                                               \
            for (int64_t i = silu_and_mul_vec_##SUFFIX(g, u, o, inter); i < inter; i++) {         \
                const float x = LOAD(g[i]);                                                       \
                const float silu = ROUND(x / (1.0f + exp_wide(-x)));                              \
                o[i] = STORE(silu * LOAD(u[i]));                                                  \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_SILU_AND_MUL(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_SILU_AND_MUL(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)
