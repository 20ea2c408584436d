// specee: per-layer early exit of single-token decodes (see include/llama-specee.h)

#include "llama-specee-impl.h"

#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

// names given by the graph builder: "specee_probe-<il>" and "l_out-<il>"; -1 for other tensors
static int32_t specee_layer_of(const ggml_tensor * t, const char * prefix, size_t len) {
    if (strncmp(t->name, prefix, len) != 0) {
        return -1;
    }
    return atoi(t->name + len);
}

static int32_t specee_probe_layer(const ggml_tensor * t) {
    return t->name[0] == 's' ? specee_layer_of(t, "specee_probe-", 13) : -1;
}

static int32_t specee_hidden_layer(const ggml_tensor * t) {
    return t->name[0] == 'l' ? specee_layer_of(t, "l_out-", 6) : -1;
}

static bool specee_is_draft(const ggml_tensor * t) {
    return t->name[0] == 's' && strcmp(t->name, "specee_draft") == 0;
}

// What early exit knows of each architecture it supports, in one place. All of them end in
// final_norm (RMS) -> LM head, build K/V as attn_norm -> K/V projections (+ bias) -> the per-head K
// norm where a layer has one -> RoPE at the layer's frequency, and keep one unified cache or an iSWA
// pair (window layers in one, global layers in the other); what differs is listed here.
struct specee_arch {
    llm_arch arch;
    bool     softcap; // the LM head's logits are soft-capped: cap * tanh(z / cap), cap = f_final_logit_softcapping
};

static const specee_arch SPECEE_ARCHS[] = {
    { LLM_ARCH_LLAMA,  false },
    { LLM_ARCH_QWEN2,  false },
    { LLM_ARCH_QWEN3,  false },
    { LLM_ARCH_GEMMA3, true  }, // its input embeddings are scaled by sqrt(n_embd); the draft reads them unscaled
};

static const specee_arch * specee_arch_of(const llama_model & model) {
    for (const auto & a : SPECEE_ARCHS) {
        if (a.arch == model.arch) {
            return &a;
        }
    }
    return nullptr;
}

static float specee_softcap(const llama_model & model) {
    const auto * a = specee_arch_of(model);
    return a && a->softcap ? model.hparams.f_final_logit_softcapping : 0.0f;
}

std::vector<llama_kv_cache *> llama_specee::caches_of(const llama_context & lctx) {
    llama_memory_i * mem = lctx.get_memory();
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        return { kv };
    }
    if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return { iswa->get_base(), iswa->get_swa() };
    }
    return {};
}

size_t llama_specee::cache_index(int32_t il) const {
    return caches.size() == 2 && lctx.model.hparams.is_swa(il) ? 1 : 0;
}

void llama_specee::set_depth(int32_t depth) {
    for (auto * kv : caches) {
        kv->specee_depth_set(seq_id, pos, depth);
    }
}

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

llama_specee::llama_specee(llama_context & lctx, int32_t n_cand, llama_specee_kv_mode kv_mode) :
    lctx(lctx),
    n_layer((int32_t) lctx.model.hparams.n_layer()),
    n_embd((int32_t) lctx.model.hparams.n_embd),
    n_vocab(lctx.model.vocab.n_tokens()),
    n_cand(n_cand),
    kv_mode(kv_mode),
    softcap(specee_softcap(lctx.model)),
    caches(caches_of(lctx)),
    probe_active(n_layer, 0),
    capture_active(n_layer, 0),
    predictors(n_layer),
    probed(n_layer, 0),
    features(3*n_cand),
    capture(n_layer),
    capture_rows(n_layer, 0),
    head_logits(n_vocab),
    fill_graphs(n_layer) {
    cand.fill(0);
    // without predictors, the callback may probe any layer but the last
    std::fill(probed.begin(), probed.end() - 1, 1);
}

llama_specee::~llama_specee() = default;

