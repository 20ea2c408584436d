#pragma once

// specee: the per-context early-exit state behind include/llama-specee.h

#include "llama-specee.h"
#include "llama-graph.h"

#include "ggml-cpp.h"

#include <array>
#include <vector>

struct llama_context;
struct llama_ubatch;
class  llama_kv_cache;

// an exit predictor: dense layers with ReLU between and a sigmoid out, evaluated on the host
struct llama_specee_mlp {
    std::vector<int32_t> dims;   // [n_in, hidden..., 1]
    std::vector<float>   params; // per layer: weight transposed, [in][out] row-major, then bias [out]
    float threshold = 1.0f;

    bool  empty() const { return dims.empty(); }
    float prob(const float * features, std::vector<float> & scratch) const;
};

struct llama_specee {
    llama_specee(llama_context & lctx, int32_t n_cand, llama_specee_kv_mode kv_mode);
    ~llama_specee();

    // the scheduler's eval callback: answers per node in C; decides at each active probe
    static bool eval_callback(ggml_tensor * t, bool ask, void * user_data);

    void before_decode();                                                        // sets the graph knobs
    void begin_graph(llm_graph_result * graph_res, const llama_ubatch & ubatch); // after the inputs are set
    bool end_graph(float * logits_out);                                         // true if the token stopped
    int32_t resume(bool complete);
    const float * probe_logits();

    int32_t set_draft(ggml_type type, int32_t n_draft_vocab, const float * w_embd, const float * w_hidden,
                      const float * bias, const float * norm, float eps, const float * head, const int32_t * vocab_map);
    int32_t set_predictor(int32_t il, int32_t n_dense, const int32_t * dims, const float * params, float threshold);
    int32_t set_lookup(const llama_token * ids, int32_t n);
    int32_t set_threshold(int32_t il, float threshold);
    void    fill_token_info(llama_specee_token_info & out);

    // the unified caches behind the context's memory: one, or an iSWA memory's base and window caches
    static std::vector<llama_kv_cache *> caches_of(const llama_context & lctx);

    // what the graph builder needs (nullptr: nothing of the kind in the next graph)
    const llm_graph_specee_draft * graph_draft() const;
    const uint8_t * graph_probed() const;

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

    llama_specee_probe_callback cb = nullptr;
    void * cb_user_data = nullptr;
    bool timing = false;

    int32_t exit_layer = -1; // where the last decode or resume stopped

private:
    bool probes_wanted() const;
    bool decides(int32_t il) const { return probe_active[il] && (cb || !predictors[il].empty()); }
    bool predict_and_verify(int32_t il);
    int32_t head_argmax(int32_t il);
    const llama_token * step_candidates();
    void record_capture(ggml_tensor * t, int32_t il);
    void build_head();
    void compute_head(int32_t il);
    bool fill(int32_t exit_layer);
    size_t cache_index(int32_t il) const; // which of `caches` holds layer il's K/V
    void set_depth(int32_t depth); // of the token's cell, in every cache

    // the graph being computed and its token
    llm_graph_result * res = nullptr;
    llama_seq_id seq_id = 0;
    llama_pos    pos    = 0;
    bool         single = false; // a single-token graph

    int32_t stop_layer   = -1;    // set by the callback when it stops
    int32_t probed_layer = -1;    // the probe being looked at by the callback
    bool    completing   = false; // running the rest of a stopped token: probes are off

    float cand_logits[LLAMA_SPECEE_MAX_CAND];

public:
    std::vector<llama_specee_mlp> predictors; // [n_layer], empty where there is none

private:
    std::vector<uint8_t> probed;              // [n_layer]: layers whose graphs get a probe
    std::vector<float> features;              // [3*n_cand]
    std::vector<float> mlp_scratch;
    std::array<float, LLAMA_SPECEE_MAX_CAND> prev_probs;
    bool have_prev = false;

    llama_specee_token_info info = {};
    bool    info_cand_read = false;
    int64_t t_graph_start  = 0;

    ggml_context_ptr          draft_ctx;
    ggml_backend_buffer_ptr   draft_buf;
    llm_graph_specee_draft    draft;
    bool has_draft = false;

    // the caller's candidates for the next single-token graph, and the inputs that merge them
    void set_lookup_inputs();
    std::vector<int32_t> draft_row;    // [n_vocab] a target id's row in the draft head, -1 if none
    std::vector<float>   lookup_mask;  // [n_draft_vocab] all zero between uses
    std::array<llama_token, LLAMA_SPECEE_MAX_CAND> lookup;
    int32_t n_lookup = 0;

public:
    std::vector<std::vector<float>> capture; // [n_layer][rows*n_embd]
    std::vector<int32_t> capture_rows;

private:
    std::vector<float> head_logits; // [n_vocab] exit logits of head_layer, read when needed
    int32_t head_layer  = -1;
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
