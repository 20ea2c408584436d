#pragma once

// specee: per-layer early exit for single-token decodes (speculative early exiting, SpecEE)
//
// After a decoder layer l, a "probe" computes the logits of up to LLAMA_SPECEE_MAX_CAND candidate
// tokens: final_norm(h_l) times the candidates' rows of the LM head. The probe callback sees them and
// answers continue or stop. After a stop, llama_get_logits returns final_norm(h_l) through the full
// LM head (the "exit logits"), llama_specee_exit_layer returns l, and llama_specee_resume runs the
// rest of the token's layers without recomputing layers <= l.
//
// The K/V of the layers a stopped token skipped are handled per context (llama_specee_kv_mode); in
// every mode a cell records the depth its K/V reached and deeper layers mask it until it is complete,
// so stale or zero K/V is never attended to.
//
// Multi-token batches (prompt processing) never stop: probes are only built into single-token graphs.
//
// Two ways to decide: the native path (a draft head proposes the candidates inside the graph, each
// probed layer's predictor runs in C, and a positive prediction is verified by the exit head's argmax)
// or a probe callback (called once per active probe; it overrides the native predictors).
// A single-token graph holds probes only while some active probe layer can decide (a predictor or a
// callback), and the per-layer depth mask only while a cell of the cache is shallow: with nothing
// asked, graphs are the stock ones.

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLAMA_SPECEE_MAX_CAND 8

enum llama_specee_kv_mode {
    LLAMA_SPECEE_KV_MASK = 0, // deeper layers mask the cell (the SpecEE paper's choice)
    LLAMA_SPECEE_KV_FULL = 1, // the skipped layers run at the next decode (exact)
    LLAMA_SPECEE_KV_FILL = 2, // the exit hidden state goes through each skipped layer's attention
                              // norm, K/V projections and RoPE into the cache (no attention, no FFN)
};

// called once per active probe with the candidate logits; return true to stop the forward pass here
typedef bool (*llama_specee_probe_callback)(int32_t il, const float * cand_logits, int32_t n_cand, void * user_data);

// what the last single-token decode did (llama_specee_get_token_info)
struct llama_specee_token_info {
    int32_t exit_layer;                       // -1: every layer ran
    int32_t n_probes;                         // predictors evaluated (native path)
    int32_t n_verify_fail;                    // positive predictions whose exit top-1 was not a candidate
    int32_t n_cand;
    llama_token cand[LLAMA_SPECEE_MAX_CAND];  // the candidates of this step, best first
    int64_t t_draft_us;                       // graph start to the draft's candidates (with timing on)
    int64_t t_predictor_us;                   // features and MLPs
    int64_t t_verify_us;                      // exit heads run for verification
    int32_t graph_probes;                     // what the step's graph held: probes,
    int32_t graph_draft;                      // the draft head (1) or input candidates (0),
    int32_t graph_depth_mask;                 // and the per-layer depth bias (1) or not (0)
};

// 1 if the model's architecture supports early exit, 0 otherwise
LLAMA_API int32_t llama_specee_supported(const struct llama_model * model);

// enable early exit on a context with n_cand candidates per token (1..LLAMA_SPECEE_MAX_CAND);
// this builds probes after every layer but the last into single-token graphs.
// returns 0 on success, -1 for an unsupported architecture, -2 for a bad n_cand or kv_mode, -3 for an
// unsupported context (several sequences or streams), -4 when the model's layers cannot be filled
// (LLAMA_SPECEE_KV_FILL needs separate K/V projections without scales or K/Q norm variants)
LLAMA_API int32_t llama_specee_enable(struct llama_context * ctx, int32_t n_cand, enum llama_specee_kv_mode kv_mode);

// layers whose probe calls the callback (the others are computed but not looked at); n = 0 clears
// returns 0, or -1 when a layer is out of [0, n_layer - 1)
LLAMA_API int32_t llama_specee_set_probe_layers(struct llama_context * ctx, const int32_t * layers, int32_t n);

// candidate token ids for the next single-token decode; returns 0, or -1 for a bad count or id
LLAMA_API int32_t llama_specee_set_candidates(struct llama_context * ctx, const llama_token * ids, int32_t n);

LLAMA_API void    llama_specee_set_callback(struct llama_context * ctx, llama_specee_probe_callback cb, void * user_data);