// probes are built while some active layer can decide: a callback, or a predictor on it
bool llama_specee::probes_wanted() const {
    for (int32_t il = 0; il < n_layer - 1; ++il) {
        if (decides(il)) {
            return true;
        }
    }
    return false;
}

const llm_graph_specee_draft * llama_specee::graph_draft() const {
    return has_draft && lctx.cparams.specee_n_cand > 0 ? &draft : nullptr;
}

const uint8_t * llama_specee::graph_probed() const {
    return probed.data();
}

void llama_specee::before_decode() {
    // full mode: the token that stopped last runs its remaining layers before anything else
    if (kv_mode == LLAMA_SPECEE_KV_FULL && exit_layer >= 0) {
        resume(true);
    }
    exit_layer = -1;

    auto & cparams = lctx.cparams;
    cparams.specee_n_cand     = probes_wanted() ? n_cand : 0;
    cparams.specee_depth_mask = std::any_of(caches.begin(), caches.end(), [](const llama_kv_cache * kv) { return kv->specee_has_shallow(0); });
}

bool llama_specee::eval_callback(ggml_tensor * t, bool ask, void * user_data) {
    auto * sp = (llama_specee *) user_data;
    auto & cparams = sp->lctx.cparams;

    bool user_wants = cparams.cb_eval && cparams.cb_eval(t, true, cparams.cb_eval_user_data);

    const int32_t il_probe  = specee_probe_layer(t);
    const int32_t il_hidden = il_probe < 0 ? specee_hidden_layer(t) : -1;

    const bool probe   = il_probe  >= 0 && !sp->completing && sp->decides(il_probe);
    const bool capture = il_hidden >= 0 && sp->capture_active[il_hidden];
    const bool timed   = sp->timing && specee_is_draft(t);

    if (ask) {
        return probe || capture || timed || user_wants;
    }

    bool go_on = true;
    if (user_wants) {
        go_on = cparams.cb_eval(t, false, cparams.cb_eval_user_data);
    }
    if (timed) {
        sp->info.t_draft_us = ggml_time_us() - sp->t_graph_start;
    }
    if (capture) {
        sp->record_capture(t, il_hidden);
    }
    if (probe && go_on) {
        ggml_backend_tensor_get(t, sp->cand_logits, 0, sp->n_cand*sizeof(float));
        if (sp->softcap > 0.0f) { // what the model's own output path gives these candidates
            for (int32_t i = 0; i < sp->n_cand; ++i) {
                sp->cand_logits[i] = sp->softcap*std::tanh(sp->cand_logits[i]/sp->softcap);
            }
        }
        bool stop;
        if (sp->cb) {
            sp->probed_layer = il_probe;
            stop = sp->cb(il_probe, sp->cand_logits, sp->n_cand, sp->cb_user_data);
            sp->probed_layer = -1;
        } else {
            stop = sp->predict_and_verify(il_probe);
        }
        if (stop) {
            sp->stop_layer = il_probe;
            go_on = false;
        }
    }
    return go_on;
}

// the native decision after layer il: features, the layer's MLP, and on a positive prediction the
// exit head's argmax, which must be one of the candidates
bool llama_specee::predict_and_verify(int32_t il) {
    const int64_t t0 = ggml_time_us();

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
    have_prev = true;

    const auto & mlp = predictors[il];
    const bool positive = mlp.prob(features.data(), mlp_scratch) > mlp.threshold;
    info.n_probes++;

    const int64_t t1 = ggml_time_us();
    info.t_predictor_us += t1 - t0;
    if (!positive) {
        return false;
    }

    const llama_token top1 = head_argmax(il);
    const llama_token * c = step_candidates();
    const bool hit = std::find(c, c + n_cand, top1) != c + n_cand;
    info.n_verify_fail += !hit;
    info.t_verify_us += ggml_time_us() - t1;
    return hit;
}

