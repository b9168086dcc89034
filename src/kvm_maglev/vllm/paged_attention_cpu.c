/* One query per request attending, in one softmax, over segments of keys and values that lie in an engine's pages
 * (KVM: its state and its window ring; Maglev: its ring and the set-aside key), each request's page read where it
 * lies and only as far as the request reads it; and KVM's decoding token shift over the carries in those pages.
 * Built and called by paged_attention_cpu.py, whose docstring says why; the torch paths it equals are the reference
 * (tests/models/kvm/test_paged_attention_cpu.py). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUPS 64

/* exp(x) for x <= 0 (a logit less its row's maximum; 0 below -87, where a masked slot's -inf lands), to about 2 ulp:
 * x = n ln 2 + r with |r| <= ln 2 / 2, a degree-6 polynomial for exp(r), n added to the exponent bits. Plain
 * arithmetic, so that the compiler vectorises the loop calling it (libm's expf is a call per element). */
static inline float exp_nonpositive(float x) {
    float clamped = x < -87.f ? -87.f : x;
    float n = __builtin_floorf(clamped * 1.44269504088896341f + 0.5f);
    float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return x < -87.f ? 0.f : p;
}

/* One segment of keys and values: page tensors [pages, kv heads, slots, dim] with any strides but a contiguous last
 * dimension (strides in elements), each request's page and how many leading slots it reads, which of them it sees
 * (NULL: all), and each query head's factor on its logits (softmax scale times the segment's temperature). */
typedef struct {
    const void *keys, *values;
    int64_t pages, slots;
    int64_t key_strides[3], value_strides[3];
    const int64_t *page, *length;
    const uint8_t *visible;
    int64_t visible_stride;
    const float *head_scale;
} segment_t;

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* The same two passes for float32 and bfloat16 pages: logits of every read slot for the `groups` query heads that
 * share kv head `head` (each key row read once for all of them), one softmax per query head, then the values'
 * weighted sum. `logits` holds groups rows of `max_read` floats. */
