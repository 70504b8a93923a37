/* kvpilot's CPU kernels, built at run time by kvpilot.engine.cpu.build with the host's C compiler
 * and called through ctypes:
 * - paged decode attention: one query token per sequence, read straight from the paged KV cache
 *   (no gather into a contiguous copy), with an online softmax over chunks of the context;
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
 * Limits checked by the caller: group <= 16, head_dim <= 256 and a multiple of 16,
 * block_size <= 256.
 */
#include <math.h>
#include <stdint.h>
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

/* exp(x) within ~2 ulp for x in [-87, 88] (clamped outside): 2^n * p(r), written so the compiler
 * vectorizes it (libm's expf is a scalar call per element, which would dominate these loops). */
static inline float exp_approx(float x) {
    if (x < -87.0f) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

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

#define DEFINE_BLOCK_OPS(SUFFIX, T, LOAD16)                                                       \
    static inline __attribute__((always_inline)) void scores_impl_##SUFFIX(                      \
        const float (*q)[MAX_HEAD_DIM], const T *kb, int64_t ss, int64_t n, int64_t group,         \
        int64_t D, float (*p)[MAX_CHUNK], int64_t t0) {                                           \
        __m512 row[MAX_HEAD_DIM / 16];                                                            \
        for (int64_t t = 0; t < n; t++) {                                                         \
            for (int64_t c = 0; c < D / 16; c++) row[c] = LOAD16(kb + t * ss + 16 * c);           \
            for (int64_t j = 0; j < group; j++) {                                                 \
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q[j]), row[0]);                        \
                for (int64_t c = 1; c < D / 16; c++)                                              \
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(q[j] + 16 * c), row[c], acc);           \
                p[j][t0 + t] = _mm512_reduce_add_ps(acc);                                         \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    static inline __attribute__((always_inline)) void accumulate_impl_##SUFFIX(                  \
        float (*acc)[MAX_HEAD_DIM], const T *vb, int64_t ss, int64_t n, int64_t group, int64_t D,  \
        const float (*p)[MAX_CHUNK], int64_t t0) {                                                \
        for (int64_t c = 0; c < D / 16; c++) {                                                    \
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
#endif

#define DEFINE_DECODE(NAME, SUFFIX, T, LOAD, STORE)                                               \
    void NAME(const T *query, const T *k_cache, const T *v_cache, const int32_t *block_tables,    \
              const int32_t *seq_lens, T *out, int64_t num_seqs, int64_t num_heads,               \
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t table_stride,   \
              int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss, int64_t v_sh, \
              float scale) {                                                                      \
        const int64_t group = num_heads / num_kv_heads;                                           \
        const int64_t D = head_dim;                                                               \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
        for (int64_t unit = 0; unit < num_seqs * num_kv_heads; unit++) {                          \
            const int64_t s = unit / num_kv_heads, kvh = unit % num_kv_heads;                     \
            const int64_t len = seq_lens[s];                                                      \
            const int32_t *table = block_tables + s * table_stride;                               \
            float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                       \
            float p[MAX_GROUP][MAX_CHUNK];                                                        \
            float m[MAX_GROUP], l[MAX_GROUP];                                                     \
            for (int64_t j = 0; j < group; j++) {                                                 \
                const T *qr = query + (s * num_heads + kvh * group + j) * D;                      \
                for (int64_t d = 0; d < D; d++) {                                                 \
                    q[j][d] = LOAD(qr[d]) * scale;                                                \
                    acc[j][d] = 0.0f;                                                             \
                }                                                                                 \
                m[j] = 0.0f;                                                                      \
                l[j] = 0.0f;                                                                      \
            }                                                                                     \
            const int64_t chunk = (MAX_CHUNK / block_size) * block_size;                          \
            for (int64_t start = 0; start < len; start += chunk) {                                \
                const int64_t n = len - start < chunk ? len - start : chunk;                      \
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {                                  \
                    const int64_t block = table[(start + t0) / block_size];                       \
                    const int64_t bn = n - t0 < block_size ? n - t0 : block_size;                 \
                    scores_##SUFFIX(q, k_cache + block * k_sb + kvh * k_sh, k_ss, bn, group, D, p, \
                                    t0);                                                          \
                }                                                                                 \
                for (int64_t j = 0; j < group; j++) {                                             \
                    float chunk_max = p[j][0];                                                    \
                    _Pragma("omp simd reduction(max : chunk_max)")                                \
                    for (int64_t t = 1; t < n; t++)                                              \
                        chunk_max = p[j][t] > chunk_max ? p[j][t] : chunk_max;                    \
                    const float new_max = start == 0 || chunk_max > m[j] ? chunk_max : m[j];      \
                    const float rescale = start == 0 ? 0.0f : exp_approx(m[j] - new_max);         \
                    float sum = 0.0f;                                                             \
                    _Pragma("omp simd reduction(+ : sum)")                                        \
                    for (int64_t t = 0; t < n; t++) {                                             \
                        p[j][t] = exp_approx(p[j][t] - new_max);                                  \
                        sum += p[j][t];                                                           \
                    }                                                                             \
                    l[j] = l[j] * rescale + sum;                                                  \
                    m[j] = new_max;                                                               \
                    for (int64_t d = 0; d < D; d++) acc[j][d] *= rescale;                         \
                }                                                                                 \
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {                                  \
                    const int64_t block = table[(start + t0) / block_size];                       \
                    const int64_t bn = n - t0 < block_size ? n - t0 : block_size;                 \
                    accumulate_##SUFFIX(acc, v_cache + block * v_sb + kvh * v_sh, v_ss, bn, group, \
                                        D, p, t0);                                                \
                }                                                                                 \
            }                                                                                     \
            for (int64_t j = 0; j < group; j++) {                                                 \
                T *o = out + (s * num_heads + kvh * group + j) * D;                               \
                const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f; /* len 0: zeros */            \
                for (int64_t d = 0; d < D; d++) o[d] = STORE(acc[j][d] * inv);                    \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_DECODE(paged_decode_f32, f32, float, LOAD_F32, STORE_F32)
DEFINE_DECODE(paged_decode_bf16, bf16, uint16_t, bf16_to_f32, f32_to_bf16)

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

/* RMSNorm in two passes around torch's own mean of the squares (its summation order is torch's
 * business; a sum in another order changes the variance in the last bit). Together with that mean
 * they compute exactly what kvpilot.engine.model.layers.rms_norm computes:
 *   prepare: sum = x + residual (rounded to T, the next residual), squares = float(sum)^2;
 *   apply:   out = weight * T(float(sum) * (1 / sqrt(variance + eps))).
 * Every tensor is contiguous: element (t, i) at t * hidden + i. */
#define DEFINE_RMS_NORM(SUFFIX, T, LOAD, STORE, ROUND)                                            \
    void rms_norm_prepare_##SUFFIX(const T *x, const T *residual, T *sum, float *squares,          \
                                   int64_t tokens, int64_t hidden) {                               \
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
    }

DEFINE_RMS_NORM(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_RMS_NORM(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)

DEFINE_LAYER_OPS(f32, float, LOAD_F32, STORE_F32, ROUND_F32)
DEFINE_LAYER_OPS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, ROUND_BF16)

int kvpilot_openmp_threads(void) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* ---- The MLP's dense path (issue 12) ------------------------------------------------------- */

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
static inline float exp_wide(float x) {
    if (x < -87.0f) x = -87.0f;
    if (x > 89.0f) x = 89.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 126) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * 2.0f;
}

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
