/*
 * Decode attention that reads the paged KV cache in place (CPU; fp32 queries, fp32 or fp8 cache).
 *
 * One query token per request. A work item is one request and a range of its KV heads (all of
 * them unless there are fewer requests than threads). An item walks the request's blocks once: per
 * block it scores the block's keys for every query head of the item, folds them into a running
 * softmax (max, sum, rescaled accumulator), then adds the block's values. A block's K (and V) rows
 * for all heads are contiguous, so each block is one sequential read, and each key/value row is
 * loaded once for all the query heads that share it (grouped-query attention).
 *
 * OpenMP splits the items over threads; when this library is loaded into a process that already
 * holds torch, libgomp resolves to torch's copy, so this shares torch's thread pool.
 *
 * Layouts (all contiguous):
 *   q, out       [num_reqs, num_heads, head_dim]
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim] float32, or bytes (fp8)
 *   block_table  [num_reqs, block_table_stride] int64
 *   seq_lens     [num_reqs] int64: keys key_start..seq_len-1 of each request are attended
 *   key_starts   [num_reqs] int64 first key (a sliding window's start), or NULL for 0; the blocks
 *                before a request's first key are not read
 *   sinks        [num_heads] float32 attention sinks (GPT-OSS), or NULL: each head's softmax has one
 *                more logit, its sink, whose value row is zero (it only takes probability away)
 *   alibi_slopes [num_heads] float32 ALiBi slopes (BLOOM, MPT, falcon-rw), or NULL: head h's score of
 *                the key at position p gains slope[h] * (p - (seq_len - 1)), its distance behind the
 *                query, after the scale
 * Returns 0, or a nonzero status for arguments it cannot handle.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LLMC_MAX_HEADS 256

enum { CACHE_F32 = 0, CACHE_FP8_E4M3 = 1, CACHE_FP8_E5M2 = 2 };

/* One finite fp8 byte as float, with integer ops only (so a row of them vectorizes): the exponent
 * and mantissa bits move into float's fields and the exponent is rebiased; subnormals (exponent 0)
 * are mantissa * 2^(1 - bias - mantissa bits). */
static inline float fp8_finite_to_float(uint8_t byte, int format) {
    const uint32_t magnitude = byte & 0x7Fu, sign = (uint32_t)(byte & 0x80u) << 24;
    const int e4m3 = format == CACHE_FP8_E4M3;
    const uint32_t mantissa_bits = e4m3 ? 3u : 2u;
    const uint32_t rebias = e4m3 ? (127u - 7u) : (127u - 15u);
    union { uint32_t u; float f; } normal = {.u = (magnitude << (23u - mantissa_bits)) + (rebias << 23)};
    const float subnormal = (float)(magnitude & ((1u << mantissa_bits) - 1u)) * (e4m3 ? 0x1p-9f : 0x1p-16f);
    union { float f; uint32_t u; } value = {.f = (magnitude >> mantissa_bits) == 0 ? subnormal : normal.f};
    value.u |= sign;
    return value.f;
}

/* The bytes fp8_finite_to_float does not read: e4m3fn's NaN (magnitude 0x7F), e5m2's inf and NaN
 * (exponent 31). The writer saturates finite values, so only an inf or NaN activation writes them. */
static inline int fp8_is_special(uint8_t byte, int format) {
    return format == CACHE_FP8_E4M3 ? (byte & 0x7Fu) == 0x7Fu : (byte & 0x7Cu) == 0x7Cu;
}

static inline float fp8_to_float(uint8_t byte, int format) {
    if (!fp8_is_special(byte, format)) return fp8_finite_to_float(byte, format);
    union { uint32_t u; float f; } value = {.u = (uint32_t)(byte & 0x80u) << 24};
    value.u |= format == CACHE_FP8_E5M2 && (byte & 0x3u) == 0 ? 0x7F800000u : 0x7FC00000u; /* inf, or NaN */
    return value.f;
}

/* format CACHE_F32: the caches hold float32. Otherwise they hold one byte per element (fp8): every
 * block is read once into float rows, then scored as float32 caches are. */