#define DEFINE_ATTEND_HEAD(NAME, T, LOAD)                                                                              \
    static void NAME(const float *q, int64_t row, int64_t head, int64_t groups, int64_t dim, int64_t value_dim,        \
                     const segment_t *segments, int64_t count, int64_t max_read, float *logits, float *out) {          \
        float top[MAX_GROUPS], total[MAX_GROUPS];                                                                      \
        for (int64_t g = 0; g < groups; g++) top[g] = -INFINITY, total[g] = 0.f;                                       \
        int64_t read = 0;                                                                                              \
        for (int64_t s = 0; s < count; s++) {                                                                          \
            const segment_t *seg = &segments[s];                                                                       \
            const T *keys = (const T *)seg->keys + seg->page[row] * seg->key_strides[0] + head * seg->key_strides[1];  \
            for (int64_t j = 0; j < seg->length[row]; j++, read++) {                                                   \
                float *slot = logits + read;                                                                           \
                if (seg->visible && !seg->visible[row * seg->visible_stride + j]) {                                    \
                    for (int64_t g = 0; g < groups; g++) slot[g * max_read] = -INFINITY;                               \
                    continue;                                                                                          \
                }                                                                                                      \
                const T *key = keys + j * seg->key_strides[2];                                                         \
                for (int64_t g = 0; g < groups; g++) {                                                                 \
                    const float *query = q + g * dim;                                                                  \
                    float dot = 0.f;                                                                                   \
                    for (int64_t d = 0; d < dim; d++) dot += query[d] * LOAD(key[d]);                                  \
                    float logit = dot * seg->head_scale[head * groups + g];                                            \
                    slot[g * max_read] = logit;                                                                        \
                    if (logit > top[g]) top[g] = logit;                                                                \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t g = 0; g < groups; g++) {                                                                         \
            float *row = logits + g * max_read, sum = 0.f;                                                             \
            for (int64_t j = 0; j < read; j++) {                                                                       \
                row[j] = exp_nonpositive(row[j] - top[g]);                                                             \
                sum += row[j];                                                                                         \
            }                                                                                                          \
            total[g] = sum;                                                                                            \
        }                                                                                                              \
        memset(out, 0, sizeof(float) * groups * value_dim);                                                            \
        read = 0;                                                                                                      \
        for (int64_t s = 0; s < count; s++) {                                                                          \
            const segment_t *seg = &segments[s];                                                                       \
            const T *values = (const T *)seg->values + seg->page[row] * seg->value_strides[0]                          \
                              + head * seg->value_strides[1];                                                          \
            for (int64_t j = 0; j < seg->length[row]; j++, read++) {                                                   \
                const T *value = values + j * seg->value_strides[2];                                                   \
                for (int64_t g = 0; g < groups; g++) {                                                                 \
                    float weight = logits[g * max_read + read];                                                        \
                    if (weight == 0.f) continue;                                                                       \
                    float *o = out + g * value_dim;                                                                    \
                    for (int64_t d = 0; d < value_dim; d++) o[d] += weight * LOAD(value[d]);                           \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        for (int64_t g = 0; g < groups; g++)                                                                           \
            for (int64_t d = 0; d < value_dim; d++) out[g * value_dim + d] /= total[g];                                \
    }

#define AS_FLOAT(x) (x)
DEFINE_ATTEND_HEAD(attend_head_float32, float, AS_FLOAT)
DEFINE_ATTEND_HEAD(attend_head_bfloat16, uint16_t, bf16_to_float)

/* q [batch, heads, dim] float32, already in the heads' order (query head h under kv head h / groups); out [batch,
 * heads, value_dim] float32. `bfloat16`: the pages' element type (else float32); `max_read`: the most slots any
 * request reads over all segments; `threads` > 1 splits the (request, kv head) pairs over OpenMP threads where
 * built with it. Returns 0, or 1 for too many query heads per kv head, 2 when scratch memory is refused, 3 when a
 * request's page or read slots lie outside its segment's tensors (checked before anything is read). */
int attend_segments(const float *q, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                    int bfloat16, const segment_t *segments, int64_t count, int64_t max_read, int threads,
                    float *out) {
    int64_t groups = heads / kv_heads;
    if (groups > MAX_GROUPS) return 1;
    for (int64_t s = 0; s < count; s++)
        for (int64_t row = 0; row < batch; row++) {
            int64_t page = segments[s].page[row], length = segments[s].length[row];
            if (page < 0 || page >= segments[s].pages || length < 0 || length > segments[s].slots) return 3;
        }
    max_read = max_read > 0 ? max_read : 1;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
        float *logits = malloc(sizeof(float) * groups * max_read);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t pair = 0; pair < batch * kv_heads; pair++) {
            if (!logits) {  /* every thread reaches the loop (its barrier), one without scratch only reports */
                failed = 2;
                continue;
            }
            int64_t row = pair / kv_heads, head = pair % kv_heads;
            const float *query = q + (row * heads + head * groups) * dim;
            float *o = out + (row * heads + head * groups) * value_dim;
            if (bfloat16)
                attend_head_bfloat16(query, row, head, groups, dim, value_dim, segments, count, max_read, logits, o);
            else
                attend_head_float32(query, row, head, groups, dim, value_dim, segments, count, max_read, logits, o);
        }
        free(logits);
    }
    (void)threads;
    return failed;
}

/* A step's token shift of one layer's streams over every request's tokens (float32 rows of `width`, strides in
 * elements): request r's `count[r]` tokens lie at rows offset[r].. of x; a token's predecessor is the token before
 * it, or for the request's first token its carry (carry[page[r]], when it has read `start[r]` > 0 tokens before),
 * else itself (`first_reads_itself`) or zero. out = x + mix * (predecessor - x), the product and the sum rounded
 * apart, as torch's two operations round them (no fused multiply-add); then each request's last token into its
 * carry, and out's rows after the last token up to `out_rows` zeroed (the engine's padding). Returns 0, or 3 when a
 * page lies outside the carries (checked before anything is written). */
#if defined(__clang__)
#define SEPARATE_ROUNDING _Pragma("clang fp contract(off) reassociate(off)")
#define SEPARATE_ROUNDING_ATTRIBUTE
#elif defined(__GNUC__)
#define SEPARATE_ROUNDING
#define SEPARATE_ROUNDING_ATTRIBUTE __attribute__((optimize("fp-contract=off", "no-associative-math")))
#else
#define SEPARATE_ROUNDING
#define SEPARATE_ROUNDING_ATTRIBUTE
#endif
SEPARATE_ROUNDING_ATTRIBUTE
int shift_tokens(const float *x, int64_t x_stride, const float *mix, float *carry, int64_t carry_pages,
                 int64_t carry_stride, const int64_t *page, const int64_t *offset, const int64_t *count,
                 const int64_t *start, int64_t requests, int first_reads_itself, int64_t width, float *out,
                 int64_t out_stride, int64_t out_rows) {
    SEPARATE_ROUNDING
    int64_t tokens = 0;
    for (int64_t r = 0; r < requests; r++) {
        if (page[r] < 0 || page[r] >= carry_pages) return 3;
        if (offset[r] + count[r] > tokens) tokens = offset[r] + count[r];
    }
    for (int64_t r = 0; r < requests; r++) {
        if (count[r] <= 0) continue;
        float *own_carry = carry + page[r] * carry_stride;
        for (int64_t t = 0; t < count[r]; t++) {
            const float *token = x + (offset[r] + t) * x_stride;
            const float *previous = t > 0 ? token - x_stride : start[r] > 0 ? own_carry : first_reads_itself ? token : NULL;
            float *o = out + (offset[r] + t) * out_stride;
            for (int64_t d = 0; d < width; d++) {
                float step = mix[d] * ((previous ? previous[d] : 0.f) - token[d]);
                o[d] = token[d] + step;
            }
        }
        memcpy(own_carry, x + (offset[r] + count[r] - 1) * x_stride, sizeof(float) * width);
    }
    for (int64_t t = tokens; t < out_rows; t++) memset(out + t * out_stride, 0, sizeof(float) * width);
    return 0;
}
