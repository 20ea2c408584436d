#pragma once

// specee: per-layer early exit for single-token decodes (speculative early exiting, SpecEE)
//
// After a decoder layer l, a "probe" computes the logits of up to LLAMA_SPECEE_MAX_CAND candidate
// tokens: final_norm(h_l) times the candidates' rows of the LM head. A probe after the last layer sees
// the same candidates' logits the output head would give them. Each probed layer's predictor (or a probe
// callback) decides whether the token leaves there, and how:
//   verified:  the exit head (final_norm(h_l) through the full LM head) runs; the token leaves only if
//              its top-1 is a candidate, with those full-vocabulary logits as the step's logits;
//   head-free: the token leaves at once with the candidates' logits as the step's logits (every other
//              token -INFINITY), and no full-vocabulary head runs at all. After the last layer this
//              skips the output head of a token that ran every layer.
// llama_specee_exit_layer returns l, llama_specee_resume runs the rest of the token's layers without
// recomputing layers <= l, and llama_specee_exit_head_logits gives the full-vocabulary logits of a
// head-free exit on demand.
//
// The K/V of the layers a stopped token skipped are handled per context (llama_specee_kv_mode); in
// every mode a cell records the depth its K/V reached and deeper layers mask it until it is complete,
// so stale or zero K/V is never attended to.
//
// Multi-token batches (prompt processing) never stop: probes are only built into single-token graphs.
//
// Two ways to decide: the native path (a draft head proposes the candidates inside the graph, each
// probed layer's predictor runs in C) or a probe callback (called once per active probe; it overrides
// the native predictors). A single-token graph holds probes only while some active probe layer can
// decide, the per-layer depth mask only while a cell of the cache is shallow, and the scheduler gets
// an eval callback only while a probe, a capture or a timing asks for one: with nothing asked, graphs
// and their computation are the stock ones.

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

#define LLAMA_SPECEE_MAX_CAND 8
#define LLAMA_SPECEE_MAX_ROWS 64 // output rows of a batch that llama_specee_draft_from_row can pick from

enum llama_specee_kv_mode {
    LLAMA_SPECEE_KV_MASK = 0, // deeper layers mask the cell (the SpecEE paper's choice)
    LLAMA_SPECEE_KV_FULL = 1, // the skipped layers run at the next decode (exact)
    LLAMA_SPECEE_KV_FILL = 2, // the exit hidden state goes through each skipped layer's attention
                              // norm, K/V projections and RoPE into the cache (no attention, no FFN)
};

// how a layer's positive prediction lets the token leave (see above); also what a probe callback returns
enum llama_specee_exit_kind {
    LLAMA_SPECEE_EXIT_NONE      = 0, // the layer never exits (callback: go on)
    LLAMA_SPECEE_EXIT_VERIFIED  = 1, // the exit head's top-1 must be a candidate (callback: stop with the exit head)
    LLAMA_SPECEE_EXIT_HEAD_FREE = 2, // the candidates' logits are the step's (callback: stop without a head)
};

// called once per active probe with the candidate logits; returns an llama_specee_exit_kind:
// NONE goes on, VERIFIED stops with the layer's exit head (whatever its top-1), HEAD_FREE stops without one
typedef int32_t (*llama_specee_probe_callback)(int32_t il, const float * cand_logits, int32_t n_cand, void * user_data);

// what the last single-token decode did (llama_specee_get_token_info)
struct llama_specee_token_info {
    int32_t exit_layer;                       // -1: every layer ran and the output head gave the logits
    int32_t exit_kind;                        // llama_specee_exit_kind of the exit (NONE without one)
    int32_t n_probes;                         // predictors evaluated (native path)
    int32_t n_verify_fail;                    // positive predictions whose exit top-1 was not a candidate
    int32_t n_heads;                          // full-vocabulary heads run: exit heads and the output head
    int32_t n_cand;                           // 0 when the step's graph had no candidates
    llama_token cand[LLAMA_SPECEE_MAX_CAND];  // the candidates of this step, best first
    int64_t t_draft_us;                       // graph start to the draft's candidates (with timing on)
    int64_t t_predictor_us;                   // features and MLPs
    int64_t t_verify_us;                      // exit heads run for verification
    int32_t graph_probes;                     // what the step's graph held: probes (the last layer's included),
    int32_t graph_draft;                      // the draft head (1) or input candidates (0),
    int32_t graph_depth_mask;                 // the per-layer depth bias (1) or not (0),
    int32_t graph_eval_callback;              // and whether the scheduler called back per node (1) or not (0)
};

// what the exit rule decided over a sequence of checks (llama_specee_decide)
struct llama_specee_decision {
    int32_t exit_layer;    // -1: no exit
    int32_t exit_kind;     // llama_specee_exit_kind
    int32_t n_probes;      // checks evaluated
    int32_t n_verify_fail; // verified positives whose check failed
};

// 1 if the model's architecture supports early exit, 0 otherwise
LLAMA_API int32_t llama_specee_supported(const struct llama_model * model);

