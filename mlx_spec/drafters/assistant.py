"""Gemma 4 assistants (`google/gemma-4-*-it-assistant`): a drafter with no cache of its own.

Each of its layers is a Gemma 4 layer with queries only: it attends to the
target's keys and values, those of the target's last layer of the same type
(sliding or full) that computes its own. A draft step reads the target's
embedding of the last token beside a hidden state, and gives the next token and
the next hidden state:

    x = pre_projection(concat(target_embed(tok), h))      # [B, 1, 2 * H_target] -> H
    x = norm(layers(x, target's keys and values))         # every step at one position
    logits = head(x);  h = post_projection(x)             # -> H_target, the next step's h

The first step's h is the target's last hidden state (after its final norm) at
the token before the pending one; the pending token is `tok`. Every step's
query sits at that state's position and sees the target's keys up to it (a
sliding layer, those less than its window behind), as vLLM and mlx-vlm place
it. The head is the tied embedding, or for E2B/E4B a centroid head
(`use_ordered_embeddings`): the 2048 centroids' best 32 clusters name the
tokens that get a logit; every other token gets the least of those minus one
(transformers' `Gemma4AssistantMaskedEmbedder`).

The drafts are drawn from these logits and verified by rejection sampling, so
sampled output keeps the target's distribution; greedy output is the target's.
A folder as Google publishes it loads as it is (config `gemma4_assistant`,
`text_config` a Gemma 4 text config); the layers are mlx-lm's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.drafters.base import EMPTY, Draft, Kind, Options, RowStates, draw_rows
from mlx_spec.errors import UserError
from mlx_spec.models.load import load_folder
from mlx_spec.sampling import SamplingParams

TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
TARGETS = ("gemma4_text", "gemma4")


def text_args(config: dict, where: str):
    """The assistant's layers' shape, as mlx-lm's Gemma 4 reads it: every layer shares its keys and values."""
    from mlx_lm.models import gemma4_text

    from mlx_spec.models.config import mlx_lm_config

    if config.get("model_type") not in TYPES:
        raise UserError(f"{where}: model_type must be one of {', '.join(TYPES)}, got {config.get('model_type')!r}")
    text = config.get("text_config")
    if not isinstance(text, dict) or "hidden_size" not in text or "num_hidden_layers" not in text:
        raise UserError(f"{where}: text_config must be a Gemma 4 text config (hidden_size, num_hidden_layers, ...)")
    for field in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
        if text.get(field):
            raise UserError(f"{where}: text_config.{field} must be 0 or false in an assistant, got {text[field]!r}")
    n = int(text["num_hidden_layers"])
    if text.get("num_kv_shared_layers", n) not in (0, n, None):
        raise UserError(f"{where}: text_config.num_kv_shared_layers must be num_hidden_layers ({n}): "
                        "every layer of an assistant reads the target's keys and values")
    fields = mlx_lm_config({**text, "model_type": "gemma4_text", "num_kv_shared_layers": n,
                            "hidden_size_per_layer_input": 0})
    try:
        return gemma4_text.ModelArgs.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: text_config: {e}") from None