// the candidates the probes of this step use: the draft's output, or the input ids
const llama_token * llama_specee::step_candidates() {
    if (!info_cand_read) {
        ggml_tensor * t = res ? res->t_specee_cand : nullptr;
        if (t && !(t->flags & GGML_TENSOR_FLAG_INPUT)) {
            ggml_backend_tensor_get(t, info.cand, 0, n_cand*sizeof(llama_token));
        } else {
            std::copy(cand.begin(), cand.begin() + n_cand, info.cand);
        }
        info_cand_read = true;
    }
    return info.cand;
}

void llama_specee::fill_token_info(llama_specee_token_info & out) {
    if (single && res && res->t_specee_cand) {
        step_candidates();
    }
    out = info;
    out.n_cand = n_cand;
    out.exit_layer = probed_layer >= 0 ? -1 : exit_layer;
}

void llama_specee::begin_graph(llm_graph_result * graph_res, const llama_ubatch & ubatch) {
    res        = graph_res;
    stop_layer = -1;
    exit_layer = -1;
    head_layer = -1;
    seq_id     = ubatch.seq_id[0][0];
    pos        = ubatch.pos[0];
    single     = ubatch.n_tokens == 1;
    have_prev  = false;
    info       = {};
    info.exit_layer = -1;
    info_cand_read  = false;
    std::fill(capture_rows.begin(), capture_rows.end(), 0);
    if (res->t_specee_cand && (res->t_specee_cand->flags & GGML_TENSOR_FLAG_INPUT)) {
        ggml_backend_tensor_set(res->t_specee_cand, cand.data(), 0, n_cand*sizeof(llama_token));
    }
    if (res->t_specee_lookup) {
        set_lookup_inputs();
    }
    if (single) {
        n_lookup = 0; // the caller's candidates are for one token
    }
    info.graph_probes     = (int32_t) std::count_if(res->t_specee_probe.begin(), res->t_specee_probe.end(),
                                                    [](const ggml_tensor * t) { return t != nullptr; });
    info.graph_draft      = res->t_specee_cand && !(res->t_specee_cand->flags & GGML_TENSOR_FLAG_INPUT);
    info.graph_depth_mask = lctx.cparams.specee_depth_mask; // part of the reuse check: true of this graph
    t_graph_start = ggml_time_us();
}

void llama_specee::record_capture(ggml_tensor * t, int32_t il) {
    const int64_t rows = t->ne[1];
    auto & dst = capture[il];
    dst.resize((capture_rows[il] + rows)*n_embd);
    ggml_backend_tensor_get(t, dst.data() + (size_t) capture_rows[il]*n_embd, 0, rows*n_embd*sizeof(float));
    capture_rows[il] += rows;
}

// the exit head: final_norm(h) through the LM head, and its argmax, on a scheduler of its own so
// that the stopped graph of the main scheduler stays allocated for a resume
void llama_specee::build_head() {
    const auto & model = lctx.model;

    ggml_init_params params = {
        /*.mem_size   =*/ ggml_tensor_overhead()*16 + ggml_graph_overhead_custom(16, false),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    head_ctx.reset(ggml_init(params));
    ggml_context * ctx = head_ctx.get();

    head_inp = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, 1);
    ggml_set_input(head_inp);
    ggml_set_output(head_inp); // kept intact (not normed in place): fill and the next draft read h_exit from it

    ggml_tensor * cur = ggml_rms_norm(ctx, head_inp, model.hparams.f_norm_rms_eps);
    cur = ggml_mul(ctx, cur, model.output_norm);
    head_out = ggml_mul_mat(ctx, model.output, cur);
    if (softcap > 0.0f) {
        head_out = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, head_out, 1.0f/softcap)), softcap);
    }
    ggml_set_output(head_out);
    head_argmax_t = ggml_argmax(ctx, head_out);
    ggml_set_output(head_argmax_t);

    head_gf = ggml_new_graph_custom(ctx, 16, false);
    ggml_build_forward_expand(head_gf, head_argmax_t);

    head_sched.reset(ggml_backend_sched_new(lctx.backend_ptrs.data(), lctx.backend_buft.data(),
            (int) lctx.backend_ptrs.size(), 16, false, lctx.cparams.op_offload));

    // allocated once and kept: nothing else runs on this scheduler
    if (!ggml_backend_sched_alloc_graph(head_sched.get(), head_gf)) {
        GGML_ABORT("specee: failed to allocate the exit head");
    }
}