// within the probe callback: the full-vocabulary logits of the probed layer (n_vocab floats, owned
// by the context, valid until the next call); reused as the token's logits if the callback stops
LLAMA_API const float * llama_specee_probe_logits(struct llama_context * ctx);

// the draft head, run at the start of every single-token graph while probes are active; its top-k
// become the candidates (llama_specee_set_candidates is then ignored). Matrices are row-major float32
// [n_out][n_in], stored as `type` (F32, F16, Q8_0, Q4_0) on the backend of the first device:
//   g = w_embd . emb(token) + w_hidden . (rms_norm(h_prev, eps) * norm) + bias      (all [n_embd])
//   candidates = vocab_map[top-k(head . g)]                                          head: [n_draft_vocab][n_embd]
// h_prev is the hidden state the previous step left with (its exit layer, else the last layer).
// returns 0, -1 without early exit, -2 for bad sizes, ids or type
LLAMA_API int32_t llama_specee_set_draft(struct llama_context * ctx, int32_t type, int32_t n_draft_vocab,
        const float * w_embd, const float * w_hidden, const float * bias, const float * norm, float eps,
        const float * head, const int32_t * vocab_map);

// candidates proposed by the caller for the next single-token decode only (e.g. prompt-lookup n-grams,
// which need the token history the caller has): they take the first n slots and the draft head fills
// the others with its best tokens that are not among them, so the candidates never repeat an id.
// They enter the graph as inputs: nothing is decided on the host between layers.
// returns 0, -1 without early exit or a draft head, -2 for n outside [0, n_cand], bad or repeated ids
LLAMA_API int32_t llama_specee_set_lookup(struct llama_context * ctx, const llama_token * ids, int32_t n);

// the exit predictor of layer il, over the 3*n_cand features [z, softmax(z), softmax(z) - p_prev]
// (z: the probe's candidate logits; p_prev: softmax of the previous probed layer of the same token,
// zeros at the first): n_dense linear layers, ReLU between, a sigmoid out; dims[0] = 3*n_cand,
// dims[n_dense] = 1; params holds, per layer j, weight [dims[j+1]][dims[j]] row-major then bias.
// The token stops at il when the sigmoid exceeds threshold and the exit logits' top-1 is a candidate.
// n_dense = 0 removes the predictor. returns 0, -1 without early exit or for a bad layer, -2 for bad dims
LLAMA_API int32_t llama_specee_set_predictor(struct llama_context * ctx, int32_t il, int32_t n_dense,
        const int32_t * dims, const float * params, float threshold);
LLAMA_API int32_t llama_specee_set_threshold(struct llama_context * ctx, int32_t il, float threshold);

// layer il's predictor on the given 3*n_cand features (what the native path computes): its sigmoid
// output, or -1 when the layer has none
LLAMA_API float   llama_specee_predictor_prob(struct llama_context * ctx, int32_t il, const float * features);

// time the draft inside the graph (costs one extra scheduler split per token)
LLAMA_API void    llama_specee_set_timing(struct llama_context * ctx, bool on);

// what the last single-token decode did; inside a probe callback, the current step so far
LLAMA_API int32_t llama_specee_get_token_info(struct llama_context * ctx, struct llama_specee_token_info * info);

// layer at which the last decode (or resume) stopped, or -1 if it ran every layer
LLAMA_API int32_t llama_specee_exit_layer(const struct llama_context * ctx);

// run the remaining layers of the last stopped token, probes still active
// returns 0 on success, 1 if there is nothing to resume, < 0 on error
LLAMA_API int32_t llama_specee_resume(struct llama_context * ctx);

// record the output hidden state (before the final norm) of these layers in every decode
LLAMA_API int32_t llama_specee_set_capture_layers(struct llama_context * ctx, const int32_t * layers, int32_t n);

// hidden states of layer il recorded by the last decode: n_rows x n_embd floats, or NULL
LLAMA_API const float * llama_specee_get_capture(const struct llama_context * ctx, int32_t il, int32_t * n_rows);

// depth (last computed layer) recorded for the cell holding position pos of seq_id, -1 if none
LLAMA_API int32_t llama_specee_cell_depth(struct llama_context * ctx, llama_seq_id seq_id, llama_pos pos);

#ifdef __cplusplus
}
#endif
