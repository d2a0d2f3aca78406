/*
 * Fused CPU kernels of a routed depth's gated combine (megatron_lol/backends/cpu/kernels.py builds
 * and loads this file; megatron_lol/backends/cpu/combine.py calls it).
 *
 * A routed depth runs block b on the rows order[lo_b:hi_b] of the flat states and writes
 *
 *     new[t] = s[t] + alpha[w] * (E_b(s)[r] - s[t]),   t = order[r], w = segments[r]
 *
 * With torch operations that is a subtraction, a multiplication, a copy of s and an index_add:
 * four passes over [T, h] forward, and about as many backward. On a CPU each pass costs about as
 * much as a small GEMM (the activations do not stay in cache), so both directions are one pass
 * here. The forward rounds exactly as those torch operations do (one rounding per subtraction,
 * multiplication and addition, in that order: compile without floating-point contraction, see
 * kernels.py), so values are bit for bit the torch path's. The backward's per-token gate gradient
 * is a dot product whose summation order differs from torch's sum (equal up to rounding).
 *
 * Layout: float32, rows of h contiguous floats. outs[b] holds counts[b] rows (block b's output,
 * in plan order). order is a permutation of 0..T-1 (every token is written once).
 */
#include <stdint.h>

void lol_gated_combine_forward(int64_t nblocks, const int64_t *counts, const float *const *outs,
                               const float *states, const int64_t *order, const int64_t *segments,
                               const float *window_gate, float *dst, int64_t h) {
    int64_t r = 0;
    for (int64_t b = 0; b < nblocks; ++b) {
        const float *out = outs[b];
        for (int64_t i = 0; i < counts[b]; ++i, ++r) {
            const float g = window_gate[segments[r]];
            const int64_t t = order[r];
            const float *s = states + t * h;
            const float *e = out + i * h;
            float *y = dst + t * h;
            for (int64_t j = 0; j < h; ++j) {
                const float update = e[j] - s[j];
                const float scaled = g * update;
                y[j] = s[j] + scaled;
            }
        }
    }
}

/*
 * grad: [T, h] gradient of new (flat order). Writes
 *   grad_outs[b][i] = alpha * grad[t]            (the block output's gradient)
 *   grad_states[t]  = grad[t] - alpha * grad[t]  (the direct path s + alpha (E - s) -> s)
 *   gate_token[r]   = sum_j grad[t][j] * (E[r][j] - s[t][j])
 * The block input's own gradient reaches states through the gather, outside this kernel.
 */
void lol_gated_combine_backward(int64_t nblocks, const int64_t *counts, const float *const *outs,
                                const float *states, const int64_t *order, const int64_t *segments,
                                const float *window_gate, const float *grad, float *const *grad_outs,
                                float *grad_states, float *gate_token, int64_t h) {
    int64_t r = 0;
    for (int64_t b = 0; b < nblocks; ++b) {
        const float *out = outs[b];
        float *grad_out = grad_outs[b];
        for (int64_t i = 0; i < counts[b]; ++i, ++r) {
            const float g = window_gate[segments[r]];
            const int64_t t = order[r];
            const float *s = states + t * h;
            const float *e = out + i * h;
            const float *gy = grad + t * h;
            float *ge = grad_out + i * h;
            float *gs = grad_states + t * h;
            /* eight independent partial sums: the compiler vectorises them without reassociating */
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            int64_t j = 0;
            for (; j + 8 <= h; j += 8) {
                for (int k = 0; k < 8; ++k) {
                    const float scaled = g * gy[j + k];
                    ge[j + k] = scaled;
                    gs[j + k] = gy[j + k] - scaled;
                    acc[k] += gy[j + k] * (e[j + k] - s[j + k]);
                }
            }
            for (; j < h; ++j) {
                const float scaled = g * gy[j];
                ge[j] = scaled;
                gs[j] = gy[j] - scaled;
                acc[0] += gy[j] * (e[j] - s[j]);
            }
            gate_token[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        }
    }
}
