// specee: the C API (include/llama-specee.h) over a context's early-exit state, and what early exit
// knows of each architecture

#include "llama-specee-impl.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>

// What early exit knows of each architecture it supports, in one place; specee_edge/archs.py holds the
// same table for Python and tests/test_archs.py checks that both agree. All of them end in
// final_norm (RMS) -> LM head, build K/V as attn_norm -> K/V projections (+ bias) -> the per-head K
// norm where a layer has one -> RoPE at the layer's frequency, and keep one unified cache or an iSWA
// pair (window layers in one, global layers in the other); what differs is listed here.
static const llama_specee_arch_entry SPECEE_ARCHS[] = {
    { "llama",  LLM_ARCH_LLAMA,  false },
    { "qwen2",  LLM_ARCH_QWEN2,  false },
    { "qwen3",  LLM_ARCH_QWEN3,  false },
    { "gemma3", LLM_ARCH_GEMMA3, true  }, // its input embeddings are scaled by sqrt(n_embd); the draft reads them unscaled
};

const llama_specee_arch_entry * llama_specee_arch_of(const llama_model & model) {
    for (const auto & a : SPECEE_ARCHS) {
        if (a.arch == model.arch) {
            return &a;
        }
    }
    return nullptr;
}

int32_t llama_specee_arch(int32_t i, const char ** name, int32_t * softcap) {
    if (i < 0 || i >= (int32_t) (sizeof(SPECEE_ARCHS)/sizeof(SPECEE_ARCHS[0]))) {
        return -1;
    }
    *name    = SPECEE_ARCHS[i].name;
    *softcap = SPECEE_ARCHS[i].softcap;
    return 0;
}

int32_t llama_specee_supported(const llama_model * model) {
    return llama_specee_arch_of(*model) && model->output && model->output_norm && !model->output_norm_b && !model->output_s ? 1 : 0;
}

const char * llama_specee_layer_device(const llama_model * model, int32_t il) {
    const int32_t n_layer = llama_model_n_layer(model);
    if (il < 0 || il > n_layer) {
        return nullptr;
    }
    return ggml_backend_dev_name(il == n_layer ? model->dev_output() : model->dev_layer(il));
}

int32_t llama_specee_enable(llama_context * ctx, int32_t n_cand, llama_specee_kv_mode kv_mode) {
    if (!llama_specee_supported(&ctx->get_model())) {
        LLAMA_LOG_ERROR("%s: early exit does not support the %s architecture\n", __func__, llm_arch_name(ctx->get_model().arch));
        return -1;
    }
    if (n_cand < 1 || n_cand > LLAMA_SPECEE_MAX_CAND || kv_mode < LLAMA_SPECEE_KV_MASK || kv_mode > LLAMA_SPECEE_KV_FILL) {
        return -2;
    }
    if (ctx->get_cparams().n_seq_max != 1 || llama_specee::caches_of(*ctx).empty()) {
        return -3;
    }
    if (kv_mode == LLAMA_SPECEE_KV_FILL && !llama_specee::can_fill(*ctx)) {
        return -4;
    }
    ctx->specee_enable(n_cand, kv_mode);
    return 0;
}

// the layers of `layers[0..n)` as a [n_layer] mask; false if one is out of range
static bool specee_layer_mask(const int32_t * layers, int32_t n, int32_t n_layer, std::vector<uint8_t> & mask) {
    if (n < 0 || std::any_of(layers, layers + n, [n_layer](int32_t il) { return il < 0 || il >= n_layer; })) {
        return false;
    }
    std::fill(mask.begin(), mask.end(), 0);
    for (int32_t i = 0; i < n; ++i) {
        mask[layers[i]] = 1;
    }
    return true;
}

int32_t llama_specee_set_probe_layers(llama_context * ctx, const int32_t * layers, int32_t n) {
    auto * sp = ctx->get_specee();
    return sp && specee_layer_mask(layers, n, sp->n_layer, sp->probe_active) ? 0 : -1;
}

int32_t llama_specee_set_capture_layers(llama_context * ctx, const int32_t * layers, int32_t n) {
    auto * sp = ctx->get_specee();
    return sp && specee_layer_mask(layers, n, sp->n_layer, sp->capture_active) ? 0 : -1;
}

int32_t llama_specee_set_candidates(llama_context * ctx, const llama_token * ids, int32_t n) {
    auto * sp = ctx->get_specee();
    if (!sp || n != sp->n_cand || std::any_of(ids, ids + n, [sp](llama_token id) { return id < 0 || id >= sp->n_vocab; })) {
        return -1;
    }
    std::copy(ids, ids + n, sp->cand.begin());
    return 0;
}

void llama_specee_set_callback(llama_context * ctx, llama_specee_probe_callback cb, void * user_data) {
    auto * sp = ctx->get_specee();
    if (sp) {
        sp->cb           = cb;
        sp->cb_user_data = user_data;
    }
}

const float * llama_specee_probe_logits(llama_context * ctx) {
    auto * sp = ctx->get_specee();
    return sp ? sp->probe_logits() : nullptr;
}

