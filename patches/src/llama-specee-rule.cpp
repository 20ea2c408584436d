// specee: the exit rule — what one check of one layer decides (see llama-specee-impl.h)
//
// specee_edge/predictor/rule.py is the same rule in Python (calibration, replay and the Python policy
// call it); tests/test_rule.py drives both with random inputs and requires identical decisions.

#include "llama-specee-impl.h"

#include <algorithm>
#include <cmath>

// out = b + sum_i in[i] * W[:, i], with W stored transposed ([in][out]): each input is one vectorizable
// axpy over the outputs, and the zeros ReLU leaves are skipped (~10x faster than row-by-row dots)
float llama_specee_mlp::prob(const float * x, std::vector<float> & scratch) const {
    const size_t n_dense = dims.size() - 1;
    const int32_t widest = *std::max_element(dims.begin(), dims.end());
    scratch.resize(2*(size_t) widest);
    float * in  = scratch.data();
    float * out = scratch.data() + widest;
    std::copy(x, x + dims[0], in);

    const float * w = params.data();
    for (size_t j = 0; j < n_dense; ++j) {
        const int32_t n_in  = dims[j];
        const int32_t n_out = dims[j + 1];
        const float * b = w + (size_t) n_out*n_in;
        std::copy(b, b + n_out, out);
        for (int32_t i = 0; i < n_in; ++i) {
            const float xi = in[i];
            if (xi == 0.0f) {
                continue;
            }
            const float * col = w + (size_t) i*n_out;
            for (int32_t o = 0; o < n_out; ++o) {
                out[o] += col[o]*xi;
            }
        }
        if (j + 1 < n_dense) {
            for (int32_t o = 0; o < n_out; ++o) {
                out[o] = std::max(out[o], 0.0f);
            }
        }
        w = b + n_out;
        std::swap(in, out);
    }
    return 1.0f/(1.0f + std::exp(-in[0]));
}

llama_specee_mlp llama_specee_mlp::from_rows(int32_t n_dense, const int32_t * dims, const float * params, int32_t n_in) {
    llama_specee_mlp mlp;
    if (n_dense < 1 || dims[0] != n_in || dims[n_dense] != 1) {
        return mlp;
    }
    size_t n_params = 0;
    for (int32_t j = 0; j < n_dense; ++j) {
        if (dims[j] < 1 || dims[j + 1] < 1) {
            return mlp;
        }
        n_params += (size_t) dims[j + 1]*dims[j] + dims[j + 1];
    }
    // weights transposed to [in][out] (see prob), biases as given
    mlp.dims.assign(dims, dims + n_dense + 1);
    mlp.params.resize(n_params);
    const float * src = params;
    float * dst = mlp.params.data();
    for (int32_t j = 0; j < n_dense; ++j) {
        const int32_t n_layer_in  = dims[j];
        const int32_t n_layer_out = dims[j + 1];
        for (int32_t o = 0; o < n_layer_out; ++o) {
            for (int32_t i = 0; i < n_layer_in; ++i) {
                dst[(size_t) i*n_layer_out + o] = src[(size_t) o*n_layer_in + i];
            }
        }
        const size_t n_weights = (size_t) n_layer_out*n_layer_in;
        std::copy(src + n_weights, src + n_weights + n_layer_out, dst + n_weights);
        src += n_weights + n_layer_out;
        dst += n_weights + n_layer_out;
    }
    return mlp;
}

llama_specee_rule::llama_specee_rule(int32_t n_cand) : n_cand(n_cand), features(3*n_cand) {}

llama_specee_outcome llama_specee_rule::check(const llama_specee_mlp & mlp, const llama_specee_exit & exit, const float * cand_logits) {
    float * z = features.data();
    float * p = z + n_cand;
    float * d = p + n_cand;
    std::copy(cand_logits, cand_logits + n_cand, z);
    const float z_max = *std::max_element(z, z + n_cand);
    float sum = 0.0f;
    for (int32_t i = 0; i < n_cand; ++i) {
        p[i] = std::exp(z[i] - z_max);
        sum += p[i];
    }
    for (int32_t i = 0; i < n_cand; ++i) {
        p[i] /= sum;
        d[i] = have_prev ? p[i] - prev_probs[i] : p[i];
        prev_probs[i] = p[i];
    }
    have_prev = true; // the next check of this token compares with this one, whatever it decides

    if (exit.kind == LLAMA_SPECEE_EXIT_NONE || !(mlp.prob(features.data(), scratch) > exit.threshold)) {
        return llama_specee_outcome::go_on;
    }
    return exit.kind == LLAMA_SPECEE_EXIT_HEAD_FREE ? llama_specee_outcome::stop_head_free : llama_specee_outcome::verify;
}

int32_t llama_specee_cand_argmax(const float * cand_logits, int32_t n_cand) {
    return (int32_t) (std::max_element(cand_logits, cand_logits + n_cand) - cand_logits);
}