// the device that runs layer il of the model (n_layer: the output layer), as ggml names it ("CPU", "CUDA0",
// "RPC[host:port]", ...), or NULL for a layer out of [0, n_layer]. Follows -ngl and the placement key
// specee.offload_first (SpecEE's: the first layers on the devices)
LLAMA_API const char * llama_specee_layer_device(const struct llama_model * model, int32_t il);

// the i-th architecture early exit supports: its llama.cpp name and whether its LM head's logits are
// soft-capped; returns 0, or -1 past the end of the table
LLAMA_API int32_t llama_specee_arch(int32_t i, const char ** name, int32_t * softcap);

// enable early exit on a context with n_cand candidates per token (1..LLAMA_SPECEE_MAX_CAND).
// returns 0 on success, -1 for an unsupported architecture, -2 for a bad n_cand or kv_mode, -3 for an
// unsupported context (several sequences or streams), -4 when the model's layers cannot be filled
// (LLAMA_SPECEE_KV_FILL needs separate K/V projections without scales or K/Q norm variants)
LLAMA_API int32_t llama_specee_enable(struct llama_context * ctx, int32_t n_cand, enum llama_specee_kv_mode kv_mode);

// layers whose probe may decide (the schedule), the last layer included; n = 0 clears
// returns 0, or -1 when a layer is out of [0, n_layer)
LLAMA_API int32_t llama_specee_set_probe_layers(struct llama_context * ctx, const int32_t * layers, int32_t n);

// candidate token ids for the next single-token decode; returns 0, or -1 for a bad count or id
LLAMA_API int32_t llama_specee_set_candidates(struct llama_context * ctx, const llama_token * ids, int32_t n);

LLAMA_API void    llama_specee_set_callback(struct llama_context * ctx, llama_specee_probe_callback cb, void * user_data);

// within the probe callback: the full-vocabulary logits of the probed layer (n_vocab floats, owned
// by the context, valid until the next call), or NULL if the exit head could not be allocated;
// reused as the token's logits if the callback stops with VERIFIED
LLAMA_API const float * llama_specee_probe_logits(struct llama_context * ctx);

// after a head-free exit: the full-vocabulary logits of the exit layer, computed now (the step skipped
// them); after a verified exit: the step's logits. NULL without an exit, or if the head could not be
// allocated. Valid until the next decode.
LLAMA_API const float * llama_specee_exit_head_logits(struct llama_context * ctx);

// the draft head, run at the start of every single-token graph while probes are active; its top-k
// become the candidates (llama_specee_set_candidates is then ignored). Matrices are row-major float32
// [n_out][n_in], stored as `type` (F32, F16, Q8_0, Q4_0) on the backend of the first device:
//   g = w_embd . emb(token) + w_hidden . (rms_norm(h_prev, eps) * norm) + bias      (all [n_embd])
//   candidates = vocab_map[top-k(head . g)]                                          head: [n_draft_vocab][n_embd]
// h_prev is the hidden state the previous step left with (its exit layer, else the last layer); it
// starts at zero. A token still waiting for its remaining layers (full mode) completes first.
// returns 0, -1 without early exit, -2 for bad sizes, type, or ids (out of range or repeated)
LLAMA_API int32_t llama_specee_set_draft(struct llama_context * ctx, int32_t type, int32_t n_draft_vocab,
        const float * w_embd, const float * w_hidden, const float * bias, const float * norm, float eps,
        const float * head, const int32_t * vocab_map);

// candidates proposed by the caller for the next single-token decode only (e.g. prompt-lookup n-grams,
// which need the token history the caller has): they take the first n slots and the draft head fills
// the others with its best tokens that are not among them, so the candidates never repeat an id.
// They enter the graph as inputs: nothing is decided on the host between layers.
// returns 0, -1 without early exit or a draft head, -2 for n outside [0, n_cand], bad or repeated ids
LLAMA_API int32_t llama_specee_set_lookup(struct llama_context * ctx, const llama_token * ids, int32_t n);

// The LM-head rows the probes read (ggml_get_rows) where the model's own output head cannot give them:
// a weight in a layout that only matrix products read (ggml-cpu's repacked Q4_0, IQ4_NL, Q4_K, ... on
// AVX2/AVX-512 and ARM CPUs) takes no get_rows on any backend. A model whose output head is its token
// embedding (tied) reads the embedding's own copy (llama.cpp keeps one for the input); an untied one
// needs a plain copy of output.weight, which the caller reads from the GGUF. Until it is set, single-
// token graphs of such a model hold no probes and no draft.
// llama_specee_lm_rows_size: the bytes of output.weight to hand over (its GGML type in *type), 0 when the
// model's own rows serve (or without early exit)
LLAMA_API size_t  llama_specee_lm_rows_size(const struct llama_context * ctx, int32_t * type);
// data: output.weight as the GGUF holds it (its type, [n_embd, n_vocab]), copied to a host buffer;
// returns 0, -1 when no copy is needed, -2 for another type or size, -3 when the buffer cannot be allocated
LLAMA_API int32_t llama_specee_set_lm_rows(struct llama_context * ctx, int32_t type, const void * data, size_t size);

