// specee: the token path of early exit inside llama_decode (see include/llama-specee.h)
//
// One single-token decode: before_decode sets what the graph holds (graph()); the graph runs the draft
// head, then the layers, and after each probed layer its candidate probe; the eval callback hands each
// active probe to on_probe: the exit rule (llama-specee-rule.cpp), verification by the exit head where
// the layer's exit is verified, and a stop; end_graph then writes the step's logits (the exit head's,
// or the candidates' for a head-free exit), keeps the exit hidden state for the next draft and handles
// the K/V of the skipped layers (llama-specee-kv.cpp).

#include "llama-specee-impl.h"

#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

static float specee_softcap(const llama_model & model) {
    const auto * a = llama_specee_arch_of(model);
    return a && a->softcap ? model.hparams.f_final_logit_softcapping : 0.0f;
}

// whether a backend of the context takes ggml_get_rows on weight w where it lies, as ggml's scheduler places an op
// on a weight (the first backend that takes both the weight's buffer type and the op). Where none does, the
// scheduler cannot place the node (GGML_ASSERT(*cur_backend_id != -1)), or it would copy the whole weight each step.
static bool specee_rows_readable(const std::vector<ggml_backend_t> & backends, ggml_tensor * w) {
    if (!w || !w->buffer) {
        return false;
    }
    ggml_init_params params = { ggml_tensor_overhead()*2, nullptr, /*.no_alloc =*/ true };
    ggml_context_ptr ctx(ggml_init(params));
    ggml_tensor * rows = ggml_get_rows(ctx.get(), w, ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, 1));
    for (ggml_backend_t backend : backends) {
        if (ggml_backend_supports_buft(backend, ggml_backend_buffer_get_type(w->buffer)) && ggml_backend_supports_op(backend, rows)) {
            return true;
        }
    }
    return false;
}