// layer il's exit logits stay on the backend; only what is asked for comes back
void llama_specee::compute_head(int32_t il) {
    if (head_layer == il) {
        return;
    }
    if (!head_sched) {
        build_head();
    }
    ggml_backend_tensor_copy(res->t_specee_hidden[il], head_inp);
    ggml_backend_sched_graph_compute(head_sched.get(), head_gf);
    head_layer   = il;
    head_on_host = false;
}

int32_t llama_specee::head_argmax(int32_t il) {
    compute_head(il);
    int32_t top1 = -1;
    ggml_backend_tensor_get(head_argmax_t, &top1, 0, sizeof(top1));
    return top1;
}

const float * llama_specee::probe_logits() {
    if (probed_layer < 0) {
        return nullptr;
    }
    compute_head(probed_layer);
    if (!head_on_host) {
        ggml_backend_tensor_get(head_out, head_logits.data(), 0, n_vocab*sizeof(float));
        head_on_host = true;
    }
    return head_logits.data();
}

bool llama_specee::end_graph(float * logits_out) {
    if (stop_layer < 0 || !ggml_backend_sched_is_stopped(lctx.sched.get())) {
        exit_layer = -1;
        info.exit_layer = -1;
        return false;
    }

    exit_layer = stop_layer;
    stop_layer = -1;
    info.exit_layer = exit_layer;

    compute_head(exit_layer);
    if (logits_out) {
        if (head_on_host) {
            memcpy(logits_out, head_logits.data(), n_vocab*sizeof(float));
        } else {
            ggml_backend_tensor_get(head_out, logits_out, 0, n_vocab*sizeof(float));
        }
    }
    // the next step's draft reads the hidden state this token left with
    if (has_draft) {
        ggml_backend_tensor_copy(head_inp, draft.h_prev);
    }

    // a filled cell is complete; otherwise the skipped layers must not see it until they hold its K/V
    const bool filled = kv_mode == LLAMA_SPECEE_KV_FILL && fill(exit_layer);
    if (!filled) {
        set_depth(exit_layer);
    }
    return true;
}

