// One random token per row of float32 logits at a temperature: the draw
// worker/sample/inverse_cdf.py makes from softmax(logits / temperature), without the softmax's
// [N, V] tensor and the dozen torch ops around it (on a 2-core AVX2 EPYC, torch took ~0.4 ms
// for one row of SmolLM2's 49,152 logits and ~5 ms for 64 rows; its exp alone ~2.3 ms).
//
// Per row: a pass for the largest logit, a pass weighing every token by
// exp((logit - largest) / temperature) and summing each chunk of CHUNK tokens in float32 (the
// chunks' masses accumulated in float64), the draw u * total picking the first chunk whose
// cumulative mass exceeds it, and that chunk's float32 running sum picking the token, as
// inverse_cdf.py does with the softmax's probabilities. A token of weight 0 (a logit of -inf,
// more than ~87 temperatures below the largest, or NaN) is never drawn: a draw that rounding
// pushes past a row's (or a chunk's) last positive weight takes that last positive weight; a row
// with none gives token 0. Sums run in a fixed order, so every build gives the same token.
// Built by kernels/cpu/kernel_loader.py with the library's other sources.

#include <math.h>
#include <stdint.h>

#include "scalar_math.h"

#define CHUNK 256
#define LANES 8

// exp((x - largest) * inverse_t), 0 where that is below float32's normal range or NaN.
static inline float token_weight(float x, float largest, float inverse_t) {
    const float z = (x - largest) * inverse_t;
    return z >= -87.0f ? exp_nonpositive(z) : 0.0f;
}

// a if it is larger than b, else b (NaN in a ignored): a select the loops vectorize, where
// fmaxf is a library call.
static inline float larger(float a, float b) { return a > b ? a : b; }

// The largest of `count` logits (-inf if none is larger; NaN ignored).
static float largest_logit(const float* x, int64_t count) {
    float lanes[LANES];
    for (int j = 0; j < LANES; ++j) lanes[j] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES)
        for (int j = 0; j < LANES; ++j) lanes[j] = larger(x[i + j], lanes[j]);
    float largest = -INFINITY;
    for (int j = 0; j < LANES; ++j) largest = larger(lanes[j], largest);
    for (; i < count; ++i) largest = larger(x[i], largest);
    return largest;
}

// The weights of tokens [first, first + count) into `weights`; returns their float32 sum,
// added in LANES partial sums and then pairwise (an order every build keeps).
static float chunk_weights(const float* x, int64_t count, float largest, float inverse_t,
                           float* weights) {
    for (int64_t i = 0; i < count; ++i) weights[i] = token_weight(x[i], largest, inverse_t);
    for (int64_t i = count; i < CHUNK; ++i) weights[i] = 0.0f;
    float lanes[LANES] = {0.0f};
    for (int64_t i = 0; i < CHUNK; i += LANES)
        for (int j = 0; j < LANES; ++j) lanes[j] += weights[i + j];
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// The token of one row of `vocab` logits for the draw `u` in [0, 1).
static int64_t sample_row(const float* x, int64_t vocab, float temperature, double u) {
    const float largest = largest_logit(x, vocab);
    if (!(largest > -INFINITY)) return 0;  // every logit -inf (or NaN): no positive weight
    const float inverse_t = 1.0f / temperature;
    const int64_t num_chunks = (vocab + CHUNK - 1) / CHUNK;
    float weights[CHUNK];
    double cdf[num_chunks];
    double total = 0.0;
    int64_t last_positive_chunk = -1;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t count = vocab - c * CHUNK < CHUNK ? vocab - c * CHUNK : CHUNK;
        const float mass = chunk_weights(x + c * CHUNK, count, largest, inverse_t, weights);
        total += (double)mass;
        cdf[c] = total;
        if (mass > 0.0f) last_positive_chunk = c;
    }
    if (last_positive_chunk < 0) return 0;
    const double target = u * total;
    int64_t chunk = 0;
    while (chunk < num_chunks && cdf[chunk] <= target) ++chunk;
    if (chunk > last_positive_chunk) chunk = last_positive_chunk;
    const float within = (float)(target - (chunk > 0 ? cdf[chunk - 1] : 0.0));
    const int64_t count = vocab - chunk * CHUNK < CHUNK ? vocab - chunk * CHUNK : CHUNK;
    chunk_weights(x + chunk * CHUNK, count, largest, inverse_t, weights);
    float running = 0.0f;
    int64_t found = -1, last_positive = 0;
    for (int64_t i = 0; i < count; ++i) {
        running += weights[i];
        if (weights[i] > 0.0f) last_positive = i;
        if (found < 0 && running > within) found = i;
    }
    if (found < 0 || found > last_positive) found = last_positive;
    return chunk * CHUNK + found;
}

// tokens[i] = the draw of row i of logits [num_rows, vocab] (rows `row_stride` floats apart)
// at temperatures[i] and uniforms[i] in [0, 1), rows shared by `num_threads`. Returns 0, or
// -1 + the first row whose temperature is not positive (nothing written then).
int64_t softmax_sample(const float* logits, int64_t row_stride, int64_t num_rows, int64_t vocab,
                       const float* temperatures, const double* uniforms, int64_t* tokens,
                       int32_t num_threads) {
    for (int64_t row = 0; row < num_rows; ++row)
        if (!(temperatures[row] > 0.0f)) return -1 - row;
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_threads > 1 && num_rows > 1)
    for (int64_t row = 0; row < num_rows; ++row)
        tokens[row] =
            sample_row(logits + row * row_stride, vocab, temperatures[row], uniforms[row]);
    return 0;
}