// the exit predictor of layer il (the last layer included), over the 3*n_cand features
// [z, softmax(z), softmax(z) - p_prev] (z: the probe's candidate logits; p_prev: softmax of the
// previous probed layer of the same token, zeros at the first): n_dense linear layers, ReLU between, a
// sigmoid out; dims[0] = 3*n_cand, dims[n_dense] = 1; params holds, per layer j, weight
// [dims[j+1]][dims[j]] row-major then bias. A new predictor's exit is NONE until llama_specee_set_exit.
// n_dense = 0 removes the predictor. returns 0, -1 without early exit or for a bad layer, -2 for bad dims
LLAMA_API int32_t llama_specee_set_predictor(struct llama_context * ctx, int32_t il, int32_t n_dense,
        const int32_t * dims, const float * params);

// how layer il's predictor lets a token leave: when its sigmoid exceeds threshold, a VERIFIED exit
// runs the exit head and leaves if its top-1 is a candidate; a HEAD_FREE exit leaves at once with the
// candidates' logits; NONE turns the layer off (no probe in the graph). VERIFIED is refused on the
// last layer (its exit head is the output head). returns 0, -1 for a layer without a predictor, -2 for a bad kind
LLAMA_API int32_t llama_specee_set_exit(struct llama_context * ctx, int32_t il, enum llama_specee_exit_kind kind, float threshold);

// layer il's predictor on the given 3*n_cand features (what the native path computes): its sigmoid
// output, or -1 when the layer has none
LLAMA_API float   llama_specee_predictor_prob(struct llama_context * ctx, int32_t il, const float * features);

// the exit rule the native path runs, on given inputs: checks of layers[0..n) in order, with
// cand_logits[i*n_cand .. +n_cand] the i-th check's candidate logits and verified[i] whether that
// layer's exit head would put a candidate first; uses the context's predictors and exits. returns 0,
// -1 without early exit, for a layer out of range or a NULL array
LLAMA_API int32_t llama_specee_decide(struct llama_context * ctx, int32_t n, const int32_t * layers,
        const float * cand_logits, const uint8_t * verified, struct llama_specee_decision * out);

// time the draft inside the graph (costs one extra scheduler split per token)
LLAMA_API void    llama_specee_set_timing(struct llama_context * ctx, bool on);

// what the last single-token decode did; inside a probe callback, the current step so far
LLAMA_API int32_t llama_specee_get_token_info(struct llama_context * ctx, struct llama_specee_token_info * info);

// layer at which the last decode (or resume) stopped, or -1 if it ran every layer and the output head
LLAMA_API int32_t llama_specee_exit_layer(const struct llama_context * ctx);

// run the remaining layers of the last stopped token (after a head-free stop at the last layer: the
// output head), probes still active; returns 0 on success, 1 if there is nothing to resume, < 0 on error
LLAMA_API int32_t llama_specee_resume(struct llama_context * ctx);

// after a batch of 2..LLAMA_SPECEE_MAX_ROWS output rows (e.g. every token's logits) run with probes
// wanted: make output row `row`'s last-layer hidden state the next draft's h_prev, instead of the last
// row's. Exact mode keeps the prefix of a verification batch that the full model accepts and drafts on
// from its last token. The rows survive llama_specee_forget, so the cache can be truncated to that prefix
// first; any other graph makes them stale. returns 0, -1 without a draft head, -2 when the last graph
// kept no such row
LLAMA_API int32_t llama_specee_draft_from_row(struct llama_context * ctx, int32_t row);

// forget what the early-exit state carries from token to token: the draft's previous hidden state
// (zero again) and a stopped token still waiting for its remaining layers (full mode). Call it when
// the cache is cleared or truncated: the next step must not read the old conversation.
LLAMA_API void    llama_specee_forget(struct llama_context * ctx);

// record the output hidden state (before the final norm) of these layers in every decode
LLAMA_API int32_t llama_specee_set_capture_layers(struct llama_context * ctx, const int32_t * layers, int32_t n);

// hidden states of layer il recorded by the last decode: n_rows x n_embd floats, or NULL
LLAMA_API const float * llama_specee_get_capture(const struct llama_context * ctx, int32_t il, int32_t * n_rows);

// depth (last computed layer) recorded for the cell holding position pos of seq_id, -1 if none
LLAMA_API int32_t llama_specee_cell_depth(struct llama_context * ctx, llama_seq_id seq_id, llama_pos pos);

// testing: make the next n allocations of the exit head and fill graphs fail, as an out-of-memory
// would (verification then rejects, fill falls back to recording the cell's depth)
LLAMA_API void    llama_specee_fail_allocations(struct llama_context * ctx, int32_t n);

#ifdef __cplusplus
}
#endif