// fill mode: the exit hidden state stands in for the input of every skipped layer: attention norm,
// K/V projections (with biases, the per-head K norm of qwen3 and gemma3) and RoPE at the layer's
// frequency, written into the token's cell of the cache that holds the layer (iSWA: the window
// cache for window layers). head_inp holds h_exit (compute_head ran first). The graph of each exit
// layer is built once. Returns false if the cell is gone from a cache.
bool llama_specee::fill(int32_t exit_layer) {
    const auto & model   = lctx.model;
    const auto & hparams = model.hparams;
    const auto & cparams = lctx.cparams;

    std::array<llama_kv_cache::slot_info, 2> sinfo;
    for (size_t c = 0; c < caches.size(); ++c) {
        sinfo[c] = caches[c]->specee_slot(seq_id, pos);
        if (sinfo[c].empty()) {
            return false;
        }
    }
    if (exit_layer >= n_layer - 1) {
        return false;
    }

    llama_ubatch one = {};
    one.n_tokens = 1;

    auto & fg = fill_graphs[exit_layer];
    if (!fg.gf) {
        const int32_t n_fill    = n_layer - 1 - exit_layer;
        const int32_t max_nodes = 16*n_fill + 8;
        ggml_init_params params = {
            /*.mem_size   =*/ ggml_tensor_overhead()*max_nodes + ggml_graph_overhead_custom(max_nodes, false),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        fg.ctx.reset(ggml_init(params));
        ggml_context * ctx = fg.ctx.get();
        fg.gf = ggml_new_graph_custom(ctx, max_nodes, false);

        fg.inp_pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
        ggml_set_input(fg.inp_pos);
        for (size_t c = 0; c < caches.size(); ++c) {
            fg.k_idxs[c] = caches[c]->build_input_k_idxs(ctx, one);
            fg.v_idxs[c] = caches[c]->build_input_v_idxs(ctx, one);
        }

        const int64_t n_head_kv = hparams.n_head_kv();
        for (int32_t il = exit_layer + 1; il < n_layer; ++il) {
            const auto & layer = model.layers[il];
            const size_t c = cache_index(il);
            llama_kv_cache * cache = caches[c];

            ggml_tensor * cur = ggml_mul(ctx, ggml_rms_norm(ctx, head_inp, hparams.f_norm_rms_eps), layer.attn_norm);

            ggml_tensor * k = ggml_mul_mat(ctx, layer.wk, cur);
            ggml_tensor * v = ggml_mul_mat(ctx, layer.wv, cur);
            if (layer.wk_b) {
                k = ggml_add(ctx, k, layer.wk_b);
            }
            if (layer.wv_b) {
                v = ggml_add(ctx, v, layer.wv_b);
            }
            k = ggml_reshape_3d(ctx, k, hparams.n_embd_head_k(), n_head_kv, 1);
            v = ggml_reshape_3d(ctx, v, hparams.n_embd_head_v(), n_head_kv, 1);
            if (layer.attn_k_norm) {
                k = ggml_mul(ctx, ggml_rms_norm(ctx, k, hparams.f_norm_rms_eps), layer.attn_k_norm);
            }
            k = ggml_rope_ext(ctx, k, fg.inp_pos, model.get_rope_factors(cparams, il),
                    hparams.n_rot(), hparams.rope_type, cparams.n_ctx_orig_yarn, model.get_rope_freq_base(cparams, il),
                    model.get_rope_freq_scale(cparams, il), cparams.yarn_ext_factor, cparams.yarn_attn_factor,
                    cparams.yarn_beta_fast, cparams.yarn_beta_slow);

            // the cell's slot is an input (k/v_idxs): the graph does not depend on it
            ggml_build_forward_expand(fg.gf, cache->cpy_k(ctx, k, fg.k_idxs[c], il, sinfo[c]));
            ggml_build_forward_expand(fg.gf, cache->cpy_v(ctx, v, fg.v_idxs[c], il, sinfo[c]));
        }

        // a scheduler per graph: allocated once and kept, so each stop only sets the inputs and computes
        // (its hash set holds nodes and leafs: the weights and cache tensors are leafs)
        fg.sched.reset(ggml_backend_sched_new(lctx.backend_ptrs.data(), lctx.backend_buft.data(),
                (int) lctx.backend_ptrs.size(), 2*max_nodes, false, cparams.op_offload));
        if (!ggml_backend_sched_alloc_graph(fg.sched.get(), fg.gf)) {
            GGML_ABORT("specee: failed to allocate the fill graph");
        }
    }

    ggml_backend_tensor_set(fg.inp_pos, &pos, 0, sizeof(pos));
    for (size_t c = 0; c < caches.size(); ++c) {
        if (fg.k_idxs[c]->buffer) { // unallocated where no skipped layer is in that cache
            caches[c]->set_input_k_idxs(fg.k_idxs[c], &one, sinfo[c]);
            caches[c]->set_input_v_idxs(fg.v_idxs[c], &one, sinfo[c]);
        }
    }
    ggml_backend_sched_graph_compute(fg.sched.get(), fg.gf);
    return true;
}

int32_t llama_specee::resume(bool complete) {
    if (exit_layer < 0 || !ggml_backend_sched_is_stopped(lctx.sched.get())) {
        return 1;
    }

    completing = complete;
    const ggml_status status = ggml_backend_sched_graph_compute_resume(lctx.sched.get());
    completing = false;
    if (status != GGML_STATUS_SUCCESS) {
        return -1;
    }

    float * logits_out = complete || lctx.n_outputs == 0 ? nullptr : lctx.logits.data;
    if (end_graph(logits_out)) {
        return 0;
    }

    set_depth(n_layer - 1);
    if (logits_out) {
        ggml_backend_tensor_get(res->t_logits, logits_out, 0, n_vocab*sizeof(float));
    }
    return 0;
}

int32_t llama_specee::set_draft(ggml_type type, int32_t n_draft_vocab, const float * w_embd, const float * w_hidden,
                                const float * bias, const float * norm, float eps, const float * head,
                                const int32_t * vocab_map) {
    if (n_draft_vocab < n_cand || (type != GGML_TYPE_F32 && type != GGML_TYPE_F16 && type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0) ||
        n_embd % ggml_blck_size(type) != 0) {
        return -2;
    }
    for (int32_t i = 0; i < n_draft_vocab; ++i) {
        if (vocab_map[i] < 0 || vocab_map[i] >= n_vocab) {
            return -2;
        }
    }

    ggml_init_params params = { ggml_tensor_overhead()*8, nullptr, /*.no_alloc =*/ true };
    draft_ctx.reset(ggml_init(params));
    ggml_context * ctx = draft_ctx.get();
    llm_graph_specee_draft d;
    d.w_embd    = ggml_new_tensor_2d(ctx, type, n_embd, n_embd);
    d.w_hidden  = ggml_new_tensor_2d(ctx, type, n_embd, n_embd);
    d.bias      = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_embd);
    d.norm      = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_embd);
    d.head      = ggml_new_tensor_2d(ctx, type, n_embd, n_draft_vocab);
    d.vocab_map = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n_draft_vocab);
    d.h_prev    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, 1);
    d.eps       = eps;

    // on the first (highest-priority) device, where the layers run when they are offloaded
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(lctx.backend_ptrs[0]);
    draft_buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft));
    if (!draft_buf) {
        return -2;
    }

    auto upload = [](ggml_tensor * t, const float * src) {
        const int64_t n_per_row = t->ne[0];
        const int64_t n_rows    = ggml_nrows(t);
        std::vector<uint8_t> data(ggml_nbytes(t));
        ggml_quantize_chunk(t->type, src, data.data(), 0, n_rows, n_per_row, nullptr);
        ggml_backend_tensor_set(t, data.data(), 0, data.size());
    };
    ggml_backend_buffer_clear(draft_buf.get(), 0); // h_prev starts at zero; the rest is set below
    upload(d.w_embd, w_embd);
    upload(d.w_hidden, w_hidden);
    upload(d.head, head);
    ggml_backend_tensor_set(d.bias, bias, 0, n_embd*sizeof(float));
    ggml_backend_tensor_set(d.norm, norm, 0, n_embd*sizeof(float));
    ggml_backend_tensor_set(d.vocab_map, vocab_map, 0, n_draft_vocab*sizeof(int32_t));

    draft_row.assign(n_vocab, -1);
    for (int32_t i = 0; i < n_draft_vocab; ++i) {
        draft_row[vocab_map[i]] = i;
    }
    lookup_mask.assign(n_draft_vocab, 0.0f);
    n_lookup = 0;

    draft = d;
    has_draft = true;
    lctx.cparams.specee_layout++;
    return 0;
}