static inline __attribute__((always_inline)) int paged_decode_attention(
    const float *q, const void *k_cache, const void *v_cache, int format, const int64_t *block_table,
    int64_t block_table_stride, const int64_t *seq_lens, const int64_t *key_starts, float *out, int64_t num_reqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float softcap,
    const float *sinks, const float *alibi_slopes, int num_threads) {
    const int fp8 = format != CACHE_F32;
    const int64_t elem_size = fp8 ? 1 : (int64_t)sizeof(float);
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
    if (num_heads > LLMC_MAX_HEADS) return 2;
    for (int64_t r = 0; r < num_reqs; ++r) {
        if (seq_lens[r] <= 0) return 3;
        if (seq_lens[r] > block_table_stride * block_size) return 5; /* row too short for the sequence */
        if (key_starts != NULL && (key_starts[r] < 0 || key_starts[r] >= seq_lens[r])) return 6;
    }
    if (num_threads < 1) num_threads = 1;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim; /* between consecutive tokens */
    const int64_t block_stride = block_size * row_stride;
    /* Fewer requests than threads: give each KV head its own item so every thread has work. */
    const int64_t kv_per_item = num_reqs >= num_threads ? num_kv_heads : 1;
    const int64_t items_per_req = num_kv_heads / kv_per_item;
    const int64_t num_items = num_reqs * items_per_req;
    int status = 0;

#pragma omp parallel num_threads(num_threads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(block_size * num_heads));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(num_heads * head_dim));
        /* fp8: one block's K and V rows for an item's KV heads, as float */
        float *kbuf = fp8 ? (float *)malloc(sizeof(float) * (size_t)(block_size * row_stride)) : NULL;
        float *vbuf = fp8 ? (float *)malloc(sizeof(float) * (size_t)(block_size * row_stride)) : NULL;
        float run_max[LLMC_MAX_HEADS], run_sum[LLMC_MAX_HEADS];
        if (scores == NULL || acc == NULL || (fp8 && (kbuf == NULL || vbuf == NULL))) {
#pragma omp atomic write
            status = 4;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_items; ++item) {
                const int64_t r = item / items_per_req;
                const int64_t kv0 = (item % items_per_req) * kv_per_item;
                const int64_t h0 = kv0 * group, nh = kv_per_item * group;
                const int64_t len = seq_lens[r];
                const int64_t *blocks = block_table + r * block_table_stride;
                const float *qr = q + (r * num_heads + h0) * head_dim;
                memset(acc, 0, sizeof(float) * (size_t)(nh * head_dim));
                for (int64_t h = 0; h < nh; ++h) {
                    /* a sink is a first score of exp(0) = 1 at its own value, adding nothing to acc */
                    run_max[h] = sinks != NULL ? sinks[h0 + h] : -FLT_MAX;
                    run_sum[h] = sinks != NULL ? 1.f : 0.f;
                }
                const int64_t key_start = key_starts != NULL ? key_starts[r] : 0;
                const int64_t first_block = key_start / block_size;
                const int64_t num_blocks = (len + block_size - 1) / block_size;
                for (int64_t b = first_block; b < num_blocks; ++b) {
                    const int64_t n = b == num_blocks - 1 ? len - b * block_size : block_size;
                    /* the first block read may begin before the request's first key */
                    const int64_t t0 = b == first_block ? key_start - b * block_size : 0;
                    const int64_t first = (blocks[b] * block_stride + kv0 * head_dim) * elem_size;
                    const float *kb, *vb;
                    int64_t rs; /* between consecutive tokens' rows of kb/vb */
                    if (fp8) {
                        const uint8_t *kq = (const uint8_t *)k_cache + first, *vq = (const uint8_t *)v_cache + first;
                        const int64_t width = kv_per_item * head_dim;
                        int special = 0;
                        for (int64_t t = t0; t < n; ++t)
                            for (int64_t d = 0; d < width; ++d) {
                                const uint8_t kbyte = kq[t * row_stride + d], vbyte = vq[t * row_stride + d];
                                kbuf[t * width + d] = fp8_finite_to_float(kbyte, format);
                                vbuf[t * width + d] = fp8_finite_to_float(vbyte, format);
                                special |= fp8_is_special(kbyte, format) | fp8_is_special(vbyte, format);
                            }
                        if (special) /* an inf or NaN was stored: read it as such (off the vectorized path) */
                            for (int64_t t = t0; t < n; ++t)
                                for (int64_t d = 0; d < width; ++d) {
                                    kbuf[t * width + d] = fp8_to_float(kq[t * row_stride + d], format);
                                    vbuf[t * width + d] = fp8_to_float(vq[t * row_stride + d], format);
                                }
                        kb = kbuf;
                        vb = vbuf;
                        rs = width;
                    } else {
                        kb = (const float *)((const char *)k_cache + first);
                        vb = (const float *)((const char *)v_cache + first);
                        rs = row_stride;
                    }
                    if (b + 1 < num_blocks) {
                        /* blocks lie anywhere in the pool: ask for the next one's rows of this item's KV
                         * heads (only those: an item of one head of many would otherwise ask for the
                         * whole block, every other head's rows included) while this one is scored */
                        const int64_t next = (blocks[b + 1] * block_stride + kv0 * head_dim) * elem_size;
                        const int64_t width = kv_per_item * head_dim * elem_size;
                        for (int64_t t = 0; t < block_size; ++t) {
                            const int64_t row = next + t * row_stride * elem_size;
                            /* from the cache line the row starts in (rows need not start on one) */
                            const int64_t skew = (int64_t)(((uintptr_t)k_cache + (uintptr_t)row) & 63u);
                            const char *nk = (const char *)k_cache + row - skew;
                            const char *nv = (const char *)v_cache + row - skew;
                            for (int64_t off = 0; off < width + skew; off += 64) {
                                __builtin_prefetch(nk + off);
                                __builtin_prefetch(nv + off);
                            }
                        }
                    }
                    /* scores[h][t] = scale * <q_h, k_t> for the item's query heads */
                    for (int64_t t = t0; t < n; ++t) {
                        const float *kr = kb + t * rs;
                        for (int64_t h = 0; h < nh; ++h) {
                            const float *qh = qr + h * head_dim, *kh = kr + (h / group) * head_dim;
                            float dot = 0.f;
                            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
                            scores[h * block_size + t] = dot * scale;
                        }
                    }
                    if (alibi_slopes != NULL) {
                        /* ALiBi: the key at position b * block_size + t lies (len - 1) - that behind */
                        const float behind0 = (float)(b * block_size - (len - 1));
                        for (int64_t h = 0; h < nh; ++h) {
                            float *sh = scores + h * block_size;
                            const float slope = alibi_slopes[h0 + h];
                            for (int64_t t = t0; t < n; ++t) sh[t] += slope * (behind0 + (float)t);
                        }
                    }
                    if (softcap > 0.f) {
                        /* Gemma 2's soft cap, cap * tanh(score / cap), over each head's contiguous
                         * scores (a loop the compiler vectorises, tanhf included) */
                        const float inv_cap = 1.f / softcap;
                        for (int64_t h = 0; h < nh; ++h) {
                            float *sh = scores + h * block_size;
                            for (int64_t t = t0; t < n; ++t) sh[t] = softcap * tanhf(sh[t] * inv_cap);
                        }
                    }
                    /* running softmax: rescale what was accumulated when the max grows */
                    for (int64_t h = 0; h < nh; ++h) {
                        float *sh = scores + h * block_size;
                        float new_max = run_max[h];
                        for (int64_t t = t0; t < n; ++t) new_max = sh[t] > new_max ? sh[t] : new_max;
                        const float correction = expf(run_max[h] - new_max);
                        float sum = 0.f;
                        for (int64_t t = t0; t < n; ++t) {
                            sh[t] = expf(sh[t] - new_max);
                            sum += sh[t];
                        }
                        run_sum[h] = run_sum[h] * correction + sum;
                        run_max[h] = new_max;
                        if (correction != 1.f) {
                            float *ah = acc + h * head_dim;
                            for (int64_t d = 0; d < head_dim; ++d) ah[d] *= correction;
                        }
                    }
                    /* acc[h] += sum_t p[h][t] * v_t */
                    for (int64_t t = t0; t < n; ++t) {
                        const float *vr = vb + t * rs;
                        for (int64_t h = 0; h < nh; ++h) {
                            const float p = scores[h * block_size + t];
                            const float *vh = vr + (h / group) * head_dim;
                            float *ah = acc + h * head_dim;
                            for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * vh[d];
                        }
                    }
                }
                float *o = out + (r * num_heads + h0) * head_dim;
                for (int64_t h = 0; h < nh; ++h) {
                    const float inv = 1.f / run_sum[h];
                    for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = acc[h * head_dim + d] * inv;
                }
            }
        }
        free(scores);
        free(acc);
        free(kbuf);
        free(vbuf);
    }
    return status;
}

