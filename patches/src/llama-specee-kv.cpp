// specee: the K/V of the layers a stopped token skipped (see llama_specee_kv_mode)

#include "llama-specee-impl.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-model.h"

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

// fill recomputes K/V the way the supported architectures build them; anything else is refused
bool llama_specee::can_fill(const llama_context & lctx) {
    const auto & model = lctx.get_model();
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
    for (const auto * cache : caches_of(lctx)) {
        if (cache->build_input_k_rot(tmp.get()) || cache->build_input_v_rot(tmp.get())) {
            return false;
        }
    }
    return true;
}

// fill mode: the exit hidden state stands in for the input of every skipped layer: attention norm,
// K/V projections (with biases, the per-head K norm of qwen3 and gemma3) and RoPE at the layer's
// frequency, written into the token's cell of the cache that holds the layer (iSWA: the window
// cache for window layers). head_inp holds h_exit (keep_exit_hidden ran first). The graph of each exit
// layer is built once. Returns false if the cell is gone from a cache or the graph cannot be allocated:
// the caller then records the cell's depth, as mask mode does.
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
        if (alloc_fails() || !ggml_backend_sched_alloc_graph(fg.sched.get(), fg.gf)) {
            LLAMA_LOG_WARN("%s: cannot allocate the fill graph of layer %d: the cell is masked instead\n", __func__, exit_layer);
            fg = {};
            return false;
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