int32_t llama_specee::set_lookup(const llama_token * ids, int32_t n) {
    if (!has_draft) {
        return -1;
    }
    if (n < 0 || n > n_cand) {
        return -2;
    }
    for (int32_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= n_vocab || std::find(ids, ids + i, ids[i]) != ids + i) {
            return -2;
        }
    }
    std::copy(ids, ids + n, lookup.begin());
    n_lookup = n;
    return 0;
}

// slots [0, n_lookup) take the caller's ids, the rest the draft's best (rows n_cand.. of the concat)
void llama_specee::set_lookup_inputs() {
    std::array<int32_t, LLAMA_SPECEE_MAX_CAND> ids;
    std::array<int32_t, LLAMA_SPECEE_MAX_CAND> sel;
    for (int32_t i = 0; i < n_cand; ++i) {
        ids[i] = i < n_lookup ? lookup[i] : 0;
        sel[i] = i < n_lookup ? i : n_cand + i - n_lookup;
    }
    for (int32_t i = 0; i < n_lookup; ++i) {
        if (draft_row[lookup[i]] >= 0) {
            lookup_mask[draft_row[lookup[i]]] = -INFINITY;
        }
    }
    ggml_backend_tensor_set(res->t_specee_lookup, ids.data(), 0, n_cand*sizeof(int32_t));
    ggml_backend_tensor_set(res->t_specee_lookup_sel, sel.data(), 0, n_cand*sizeof(int32_t));
    ggml_backend_tensor_set(res->t_specee_lookup_mask, lookup_mask.data(), 0, lookup_mask.size()*sizeof(float));
    for (int32_t i = 0; i < n_lookup; ++i) {
        if (draft_row[lookup[i]] >= 0) {
            lookup_mask[draft_row[lookup[i]]] = 0.0f;
        }
    }
}

