"""Exact attention (`mlx_spec.exact`) for mlx-lm's attention modules that compute attention themselves
rather than through mlx-lm's `scaled_dot_product_attention` (which `exact.sdpa` replaces): each module
runs as mlx-lm writes it, and in a forward that verifies exactly, as written here."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.exact import EXACTLY, blocks, over_keys, products


def _exact_when_asked(attention: nn.Module, exact_call) -> None:
    """`attention` running `exact_call` in a forward that verifies exactly, its own call otherwise."""
    cls = type(attention)

    def call(self, x: mx.array, mask=None, cache=None) -> mx.array:
        return (exact_call if EXACTLY.get() else cls.__call__)(self, x, mask, cache)

    attention.__class__ = type(cls.__name__, (cls,), {"__call__": call})


def _gemma2(self, x: mx.array, mask, cache) -> mx.array:
    """Gemma 2's attention: its scores soft-capped."""
    B, L, _ = x.shape
    heads = ((self.q_proj, self.n_heads), (self.k_proj, self.n_kv_heads), (self.v_proj, self.n_kv_heads))
    q, k, v = (p(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in heads)
    q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    out = over_keys(q, k, v, self.scale, mask, softcap=self.attn_logit_softcapping)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _latent_qk(self, q: mx.array, x: mx.array, cache) -> tuple[mx.array, mx.array, mx.array]:
    """DeepSeek's multi-head latent attention, absorbed as mlx-lm decodes one token: each query meets the
    latent keys as the cache holds them (mlx-lm's many-token path recomputes every key from its latent in
    a product over the whole context, whose rows BLAS tiles by the context's length). From the queries'
    projection `q` `[B, L, H (nope + R)]`: the queries `[B, H, L, r + R]`, the keys `[B, 1, n, r + R]`
    (scale (q_nope W_k^T) . latent + scale q_pe . k_pe in one product) and the latents `[B, 1, n, r]`."""
    B, L, _ = x.shape
    q_nope, q_pe = mx.split(q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3),
                            [self.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
    k_pe = self.rope(k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3), cache.offset)
    q_pe = self.rope(q_pe, cache.offset)
    latent, k_pe = cache.update_and_fetch(self.kv_a_layernorm(latent)[:, None], k_pe)  # [B, 1, n, r], [B, 1, n, R]
    return mx.concatenate([self.embed_q(q_nope), q_pe], axis=-1), mx.concatenate([latent, k_pe], axis=-1), latent


def _latent_out(self, q: mx.array, k: mx.array, latent: mx.array, mask) -> mx.array:
    B, _, L, _ = q.shape
    out = over_keys(q, k, latent, self.scale, mask)  # [B, H, L, r]
    return self.o_proj(self.unembed_out(out).transpose(0, 2, 1, 3).reshape(B, L, -1))


def _latent(self, x: mx.array, mask, cache) -> mx.array:
    """DeepSeek-V3's attention (`_latent_qk`)."""
    q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    return _latent_out(self, *_latent_qk(self, q, x, cache), mask)


def _chosen(indexer: nn.Module, x: mx.array, qr: mx.array, mask, cache) -> mx.array | None:
    """DeepSeek-V3.2's indexer (mlx-lm's `Indexer`): the keys each query attends to `[B, 1, L, top-k]` (None:
    all), its scores each query's own products over whole blocks of keys (`exact.products`), so a query's
    pick is the same whatever forward it sits in."""
    B, L, _ = x.shape
    q = indexer.wq_b(qr).reshape(B, L, indexer.n_heads, indexer.head_dim).swapaxes(1, 2)
    k = indexer.k_norm(indexer.wk(x)).reshape(B, 1, L, indexer.head_dim)
    q, k = indexer.rope(q, offset=cache.offset), indexer.rope(k, offset=cache.offset)
    k, _ = cache.update_and_fetch(k, k)  # (its values: copies of the keys, never read)
    n = k.shape[2]
    if n <= indexer.index_topk:
        return None
    width = blocks(n)
    k = mx.pad(k, [(0, 0), (0, 0), (0, width - n), (0, 0)])
    scores = mx.maximum(products(q, k, width), 0).reshape(B, indexer.n_heads, L, width)[..., :n]  # [B, H, L, n]
    weights = indexer.weights_proj(x) * (indexer.n_heads**-0.5 * indexer.softmax_scale)  # [B, L, H]
    scores = scores * weights.swapaxes(-1, -2)[..., None]
    scores = sum(scores[:, h : h + 1] for h in range(indexer.n_heads))  # head after head, as mlx-lm sums them
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return mx.argpartition(scores, kth=-indexer.index_topk, axis=-1)[..., -indexer.index_topk :]


def _indexed(self, x: mx.array, mask, cache) -> mx.array:
    """DeepSeek-V3.2's attention: the latent attention (`_latent_qk`) over the keys its indexer picks."""
    qr = self.q_a_layernorm(self.q_a_proj(x))
    q, k, latent = _latent_qk(self, self.q_b_proj(qr), x, cache[0])
    chosen = _chosen(self.indexer, x, qr, mask, cache[1])
    if chosen is not None:
        picked = mx.put_along_axis(mx.zeros((*chosen.shape[:-1], latent.shape[2]), mx.bool_), chosen,
                                   mx.array(True), axis=-1)
        mask = picked if mask is None else picked & mask
    return _latent_out(self, q, k, latent, mask)


# model_type -> (the class name of its attention modules, their exact call)
OWN = {"gemma2": ("Attention", _gemma2), "deepseek_v3": ("DeepseekV3Attention", _latent),
       "deepseek_v32": ("DeepseekV32Attention", _indexed)}


def own(module: nn.Module, model_type: str) -> None:
    """`module`, where it is one of `model_type`'s attention modules that `OWN` lists, exact when asked."""
    name, exact_call = OWN.get(model_type, (None, None))
    if type(module).__name__ == name:
        _exact_when_asked(module, exact_call)