const float * llama_specee_exit_head_logits(llama_context * ctx) {
    auto * sp = ctx->get_specee();
    return sp ? sp->exit_head_logits() : nullptr;
}

int32_t llama_specee_set_draft(llama_context * ctx, int32_t type, int32_t n_draft_vocab,
        const float * w_embd, const float * w_hidden, const float * bias, const float * norm, float eps,
        const float * head, const int32_t * vocab_map) {
    auto * sp = ctx->get_specee();
    return sp ? sp->set_draft((ggml_type) type, n_draft_vocab, w_embd, w_hidden, bias, norm, eps, head, vocab_map) : -1;
}

size_t llama_specee_lm_rows_size(const llama_context * ctx, int32_t * type) {
    const auto * sp = ctx->get_specee();
    if (!sp || !sp->needs_lm_rows()) {
        return 0;
    }
    *type = ctx->get_model().output->type;
    return ggml_nbytes(ctx->get_model().output);
}

int32_t llama_specee_set_lm_rows(llama_context * ctx, int32_t type, const void * data, size_t size) {
    auto * sp = ctx->get_specee();
    return sp ? sp->set_lm_rows((ggml_type) type, data, size) : -1;
}

int32_t llama_specee_set_lookup(llama_context * ctx, const llama_token * ids, int32_t n) {
    auto * sp = ctx->get_specee();
    return sp ? sp->set_lookup(ids, n) : -1;
}

int32_t llama_specee_set_predictor(llama_context * ctx, int32_t il, int32_t n_dense, const int32_t * dims, const float * params) {
    auto * sp = ctx->get_specee();
    return sp ? sp->set_predictor(il, n_dense, dims, params) : -1;
}

int32_t llama_specee_set_exit(llama_context * ctx, int32_t il, llama_specee_exit_kind kind, float threshold) {
    auto * sp = ctx->get_specee();
    return sp ? sp->set_exit(il, kind, threshold) : -1;
}

float llama_specee_predictor_prob(llama_context * ctx, int32_t il, const float * features) {
    auto * sp = ctx->get_specee();
    if (!sp || il < 0 || il >= sp->n_layer || sp->predictors[il].empty()) {
        return -1.0f;
    }
    std::vector<float> scratch;
    return sp->predictors[il].prob(features, scratch);
}

int32_t llama_specee_decide(llama_context * ctx, int32_t n, const int32_t * layers, const float * cand_logits,
        const uint8_t * verified, llama_specee_decision * out) {
    auto * sp = ctx->get_specee();
    if (!sp || n < 0 || (n > 0 && (!layers || !cand_logits || !verified)) || !out) {
        return -1;
    }
    if (std::any_of(layers, layers + n, [sp](int32_t il) { return il < 0 || il >= sp->n_layer; })) {
        return -1;
    }
    sp->decide(n, layers, cand_logits, verified, *out);
    return 0;
}

void llama_specee_set_timing(llama_context * ctx, bool on) {
    auto * sp = ctx->get_specee();
    if (sp) {
        sp->timing = on;
    }
}

int32_t llama_specee_get_token_info(llama_context * ctx, llama_specee_token_info * info) {
    auto * sp = ctx->get_specee();
    if (!sp) {
        return -1;
    }
    sp->fill_token_info(*info);
    return 0;
}

int32_t llama_specee_exit_layer(const llama_context * ctx) {
    const auto * sp = ctx->get_specee();
    return sp ? sp->exit_layer : -1;
}

int32_t llama_specee_resume(llama_context * ctx) {
    auto * sp = ctx->get_specee();
    return sp ? sp->resume(false) : 1;
}

int32_t llama_specee_draft_from_row(llama_context * ctx, int32_t row) {
    auto * sp = ctx->get_specee();
    return sp ? sp->draft_from_row(row) : -1;
}

void llama_specee_forget(llama_context * ctx) {
    auto * sp = ctx->get_specee();
    if (sp) {
        sp->forget();
    }
}

const float * llama_specee_get_capture(const llama_context * ctx, int32_t il, int32_t * n_rows) {
    const auto * sp = ctx->get_specee();
    if (!sp || il < 0 || il >= sp->n_layer || sp->capture_rows[il] == 0) {
        *n_rows = 0;
        return nullptr;
    }
    *n_rows = sp->capture_rows[il];
    return sp->capture[il].data();
}

// the deepest record among the caches holding the cell (iSWA: the window cache drops cells the base keeps)
int32_t llama_specee_cell_depth(llama_context * ctx, llama_seq_id seq_id, llama_pos pos) {
    int32_t depth = -1;
    for (const auto * kv : llama_specee::caches_of(*ctx)) {
        depth = std::max(depth, kv->specee_depth_get(seq_id, pos));
    }
    return depth;
}

void llama_specee_fail_allocations(llama_context * ctx, int32_t n) {
    auto * sp = ctx->get_specee();
    if (sp) {
        sp->fail_allocations(n);
    }
}