int32_t llama_specee::set_predictor(int32_t il, int32_t n_dense, const int32_t * dims, const float * params, float threshold) {
    if (il < 0 || il >= n_layer - 1) {
        return -1;
    }
    auto & mlp = predictors[il];
    const bool had_any = std::any_of(predictors.begin(), predictors.end(), [](const auto & m) { return !m.empty(); });
    if (n_dense == 0) {
        mlp = {};
    } else {
        if (n_dense < 0 || dims[0] != 3*n_cand || dims[n_dense] != 1) {
            return -2;
        }
        size_t n_params = 0;
        for (int32_t j = 0; j < n_dense; ++j) {
            if (dims[j] < 1 || dims[j + 1] < 1) {
                return -2;
            }
            n_params += (size_t) dims[j + 1]*dims[j] + dims[j + 1];
        }
        // weights transposed to [in][out] (see llama_specee_mlp::prob), biases as given
        mlp.dims.assign(dims, dims + n_dense + 1);
        mlp.params.resize(n_params);
        const float * src = params;
        float * dst = mlp.params.data();
        for (int32_t j = 0; j < n_dense; ++j) {
            const int32_t n_in  = dims[j];
            const int32_t n_out = dims[j + 1];
            for (int32_t o = 0; o < n_out; ++o) {
                for (int32_t i = 0; i < n_in; ++i) {
                    dst[(size_t) i*n_out + o] = src[(size_t) o*n_in + i];
                }
            }
            std::copy(src + (size_t) n_out*n_in, src + (size_t) n_out*n_in + n_out, dst + (size_t) n_out*n_in);
            src += (size_t) n_out*n_in + n_out;
            dst += (size_t) n_out*n_in + n_out;
        }
        mlp.threshold = threshold;
    }

    // graphs probe the layers that have a predictor (every layer but the last when none has)
    const bool has_any = std::any_of(predictors.begin(), predictors.end(), [](const auto & m) { return !m.empty(); });
    for (int32_t l = 0; l < n_layer - 1; ++l) {
        probed[l] = has_any ? !predictors[l].empty() : 1;
    }
    if (has_any || had_any) {
        lctx.cparams.specee_layout++;
    }
    return 0;
}

int32_t llama_specee::set_threshold(int32_t il, float threshold) {
    if (predictors[il].empty()) {
        return -1;
    }
    predictors[il].threshold = threshold;
    return 0;
}

//
// C API
//

int32_t llama_specee_supported(const llama_model * model) {
    return specee_arch_of(*model) && model->output && model->output_norm && !model->output_norm_b && !model->output_s ? 1 : 0;
}