// the LM-head rows the probes read: the output head's own; where its layout takes only matrix products (ggml-cpu
// repacks Q4_0, IQ4_NL, Q4_K, ... for AVX2 and ARM kernels), the token embedding when the output head is the
// embedding (tied: llama.cpp loads token_embd.weight twice, the input's copy where get_rows runs, as the input
// needs it); else nullptr, and the caller hands a plain copy over (set_lm_rows)
static ggml_tensor * specee_lm_rows(const llama_model & model, const std::vector<ggml_backend_t> & backends) {
    if (specee_rows_readable(backends, model.output)) {
        return model.output;
    }
    const bool tied = model.tok_embd && std::strcmp(model.output->name, model.tok_embd->name) == 0;
    return tied && specee_rows_readable(backends, model.tok_embd) ? model.tok_embd : nullptr;
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
    exits(n_layer),
    capture(n_layer),
    capture_rows(n_layer, 0),
    rule(n_cand),
    head_logits(n_vocab),
    fill_graphs(n_layer) {
    cand.fill(0);
    next_graph.out_norm = lctx.model.output_norm;
    next_graph.lm_head  = specee_lm_rows(lctx.model, lctx.backend_ptrs);
}

llama_specee::~llama_specee() = default;

//
// the graph
//

bool llama_specee::decides(int32_t il) const {
    return probe_active[il] && (cb || exits[il].kind != LLAMA_SPECEE_EXIT_NONE);
}

// probes are built while some active layer can decide: a callback, or a layer's exit
bool llama_specee::probes_wanted() const {
    for (int32_t il = 0; il < n_layer; ++il) {
        if (decides(il)) {
            return true;
        }
    }
    return false;
}

void llama_specee::before_decode(int32_t n_batch_tokens) {
    // full mode: the token that stopped last runs its remaining layers before anything else
    if (kv_mode == LLAMA_SPECEE_KV_FULL && exit_layer >= 0 && exit_layer < n_layer - 1) {
        resume(true);
    }
    exit_layer = -1;
    exit_kind  = LLAMA_SPECEE_EXIT_NONE;

    // everything that shapes the graph is in this one value, which llama.cpp compares whole before it
    // reuses a graph; probes go on the layers whose exit is on (every layer for a callback without them)
    // A batch of several tokens (a prompt) never stops, not even in a one-token ubatch, but with probes
    // wanted its graph keeps the draft, so that its last hidden state is where the first draft reads it.
    auto & g = next_graph;
    const bool wanted = probes_wanted();
    // no LM-head rows yet (needs_lm_rows): no probe can be built, and neither the draft that feeds them
    g.n_cand = wanted && n_batch_tokens == 1 && g.lm_head ? n_cand : 0;
    g.probed.reset();
    if (g.n_cand > 0) {
        const bool any_exit = std::any_of(exits.begin(), exits.end(), [](const auto & e) { return e.kind != LLAMA_SPECEE_EXIT_NONE; });
        for (int32_t il = 0; il < n_layer; ++il) {
            g.probed[il] = any_exit ? exits[il].kind != LLAMA_SPECEE_EXIT_NONE : true;
        }
    }
    g.draft = wanted ? draft : llm_graph_specee_draft{};
    g.depth_mask = std::any_of(caches.begin(), caches.end(), [](const llama_kv_cache * kv) { return kv->specee_has_shallow(0); });
}

void llama_specee::begin_graph(llm_graph_result * graph_res, const llama_ubatch & ubatch) {
    res        = graph_res;
    stop_layer = -1;
    stop_kind  = LLAMA_SPECEE_EXIT_NONE;
    exit_layer = -1;
    exit_kind  = LLAMA_SPECEE_EXIT_NONE;
    head_layer   = -1;
    hidden_layer = -1;
    seq_id     = ubatch.seq_id[0][0];
    pos        = ubatch.pos[0];
    single     = ubatch.n_tokens == 1;
    rule.begin_token();
    info       = {};
    info.exit_layer = -1;
    info_cand_read  = false;
    std::fill(capture_rows.begin(), capture_rows.end(), 0);

    // the rows a batch graph leaves in draft.h_rows (0009's graph copies them when they fit); any other
    // graph makes the rows of an earlier one stale
    const ggml_tensor * last_out = res->t_specee_hidden[n_layer - 1];
    const bool rows_copied = next_graph.draft.h_rows && last_out && last_out->ne[1] > 1 &&
                             last_out->ne[1] <= next_graph.draft.h_rows->ne[1];
    rows_kept = rows_copied ? (int32_t) last_out->ne[1] : 0;

    const bool draft_graph = res->t_specee_cand && !(res->t_specee_cand->flags & GGML_TENSOR_FLAG_INPUT);
    if (res->t_specee_cand && !draft_graph) {
        ggml_backend_tensor_set(res->t_specee_cand, cand.data(), 0, n_cand*sizeof(llama_token));
    }
    if (res->t_specee_lookup) {
        set_lookup_inputs();
    }
    if (single) {
        n_lookup = 0; // the caller's candidates are for one token
    }

    // the nodes to stop at, by identity; with none, the scheduler computes without calling back
    roles.clear();
    for (int32_t il = 0; il < n_layer; ++il) {
        if (res->t_specee_probe[il] && decides(il)) {
            roles[res->t_specee_probe[il]] = il;
        }
        if (res->t_specee_hidden[il] && capture_active[il]) {
            roles[res->t_specee_hidden[il]] = -1 - il;
        }
    }
    if (timing && draft_graph) {
        roles[res->t_specee_cand] = DRAFT_ROLE;
    }
    const auto & cparams = lctx.cparams;
    if (roles.empty()) {
        ggml_backend_sched_set_eval_callback(lctx.sched.get(), cparams.cb_eval, cparams.cb_eval_user_data);
    } else {
        ggml_backend_sched_set_eval_callback(lctx.sched.get(), eval_callback, this);
    }

    info.graph_probes = (int32_t) std::count_if(res->t_specee_probe.begin(), res->t_specee_probe.end(),
                                                [](const ggml_tensor * t) { return t != nullptr; });
    info.graph_draft         = draft_graph;
    info.graph_depth_mask    = next_graph.depth_mask; // what this graph was built (or reused) for
    info.graph_eval_callback = !roles.empty();
    t_graph_start = ggml_time_us();
}

bool llama_specee::eval_callback(ggml_tensor * t, bool ask, void * user_data) {
    auto * sp = (llama_specee *) user_data;
    auto & cparams = sp->lctx.cparams;

    const bool user_wants = cparams.cb_eval && cparams.cb_eval(t, true, cparams.cb_eval_user_data);
    const auto role = sp->roles.find(t);
    const bool ours = role != sp->roles.end();
    if (ask) {
        return ours || user_wants;
    }

    bool go_on = !user_wants || cparams.cb_eval(t, false, cparams.cb_eval_user_data);
    if (!ours) {
        return go_on;
    }
    const int32_t r = role->second;
    if (r == DRAFT_ROLE) {
        sp->info.t_draft_us = ggml_time_us() - sp->t_graph_start;
    } else if (r < 0) {
        sp->record_capture(t, -1 - r);
    } else if (go_on && !sp->completing) {
        const int32_t kind = sp->on_probe(t, r);
        if (kind != LLAMA_SPECEE_EXIT_NONE) {
            sp->stop_layer = r;
            sp->stop_kind  = (llama_specee_exit_kind) kind;
            go_on = false;
        }
    }
    return go_on;
}

//
// probe -> rule -> verify
//

// the probe of layer il: its candidate logits, then the callback's or the native rule's decision
int32_t llama_specee::on_probe(ggml_tensor * t, int32_t il) {
    ggml_backend_tensor_get(t, cand_logits, 0, n_cand*sizeof(float));
    if (softcap > 0.0f) { // what the model's own output path gives these candidates
        for (int32_t i = 0; i < n_cand; ++i) {
            cand_logits[i] = softcap*std::tanh(cand_logits[i]/softcap);
        }
    }
    int32_t kind;
    if (cb) {
        probed_layer = il;
        kind = cb(il, cand_logits, n_cand, cb_user_data);
        probed_layer = -1;
        if (kind != LLAMA_SPECEE_EXIT_HEAD_FREE && kind != LLAMA_SPECEE_EXIT_VERIFIED) {
            kind = LLAMA_SPECEE_EXIT_NONE;
        }
        if (kind == LLAMA_SPECEE_EXIT_VERIFIED && !compute_head(il)) {
            kind = LLAMA_SPECEE_EXIT_NONE; // no exit head, no exit logits: the token goes on
        }
    } else {
        kind = predict(il);
    }
    if (kind == LLAMA_SPECEE_EXIT_HEAD_FREE) {
        std::copy(cand_logits, cand_logits + n_cand, exit_cand_logits);
    }
    return kind;
}

// the native decision after layer il: the exit rule, and where the layer's exit is verified, the exit
// head's argmax, which must be one of the candidates
int32_t llama_specee::predict(int32_t il) {
    const int64_t t0 = ggml_time_us();
    const llama_specee_outcome outcome = rule.check(predictors[il], exits[il], cand_logits);
    info.n_probes++;
    const int64_t t1 = ggml_time_us();
    info.t_predictor_us += t1 - t0;

    if (outcome == llama_specee_outcome::go_on) {
        return LLAMA_SPECEE_EXIT_NONE;
    }
    if (outcome == llama_specee_outcome::stop_head_free) {
        return LLAMA_SPECEE_EXIT_HEAD_FREE;
    }
    const llama_token top1 = head_argmax(il);
    const llama_token * c = step_candidates();
    const bool hit = top1 >= 0 && std::find(c, c + n_cand, top1) != c + n_cand;
    info.n_verify_fail += !hit;
    info.t_verify_us += ggml_time_us() - t1;
    return hit ? LLAMA_SPECEE_EXIT_VERIFIED : LLAMA_SPECEE_EXIT_NONE;
}

void llama_specee::decide(int32_t n, const int32_t * layers, const float * logits, const uint8_t * verified,
                          llama_specee_decision & out) const {
    llama_specee_rule r(n_cand);
    out = { -1, LLAMA_SPECEE_EXIT_NONE, 0, 0 };
    for (int32_t i = 0; i < n; ++i) {
        const int32_t il = layers[i];
        const llama_specee_outcome outcome = r.check(predictors[il], exits[il], logits + (size_t) i*n_cand);
        out.n_probes++;
        if (outcome == llama_specee_outcome::go_on) {
            continue;
        }
        if (outcome == llama_specee_outcome::verify && !verified[i]) {
            out.n_verify_fail++;
            continue;
        }
        out.exit_layer = il;
        out.exit_kind  = outcome == llama_specee_outcome::verify ? LLAMA_SPECEE_EXIT_VERIFIED : LLAMA_SPECEE_EXIT_HEAD_FREE;
        return;
    }
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
    const bool has_cand = single && res && res->t_specee_cand;
    if (has_cand) {
        step_candidates();
    }
    out = info;
    out.n_cand     = has_cand ? n_cand : 0; // no candidates in the graph: no ids to count as hits
    out.exit_layer = probed_layer >= 0 ? -1 : exit_layer;
    out.exit_kind  = probed_layer >= 0 ? LLAMA_SPECEE_EXIT_NONE : exit_kind;
}

void llama_specee::record_capture(ggml_tensor * t, int32_t il) {
    const int64_t rows = t->ne[1];
    auto & dst = capture[il];
    dst.resize((capture_rows[il] + rows)*n_embd);
    ggml_backend_tensor_get(t, dst.data() + (size_t) capture_rows[il]*n_embd, 0, rows*n_embd*sizeof(float));
    capture_rows[il] += rows;
}

//
// the exit head: final_norm(h) through the LM head, and its argmax, on a scheduler of its own so
// that the stopped graph of the main scheduler stays allocated for a resume. Its input also keeps
// the exit hidden state, which fill and the next draft read.
//

void llama_specee::fail_allocations(int32_t n) {
    fail_allocs = n;
    // the next use builds them again (the fill graphs read the head's input)
    for (auto & fg : fill_graphs) {
        fg = {};
    }
    head_sched.reset();
    head_ctx.reset();
    head_gf = nullptr;
    head_layer = hidden_layer = -1;
}

bool llama_specee::alloc_fails() {
    if (fail_allocs > 0) {
        --fail_allocs;
        return true;
    }
    return false;
}

bool llama_specee::build_head() {
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
    if (alloc_fails() || !ggml_backend_sched_alloc_graph(head_sched.get(), head_gf)) {
        LLAMA_LOG_WARN("%s: cannot allocate the exit head: no exit this step\n", __func__);
        head_sched.reset();
        head_ctx.reset();
        head_gf = nullptr;
        return false;
    }
    return true;
}

bool llama_specee::keep_exit_hidden(int32_t il) {
    if (hidden_layer == il) {
        return true;
    }
    if (!head_gf && !build_head()) {
        return false;
    }
    ggml_backend_tensor_copy(res->t_specee_hidden[il], head_inp);
    hidden_layer = il;
    return true;
}

// layer il's exit logits stay on the backend; only what is asked for comes back
bool llama_specee::compute_head(int32_t il) {
    if (head_layer == il) {
        return true;
    }
    if (!keep_exit_hidden(il)) {
        return false;
    }
    ggml_backend_sched_graph_compute(head_sched.get(), head_gf);
    info.n_heads++;
    head_layer   = il;
    head_on_host = false;
    return true;
}

int32_t llama_specee::head_argmax(int32_t il) {
    if (!compute_head(il)) {
        return -1;
    }
    int32_t top1 = -1;
    ggml_backend_tensor_get(head_argmax_t, &top1, 0, sizeof(top1));
    return top1;
}

const float * llama_specee::probe_logits() {
    if (probed_layer < 0 || !compute_head(probed_layer)) {
        return nullptr;
    }
    if (!head_on_host) {
        ggml_backend_tensor_get(head_out, head_logits.data(), 0, n_vocab*sizeof(float));
        head_on_host = true;
    }
    return head_logits.data();
}

const float * llama_specee::exit_head_logits() {
    if (exit_layer < 0 || !res || !compute_head(exit_layer)) {
        return nullptr;
    }
    if (!head_on_host) {
        ggml_backend_tensor_get(head_out, head_logits.data(), 0, n_vocab*sizeof(float));
        head_on_host = true;
    }
    return head_logits.data();
}

//
// the stop: the step's logits, the next draft's input, the K/V of the skipped layers
//

bool llama_specee::end_graph(float * logits_out) {
    if (stop_layer < 0 || !ggml_backend_sched_is_stopped(lctx.sched.get())) {
        exit_layer = -1;
        exit_kind  = LLAMA_SPECEE_EXIT_NONE;
        info.exit_layer = -1;
        info.n_heads++; // the graph's own output head
        return false;
    }

    exit_layer = stop_layer;
    exit_kind  = stop_kind;
    stop_layer = -1;
    info.exit_layer = exit_layer;
    info.exit_kind  = exit_kind;

    if (exit_kind == LLAMA_SPECEE_EXIT_HEAD_FREE) {
        // the candidates' logits are the step's; every other token is impossible
        if (logits_out) {
            std::fill(logits_out, logits_out + n_vocab, -INFINITY);
            const llama_token * c = step_candidates();
            for (int32_t i = 0; i < n_cand; ++i) {
                logits_out[c[i]] = exit_cand_logits[i];
            }
        }
    } else if (logits_out) { // verified: the exit head ran
        if (head_on_host) {
            memcpy(logits_out, head_logits.data(), n_vocab*sizeof(float));
        } else {
            ggml_backend_tensor_get(head_out, logits_out, 0, n_vocab*sizeof(float));
        }
    }

    // after the last layer the graph wrote every layer's K/V and the next draft's input itself
    if (exit_layer == n_layer - 1) {
        return true;
    }
    // the next step's draft reads the hidden state this token left with
    if (draft.h_prev) {
        ggml_backend_tensor_copy(res->t_specee_hidden[exit_layer], draft.h_prev);
    }
    // a filled cell is complete; otherwise the skipped layers must not see it until they hold its K/V
    const bool filled = kv_mode == LLAMA_SPECEE_KV_FILL && keep_exit_hidden(exit_layer) && fill(exit_layer);
    if (!filled) {
        set_depth(exit_layer);
    }
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

int32_t llama_specee::draft_from_row(int32_t row) {
    if (!draft.head) {
        return -1;
    }
    if (row < 0 || row >= rows_kept) {
        return -2;
    }
    std::vector<float> h(n_embd);
    ggml_backend_tensor_get(draft.h_rows, h.data(), row*draft.h_rows->nb[1], n_embd*sizeof(float));
    ggml_backend_tensor_set(draft.h_prev, h.data(), 0, n_embd*sizeof(float));
    return 0;
}

void llama_specee::forget() {
    exit_layer = -1; // a stopped token of full mode no longer completes at the next decode
    exit_kind  = LLAMA_SPECEE_EXIT_NONE;
    if (draft.h_prev) {
        ggml_backend_tensor_memset(draft.h_prev, 0, 0, ggml_nbytes(draft.h_prev));
    }
}

//
// set-up
//

int32_t llama_specee::set_draft(ggml_type type, int32_t n_draft_vocab, const float * w_embd, const float * w_hidden,
                                const float * bias, const float * norm, float eps, const float * head,
                                const int32_t * vocab_map) {
    if (n_draft_vocab < n_cand || (type != GGML_TYPE_F32 && type != GGML_TYPE_F16 && type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0) ||
        n_embd % ggml_blck_size(type) != 0) {
        return -2;
    }
    std::vector<int32_t> row_of(n_vocab, -1); // each id's draft row: an id twice would be scored twice
    for (int32_t i = 0; i < n_draft_vocab; ++i) {
        if (vocab_map[i] < 0 || vocab_map[i] >= n_vocab || row_of[vocab_map[i]] >= 0) {
            return -2;
        }
        row_of[vocab_map[i]] = i;
    }
    // a full-mode token still waiting for its remaining layers writes the current h_prev when it completes
    if (kv_mode == LLAMA_SPECEE_KV_FULL && exit_layer >= 0 && exit_layer < n_layer - 1) {
        resume(true);
        exit_layer = -1;
    }

    ggml_init_params params = { ggml_tensor_overhead()*9, nullptr, /*.no_alloc =*/ true };
    ggml_context_ptr ctx_ptr(ggml_init(params));
    ggml_context * ctx = ctx_ptr.get();
    llm_graph_specee_draft d;
    d.w_embd    = ggml_new_tensor_2d(ctx, type, n_embd, n_embd);
    d.w_hidden  = ggml_new_tensor_2d(ctx, type, n_embd, n_embd);
    d.bias      = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_embd);
    d.norm      = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n_embd);
    d.head      = ggml_new_tensor_2d(ctx, type, n_embd, n_draft_vocab);
    d.vocab_map = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 1, n_draft_vocab);
    d.h_prev    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, 1);
    d.h_rows    = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, LLAMA_SPECEE_MAX_ROWS);
    d.eps       = eps;
    d.generation = ++n_drafts_set; // what the graph-reuse check compares

    // on the device of the first layer, whose probes read the draft's candidates first: with layers on other
    // machines (RPC) the first device is a worker, and a draft there cost a graph and replies every token, even
    // for an exit before the first remote layer; the model's first device when every layer is offloaded
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(lctx.model.dev_layer(0));
    ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft));
    if (!buf) {
        return -2;
    }

    auto upload = [](ggml_tensor * t, const float * src) {
        const int64_t n_per_row = t->ne[0];
        const int64_t n_rows    = ggml_nrows(t);
        std::vector<uint8_t> data(ggml_nbytes(t));
        ggml_quantize_chunk(t->type, src, data.data(), 0, n_rows, n_per_row, nullptr);
        ggml_backend_tensor_set(t, data.data(), 0, data.size());
    };
    ggml_backend_buffer_clear(buf.get(), 0); // h_prev starts at zero; the rest is set below
    upload(d.w_embd, w_embd);
    upload(d.w_hidden, w_hidden);
    upload(d.head, head);
    ggml_backend_tensor_set(d.bias, bias, 0, n_embd*sizeof(float));
    ggml_backend_tensor_set(d.norm, norm, 0, n_embd*sizeof(float));
    ggml_backend_tensor_set(d.vocab_map, vocab_map, 0, n_draft_vocab*sizeof(int32_t));

    draft_row = std::move(row_of);
    lookup_mask.assign(n_draft_vocab, 0.0f);
    n_lookup = 0;

    draft = d;
    rows_kept = 0;
    draft_ctx = std::move(ctx_ptr);
    draft_buf = std::move(buf);
    return 0;
}

