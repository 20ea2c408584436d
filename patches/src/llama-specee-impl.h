#pragma once

// specee: the per-context early-exit state behind include/llama-specee.h
//
// Where each part lives:
//   llama-specee-rule.cpp  the exit rule: features, the predictor MLP, the decision of one check
//   llama-specee.cpp       the token path: graph knobs, the eval callback, probe -> rule -> verify ->
//                          stop, the exit head, the step's logits and its report
//   llama-specee-kv.cpp    the caches behind the context, cell depth, and fill
//   llama-specee-api.cpp   the C API and the architecture table

#include "llama-specee.h"
#include "llama-graph.h"

#include "ggml-cpp.h"

#include <array>
#include <unordered_map>
#include <vector>

struct llama_context;
struct llama_model;
struct llama_ubatch;
class  llama_kv_cache;

//
// the exit rule (llama-specee-rule.cpp)
//

// an exit predictor: dense layers with ReLU between and a sigmoid out, evaluated on the host
struct llama_specee_mlp {
    std::vector<int32_t> dims;   // [n_in, hidden..., 1]
    std::vector<float>   params; // per layer: weight transposed, [in][out] row-major, then bias [out]

    bool  empty() const { return dims.empty(); }
    float prob(const float * features, std::vector<float> & scratch) const;

    // from per-layer row-major [out][in] weights then biases (the API's layout); empty on bad dims
    static llama_specee_mlp from_rows(int32_t n_dense, const int32_t * dims, const float * params, int32_t n_in);
};

// a layer's exit: how a positive prediction leaves, above which probability
struct llama_specee_exit {
    llama_specee_exit_kind kind = LLAMA_SPECEE_EXIT_NONE;
    float threshold = 1.0f;
};

// what one check decides before any verification
enum class llama_specee_outcome { go_on, stop_head_free, verify };

// the decision of one token's checks, in the order they run: [z, softmax(z), softmax(z) - p_prev]
// features (p_prev from the previous check of the same token, zeros at its first), the layer's MLP,
// its threshold and exit kind
struct llama_specee_rule {
    explicit llama_specee_rule(int32_t n_cand);

    void begin_token() { have_prev = false; }
    llama_specee_outcome check(const llama_specee_mlp & mlp, const llama_specee_exit & exit, const float * cand_logits);

    const int32_t n_cand;

private:
    std::vector<float> features; // [3*n_cand]
    std::vector<float> scratch;
    std::array<float, LLAMA_SPECEE_MAX_CAND> prev_probs = {};
    bool have_prev = false;
};

// index of the largest candidate logit (the first on ties): the token a head-free exit emits
int32_t llama_specee_cand_argmax(const float * cand_logits, int32_t n_cand);

//
// what early exit knows of an architecture (llama-specee-api.cpp)
//

struct llama_specee_arch_entry {
    const char * name;
    llm_arch     arch;
    bool         softcap; // the LM head's logits are soft-capped: cap * tanh(z / cap), cap = f_final_logit_softcapping
};

const llama_specee_arch_entry * llama_specee_arch_of(const llama_model & model);

//
// the state
//

struct llama_specee {
    llama_specee(llama_context & lctx, int32_t n_cand, llama_specee_kv_mode kv_mode);
    ~llama_specee();

    // the scheduler's eval callback while a probe, a capture or a timing asks for a node
    static bool eval_callback(ggml_tensor * t, bool ask, void * user_data);

    void before_decode(int32_t n_batch_tokens);                                  // the knobs of the next graphs
    void begin_graph(llm_graph_result * graph_res, const llama_ubatch & ubatch); // after the inputs are set
    bool end_graph(float * logits_out);                                         // true if the token stopped
    int32_t resume(bool complete);
    int32_t draft_from_row(int32_t row);
    void    forget();
    const float * probe_logits();
    const float * exit_head_logits();

    int32_t set_draft(ggml_type type, int32_t n_draft_vocab, const float * w_embd, const float * w_hidden,
                      const float * bias, const float * norm, float eps, const float * head, const int32_t * vocab_map);
    int32_t set_predictor(int32_t il, int32_t n_dense, const int32_t * dims, const float * params);
    int32_t set_exit(int32_t il, llama_specee_exit_kind kind, float threshold);
    int32_t set_lookup(const llama_token * ids, int32_t n);
    bool    needs_lm_rows() const { return next_graph.lm_head == nullptr; }
    int32_t set_lm_rows(ggml_type type, const void * data, size_t size);
    void    decide(int32_t n, const int32_t * layers, const float * cand_logits, const uint8_t * verified,
                   llama_specee_decision & out) const;
    void    fill_token_info(llama_specee_token_info & out);
    void    fail_allocations(int32_t n); // testing: the next n head and fill allocations fail

    // what the next graph holds (llm_graph_params::specee): set by before_decode
    const llm_graph_specee & graph() const { return next_graph; }

    llama_context & lctx;

    const int32_t n_layer;
    const int32_t n_embd;
    const int32_t n_vocab;
    const int32_t n_cand;
    const llama_specee_kv_mode kv_mode;
    const float softcap;                         // the output's soft-capping, 0 if the architecture has none
    const std::vector<llama_kv_cache *> caches;  // caches_of(lctx)