int llmc_paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                    const int64_t *block_table, int64_t block_table_stride,
                                    const int64_t *seq_lens, const int64_t *key_starts, float *out,
                                    int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, float scale, float softcap, const float *sinks,
                                    const float *alibi_slopes, int num_threads) {
    return paged_decode_attention(q, k_cache, v_cache, CACHE_F32, block_table, block_table_stride, seq_lens,
                                  key_starts, out, num_reqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                  softcap, sinks, alibi_slopes, num_threads);
}

/* e5m2: 0 for e4m3 (torch.float8_e4m3fn), 1 for e5m2 (torch.float8_e5m2). */
int llmc_paged_decode_attention_fp8(const float *q, const uint8_t *k_cache, const uint8_t *v_cache, int e5m2,
                                    const int64_t *block_table, int64_t block_table_stride,
                                    const int64_t *seq_lens, const int64_t *key_starts, float *out,
                                    int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                    int64_t block_size, float scale, float softcap, const float *sinks,
                                    const float *alibi_slopes, int num_threads) {
    if (e5m2)
        return paged_decode_attention(q, k_cache, v_cache, CACHE_FP8_E5M2, block_table, block_table_stride,
                                      seq_lens, key_starts, out, num_reqs, num_heads, num_kv_heads, head_dim,
                                      block_size, scale, softcap, sinks, alibi_slopes, num_threads);
    return paged_decode_attention(q, k_cache, v_cache, CACHE_FP8_E4M3, block_table, block_table_stride, seq_lens,
                                  key_starts, out, num_reqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                                  softcap, sinks, alibi_slopes, num_threads);
}

/* For tests: the value of one fp8 byte, as the kernel reads it. */
float llmc_fp8_to_float(uint8_t byte, int e5m2) { return fp8_to_float(byte, e5m2 ? CACHE_FP8_E5M2 : CACHE_FP8_E4M3); }