int32_t llama_specee::set_lm_rows(ggml_type type, const void * data, size_t size) {
    const ggml_tensor * output = lctx.model.output;
    if (!needs_lm_rows()) {
        return -1;
    }
    if (type != output->type || size != ggml_nbytes(output)) {
        return -2;
    }
    ggml_init_params params = { ggml_tensor_overhead(), nullptr, /*.no_alloc =*/ true };
    ggml_context_ptr ctx(ggml_init(params));
    ggml_tensor * rows = ggml_dup_tensor(ctx.get(), output);
    // a plain host buffer: CPU's get_rows reads every weight type from it
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
    ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft));
    if (!buf) {
        return -3;
    }
    ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    ggml_backend_tensor_set(rows, data, 0, size);
    lm_rows_ctx = std::move(ctx);
    lm_rows_buf = std::move(buf);
    next_graph.lm_head = rows;
    return 0;
}

int32_t llama_specee::set_lookup(const llama_token * ids, int32_t n) {
    if (!draft.head) {
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

int32_t llama_specee::set_predictor(int32_t il, int32_t n_dense, const int32_t * dims, const float * params) {
    if (il < 0 || il >= n_layer) {
        return -1;
    }
    if (n_dense == 0) {
        predictors[il] = {};
        exits[il] = {};
        return 0;
    }
    llama_specee_mlp mlp = llama_specee_mlp::from_rows(n_dense, dims, params, 3*n_cand);
    if (mlp.empty()) {
        return -2;
    }
    predictors[il] = std::move(mlp);
    return 0;
}

int32_t llama_specee::set_exit(int32_t il, llama_specee_exit_kind kind, float threshold) {
    if (il < 0 || il >= n_layer || predictors[il].empty()) {
        return -1;
    }
    if (kind < LLAMA_SPECEE_EXIT_NONE || kind > LLAMA_SPECEE_EXIT_HEAD_FREE ||
        (kind == LLAMA_SPECEE_EXIT_VERIFIED && il == n_layer - 1)) {
        return -2;
    }
    exits[il] = { kind, threshold };
    return 0;
}