    std::vector<uint8_t> probe_active;   // [n_layer]: the schedule
    std::vector<uint8_t> capture_active; // [n_layer]
    std::array<llama_token, LLAMA_SPECEE_MAX_CAND> cand; // the input candidates when there is no draft head

    std::vector<llama_specee_mlp>  predictors; // [n_layer], empty where there is none
    std::vector<llama_specee_exit> exits;      // [n_layer]

    llama_specee_probe_callback cb = nullptr;
    void * cb_user_data = nullptr;
    bool timing = false;

    int32_t exit_layer = -1;                              // where the last decode or resume stopped
    llama_specee_exit_kind exit_kind = LLAMA_SPECEE_EXIT_NONE;

    std::vector<std::vector<float>> capture; // [n_layer][rows*n_embd]
    std::vector<int32_t> capture_rows;

    // the unified caches behind the context's memory: one, or an iSWA memory's base and window caches
    static std::vector<llama_kv_cache *> caches_of(const llama_context & lctx);
    static bool can_fill(const llama_context & lctx);

private:
    // the token path (llama-specee.cpp)
    bool decides(int32_t il) const;
    bool probes_wanted() const;
    int32_t on_probe(ggml_tensor * t, int32_t il);
    int32_t predict(int32_t il);
    const llama_token * step_candidates();
    void record_capture(ggml_tensor * t, int32_t il);
    void set_lookup_inputs();

    // the exit head (llama-specee.cpp): final_norm(h) through the LM head on a scheduler of its own
    bool build_head();
    bool keep_exit_hidden(int32_t il); // h_il into the head's input, where fill and the next draft read it
    bool compute_head(int32_t il);
    int32_t head_argmax(int32_t il);   // -1 if the head could not run
    bool alloc_fails();                // testing: consume one injected allocation failure
    int32_t fail_allocs = 0;

    // the KV of skipped layers (llama-specee-kv.cpp)
    bool fill(int32_t exit_layer);
    size_t cache_index(int32_t il) const; // which of `caches` holds layer il's K/V
    void set_depth(int32_t depth);        // of the token's cell, in every cache

    llm_graph_specee next_graph;

    // the graph being computed and its token
    llm_graph_result * res = nullptr;
    llama_seq_id seq_id = 0;
    llama_pos    pos    = 0;
    bool         single = false; // a single-token graph

    // the nodes the eval callback asks for, found by identity: a probe of layer il (il >= 0), a
    // captured layer output (-1 - il), or the draft's candidates (DRAFT_ROLE)
    static constexpr int32_t DRAFT_ROLE = INT32_MIN;
    std::unordered_map<const ggml_tensor *, int32_t> roles;

    llama_specee_rule rule;
    int32_t stop_layer   = -1;    // set by the callback when it stops
    llama_specee_exit_kind stop_kind = LLAMA_SPECEE_EXIT_NONE;
    int32_t probed_layer = -1;    // the probe being looked at by the callback
    bool    completing   = false; // running the rest of a stopped token: probes are off

    float cand_logits[LLAMA_SPECEE_MAX_CAND];
    float exit_cand_logits[LLAMA_SPECEE_MAX_CAND]; // of the layer a head-free exit left at

    llama_specee_token_info info = {};
    bool    info_cand_read = false;
    int64_t t_graph_start  = 0;

    // a host copy of output.weight for the probes' rows, where the model's own cannot serve (set_lm_rows)
    ggml_context_ptr        lm_rows_ctx;
    ggml_backend_buffer_ptr lm_rows_buf;

    ggml_context_ptr          draft_ctx;
    ggml_backend_buffer_ptr   draft_buf;
    llm_graph_specee_draft    draft;
    uint64_t n_drafts_set = 0; // set_draft calls so far: each draft's generation
    int32_t rows_kept = 0; // output rows of the last multi-row graph in draft.h_rows (0: none)

    // the caller's candidates for the next single-token graph, and the inputs that merge them
    std::vector<int32_t> draft_row;    // [n_vocab] a target id's row in the draft head, -1 if none
    std::vector<float>   lookup_mask;  // [n_draft_vocab] all zero between uses
    std::array<llama_token, LLAMA_SPECEE_MAX_CAND> lookup;
    int32_t n_lookup = 0;

    std::vector<float> head_logits; // [n_vocab] exit logits of head_layer, read when needed
    int32_t head_layer   = -1;      // whose logits the head computed (-1: none this step)
    int32_t hidden_layer = -1;      // whose hidden state the head's input holds (-1: none this step)
    bool    head_on_host = false;   // head_logits holds head_layer's logits

    ggml_context_ptr       head_ctx;
    ggml_backend_sched_ptr head_sched;
    ggml_cgraph * head_gf     = nullptr;
    ggml_tensor * head_inp    = nullptr;
    ggml_tensor * head_out    = nullptr;
    ggml_tensor * head_argmax_t = nullptr;

    // fill mode: K/V of the skipped layers from the exit hidden state, one graph per exit layer
    struct fill_graph {
        ggml_context_ptr       ctx;
        ggml_backend_sched_ptr sched;
        ggml_cgraph * gf      = nullptr;
        ggml_tensor * inp_pos = nullptr;
        std::array<ggml_tensor *, 2> k_idxs = {}; // per cache
        std::array<ggml_tensor *, 2> v_idxs = {};
    };
    std::vector<fill_graph> fill_graphs; // [n_layer]
};