class CentroidHead(nn.Module):
    """E2B/E4B's head: logits for the tokens of the best clusters only (see the module docstring)."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.centroids = nn.Linear(hidden, centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)  # cluster c's tokens: a run of vocab / centroids

    def __call__(self, x: mx.array, table: mx.array) -> mx.array:
        """x `[B, S, H]`, the embedding table `[V, H]` -> logits `[B, S, V]`."""
        B, S, _ = x.shape
        n = self.centroids.weight.shape[0]
        best = mx.argpartition(-self.centroids(x), self.top_k - 1, axis=-1)[..., : self.top_k]  # [B, S, k]
        ids = self.token_ordering.reshape(n, -1)[best].reshape(B, S, -1)  # [B, S, k * V / n]
        picked = (x[..., None, :] @ table[ids].swapaxes(-1, -2))[..., 0, :]  # [B, S, k * V / n]
        floor = picked.min(axis=-1, keepdims=True) - 1
        out = mx.broadcast_to(floor, (B, S, self.token_ordering.shape[0]))
        return mx.put_along_axis(out, ids, picked, axis=-1)


class AssistantNet(nn.Module):
    """The assistant's weights, named as published (`model.layers.*`, `pre_projection`, ...)."""

    def __init__(self, config: dict, where: str = "config.json"):
        super().__init__()
        from mlx_lm.models.gemma4_text import DecoderLayer

        args = text_args(config, where)
        H, V = args.hidden_size, args.vocab_size
        self.window = args.sliding_window
        self.backbone = int(config.get("backbone_hidden_size") or 0)
        if self.backbone <= 0:
            raise UserError(f"{where}: backbone_hidden_size (the target's hidden size) must be a positive integer")
        self.tied = bool(config.get("tie_word_embeddings", True))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.model.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * self.backbone, H, bias=False)
        self.post_projection = nn.Linear(H, self.backbone, bias=False)
        if not self.tied:
            self.lm_head = nn.Linear(H, V, bias=False)
        if config.get("use_ordered_embeddings"):
            n, k = int(config.get("num_centroids", 2048)), int(config.get("centroid_intermediate_top_k", 32))
            if n <= 0 or V % n or not 0 < k <= n:
                raise UserError(f"{where}: num_centroids ({n}) must divide the vocabulary ({V}), and "
                                f"centroid_intermediate_top_k ({k}) be between 1 and it")
            self.masked_embedding = CentroidHead(H, V, n, k)

    def sanitize(self, weights: dict) -> dict:
        """As transformers loads it: a tied head is the embedding, the token order an index, and the
        key and value projections of shared layers (if a file holds them) unused."""
        unused = (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm", ".self_attn.v_norm")
        out = {k: v for k, v in weights.items()
               if not (k == "lm_head.weight" and self.tied) and not any(u in k for u in unused)}
        if "masked_embedding.token_ordering" in out:
            out["masked_embedding.token_ordering"] = out["masked_embedding.token_ordering"].astype(mx.int32)
        return out

    def __call__(self, x: mx.array, kv: dict, masks: dict, offset: mx.array) -> tuple[mx.array, mx.array]:
        """One step: inputs `[B, 1, 2 * H_target]`, the target's keys and values and masks per layer type,
        each row's position `[B]` -> (the normed state `[B, 1, H]`, the next step's hidden `[B, 1, H_target]`)."""
        x = self.pre_projection(x)
        for layer in self.model.layers:
            x, _, _ = layer(x, masks[layer.layer_type], None, shared_kv=kv[layer.layer_type], offset=offset)
        x = self.model.norm(x)
        return x, self.post_projection(x)

    def logits(self, x: mx.array) -> mx.array:
        table = self.lm_head.weight if "lm_head" in self else self.model.embed_tokens.weight  # [V, H]
        return self.masked_embedding(x, table) if "masked_embedding" in self else x @ table.T


def producers(target) -> dict[str, int]:
    """Per layer type, the target cache holding the keys and values of the last layer of that type
    that computes its own (mlx-lm's Gemma 4 keeps one cache per such layer, in layer order)."""
    layers = target.model.layers
    return {layers[i].layer_type: i for i in range(target.caches)}


def check_fits(net: AssistantNet, target, what: str) -> dict[str, int]:
    """The target's caches the assistant's layers read, each checked against the layer's shape."""
    if getattr(target, "model_type", None) not in TARGETS:
        raise UserError(f"{what}: a Gemma 4 assistant drafts for a Gemma 4 model, not "
                        f"{getattr(target, 'model_type', type(target).__name__)}")
    if net.backbone != target.args.hidden_size:
        raise UserError(f"{what}: backbone_hidden_size {net.backbone}, the target's hidden size is "
                        f"{target.args.hidden_size}")
    if net.model.embed_tokens.weight.shape[0] != target.args.vocab_size:
        raise UserError(f"{what}: vocabulary {net.model.embed_tokens.weight.shape[0]}, the target's is "
                        f"{target.args.vocab_size}")
    sources = producers(target)
    for layer in net.model.layers:
        kind = layer.layer_type
        if kind not in sources:
            raise UserError(f"{what}: its {kind} layers read a target layer of that type; the target has none")
        theirs = target.model.layers[sources[kind]].self_attn.head_dim
        if layer.self_attn.head_dim != theirs:
            raise UserError(f"{what}: its {kind} layers' head size is {layer.self_attn.head_dim}, "
                            f"the target's {theirs}")
    return sources


class Assistant(RowStates):
    """Drafts every row's chain together, one step a token, from the target's cache (`bind`):
    the drafter's rows are the cache's rows (one drafter for the batch)."""

    kind = "assistant"
    costly = True

    def __init__(self, net: AssistantNet, target, sources: dict[str, int]):
        self.net, self.target, self.sources = net, target, sources
        super().__init__()
        self.capture = (target.args.num_hidden_layers,)  # the state leaving the last layer (normed when read)
        self.cache: list = []

    def new_row(self) -> dict:
        return {"last": None}  # the target's state at the token before the pending one [1, 1, H_target]

    def _session(self) -> Assistant:
        return Assistant(self.net, self.target, self.sources)

    def bind(self, cache: list, width: int | None = None) -> None:
        self.cache = cache

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        self.last[b] = None
        return min(cached, max(len(prompt) - 2, 0))  # the target reads the token before the pending one again

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        if features and features[0].shape[1]:
            self.last[b] = features[0][:, -1:]

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        ks = [k if h is not None else 0 for k, h in zip(ks, self.last)]
        if max(ks, default=0) == 0:
            return [EMPTY() for _ in ks]
        lengths = self.cache[0].lengths  # row b's keys: its context but the pending token
        if len(lengths) != len(contexts):
            raise ValueError(f"the assistant drafts for {len(contexts)} rows, the target's cache holds {len(lengths)}")
        L = max(lengths)
        kv = {kind: (self.cache[i].keys[..., :L, :], self.cache[i].values[..., :L, :])
              for kind, i in self.sources.items()}
        n = mx.array(lengths)[:, None]  # [B, 1]
        k = mx.arange(L)[None]  # [1, L]
        seen = k < n
        near = seen & (n - 1 - k < self.net.window)
        masks = {"full_attention": seen[:, None, None], "sliding_attention": near[:, None, None]}  # [B, 1, 1, L]
        offset = n[:, 0] - 1  # each row's query at its last key's position
        H = self.target.args.hidden_size
        h = self.target.final_norm(mx.concatenate([x if x is not None else mx.zeros((1, 1, H)) for x in self.last]))
        token = mx.array([c[-1] for c in contexts], dtype=mx.int32)  # [B]
        tokens, dists = [], []
        for _ in range(max(ks)):
            x, h = self.net(mx.concatenate([self.target.embed(token[:, None]), h], axis=-1), kv, masks, offset)
            token, lp = draw_rows(self.net.logits(x)[:, 0], params)  # [B]
            tokens.append(token)
            dists.append(lp)
        return Draft.steps(tokens, dists, ks)


def build(target, o: Options) -> Assistant:
    if o.source is None:
        raise UserError("--drafter assistant: give it as assistant=PATH_OR_REPO (alone: the one published "
                        "for --model)")
    net, _, _ = load_folder(o.source, o.revision, AssistantNet)
    return Assistant(net, target, check_fits(net, target, f"--drafter {o.spec}"))


# Google's assistants, and mlx-community's copies, for each instruction-tuned Gemma 4 (and its conversions).
PUBLISHED = {f"google/gemma-4-{size}-it": (f"google/gemma-4-{size}-it-assistant",
                                           f"mlx-community/gemma-4-{size}-it-assistant-bf16")
             for size in ("E2B", "E4B", "26B-A4B", "31B")}
KINDS = (Kind("assistant", "a Gemma 4 assistant (Google's MTP drafter): a few query-only layers reading the "
              "target's keys and values", build, source="optional", alone="the one published for --model",
              published=PUBLISHED),)