// fill recomputes K/V the way the architectures of SPECEE_ARCHS build them; anything else is refused
static bool specee_can_fill(const llama_context & ctx) {
    const auto & model = ctx.get_model();
    if (model.hparams.use_kq_norm) {
        return false;
    }
    for (uint32_t il = 0; il < model.hparams.n_layer(); ++il) {
        const auto & layer = model.layers[il];
        if (!layer.attn_norm || !layer.wk || !layer.wv || layer.wqkv || layer.wk_s || layer.wv_s) {
            return false;
        }
    }
    // a cache that rotates K/V (quantized types) stores what the main graph rotated: not reproduced here
    ggml_init_params params = { 4*ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
    ggml_context_ptr tmp(ggml_init(params));
    for (const auto * cache : llama_specee::caches_of(ctx)) {
        if (cache->build_input_k_rot(tmp.get()) || cache->build_input_v_rot(tmp.get())) {
            return false;
        }
    }
    return true;
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
    if (kv_mode == LLAMA_SPECEE_KV_FILL && !specee_can_fill(*ctx)) {
        return -4;
    }
    ctx->specee_enable(n_cand, kv_mode);
    return 0;
}

int32_t llama_specee_set_probe_layers(llama_context * ctx, const int32_t * layers, int32_t n) {
    auto * sp = ctx->get_specee();
    if (!sp || n < 0) {
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        if (layers[i] < 0 || layers[i] >= sp->n_layer - 1) {
            return -1;
        }
    }
    std::fill(sp->probe_active.begin(), sp->probe_active.end(), 0);
    for (int32_t i = 0; i < n; ++i) {
        sp->probe_active[layers[i]] = 1;
    }
    return 0;
}

int32_t llama_specee_set_candidates(llama_context * ctx, const llama_token * ids, int32_t n) {
    auto * sp = ctx->get_specee();
    if (!sp || n != sp->n_cand) {
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= sp->n_vocab) {
            return -1;
        }
        sp->cand[i] = ids[i];
    }
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

int32_t llama_specee_set_draft(llama_context * ctx, int32_t type, int32_t n_draft_vocab,
        const float * w_embd, const float * w_hidden, const float * bias, const float * norm, float eps,
        const float * head, const int32_t * vocab_map) {
    auto * sp = ctx->get_specee();
    if (!sp) {
        return -1;
    }
    return sp->set_draft((ggml_type) type, n_draft_vocab, w_embd, w_hidden, bias, norm, eps, head, vocab_map);
}

int32_t llama_specee_set_lookup(llama_context * ctx, const llama_token * ids, int32_t n) {
    auto * sp = ctx->get_specee();
    return sp ? sp->set_lookup(ids, n) : -1;
}

int32_t llama_specee_set_predictor(llama_context * ctx, int32_t il, int32_t n_dense, const int32_t * dims,
        const float * params, float threshold) {
    auto * sp = ctx->get_specee();
    return sp ? sp->set_predictor(il, n_dense, dims, params, threshold) : -1;
}

int32_t llama_specee_set_threshold(llama_context * ctx, int32_t il, float threshold) {
    auto * sp = ctx->get_specee();
    if (!sp || il < 0 || il >= sp->n_layer - 1) {
        return -1;
    }
    return sp->set_threshold(il, threshold);
}

float llama_specee_predictor_prob(llama_context * ctx, int32_t il, const float * features) {
    auto * sp = ctx->get_specee();
    if (!sp || il < 0 || il >= sp->n_layer - 1 || sp->predictors[il].empty()) {
        return -1.0f;
    }
    std::vector<float> scratch;
    return sp->predictors[il].prob(features, scratch);
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

int32_t llama_specee_set_capture_layers(llama_context * ctx, const int32_t * layers, int32_t n) {
    auto * sp = ctx->get_specee();
    if (!sp || n < 0) {
        return -1;
    }
    for (int32_t i = 0; i < n; ++i) {
        if (layers[i] < 0 || layers[i] >= sp->n_layer) {
            return -1;
        }
    }
    std::fill(sp->capture_active.begin(), sp->capture_active.end(), 0);
    for (int32_t i = 0; i < n; ++i) {
        sp->capture_active[layers[i]] = 1;
    }
    return 0;
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
