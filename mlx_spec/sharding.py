"""Splitting a target over the ranks of a run under --shard (`mlx_spec.distributed`): its heads and MLP
columns (tensor), or its layers in stages (pipeline)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_spec import distributed
from mlx_spec.cache import _Rows
from mlx_spec.errors import UserError


def shard(model, name: str, path: Path, adapters: str | Path | None = None) -> None:
    """Split the target `model` (as `--model name` names it, its checkpoint in `path`, loaded lazily: nothing
    is read yet) over the run, once every rank has checked it loaded the same one (and `--adapter-path`
    `adapters`); then read this rank's share of the weights, and no more. Nothing without --shard."""
    run = distributed.current()
    if run is None:
        return
    if not model.runs_apart:
        raise UserError(f"--shard: a {model.model_type} target runs on mlx-lm's forward, whole: mlx-spec does not "
                        "split it across ranks")
    from mlx_spec.weights import checkpoint_digest

    files = checkpoint_digest(path) + (checkpoint_digest(Path(adapters), "adapter_config.json") if adapters else b"")
    differ = distributed.differing(repr(model.args).encode() + files)
    if differ:
        raise UserError(f"--model {name}: rank {differ[0]} loaded another target (config or weights) than rank 0: "
                        "every rank must load the same checkpoint")
    from mlx_spec.models.mlxlm import MLXLMTarget

    if run.mode == "tensor":
        if isinstance(model, MLXLMTarget):
            _tensor_mlxlm(model, run.group)
        else:
            _tensor(model, run.group)
        _swap(model, _Tensor)
    else:
        _pipeline(model, run.rank, run.size)
    try:  # a tensor at a time: each is read whole, its share (a copy) kept and the whole let go
        for _, w in tree_flatten(model.parameters()):
            mx.eval(w)
        mx.clear_cache()
    except RuntimeError as e:
        raise UserError(f"{path}: reading weights failed ({e})".splitlines()[0]) from None



def _swap(model, mixin: type) -> None:
    """`model` becomes an instance of its class with `mixin` before it (its forward, sharded)."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (mixin, cls), {})


def _tensor(model, group) -> None:
    """mlx-spec's Llama family, sharded as mlx-lm shards its own: heads and MLP columns."""
    from mlx.nn.layers.distributed import shard_linear

    N, a, args = group.size(), model.layers[0].self_attn, model.args
    for what, n in (("attention heads", a.n_heads), ("key-value heads", a.n_kv_heads),
                    ("MLP columns", args.intermediate_size)):
        if n % N:
            raise UserError(f"--shard tensor: the {model.model_type} target's {n} {what} do not split over {N} "
                            "processes: use --shard pipeline or another process count")
    try:
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
            attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
            attn.n_heads //= N
            attn.n_kv_heads //= N
            mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
            mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
            mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
            if hasattr(layer, "_compiled"):
                layer.compile()  # traced afresh, over the shares
    except ValueError as e:  # a quantized share not a whole number of groups
        raise UserError(f"--shard tensor: the {model.model_type} target does not split over {N} processes "
                        f"({e})") from None


def _tensor_mlxlm(model, group) -> None:
    """An mlx-lm family, by mlx-lm's own `shard()` where it has one."""
    text = model._text
    if not hasattr(text, "shard"):
        raise UserError(f"--shard tensor: not for a {model.model_type} target (mlx-lm shards no such text model "
                        "by tensors): use --shard pipeline")
    try:
        text.shard(group)
    except ValueError as e:
        raise UserError(f"--shard tensor: the {model.model_type} target does not split over {group.size()} "
                        f"processes ({e})") from None


def _stages(layers: int, ranks: int) -> list[range]:
    """Each rank's layers: contiguous, as even as they go."""
    return [range(r * layers // ranks, (r + 1) * layers // ranks) for r in range(ranks)]


def _pipeline(model, rank: int, size: int) -> None:
    L = len(model.layers)
    if L < size:
        raise UserError(f"--shard pipeline: the {model.model_type} target's {L} layers do not split over "
                        f"{size} processes")
    _swap(model, _Pipeline)
    model.stages = _stages(L, size)
    for i in range(L):
        if i not in model.stages[rank]:
            model.layers[i] = nn.Module()  # another rank's: its weights go


class _Tensor:
    """A target whose layers sum their shares: each forward tells the watchdog the run goes on."""

    def __call__(self, *args, **kwargs):
        distributed.beat()
        return super().__call__(*args, **kwargs)


class _Elsewhere(_Rows):
    """The cache of a layer another rank runs: that rank holds its keys; here only the lengths
    (masks, cuts and rows follow every layer's cache alike)."""

    def __init__(self, rows: int = 1):
        self.lengths = [0] * rows

    def advance(self, S: int) -> None:
        self.lengths = [n + S for n in self.lengths]

    def cut(self, b: int, length: int) -> None:
        self.lengths[b] = length

    def keep(self, paths: dict) -> None:
        for b, (start, indices) in paths.items():
            self.lengths[b] = start + len(indices)

    def extend(self, other: "_Elsewhere") -> None:
        self.lengths += other.lengths

    def remove(self, b: int) -> None:
        del self.lengths[b]

    def row(self, b: int) -> "_Elsewhere":
        one = _Elsewhere()
        one.lengths = [self.lengths[b]]
        return one

    nbytes = 0

    @property
    def state(self) -> list:
        return []


class _Pipeline:
    """A target run in stages: this rank's layers, between a receive from the rank before and a send to
    the rank after; then every rank gathers the states its drafter reads and the last stage's output."""

    stages: list[range]

    def make_cache(self, rows: int = 1) -> list:
        mine = self.stages[distributed.current().rank]
        return [c if i in mine else _Elsewhere(rows) for i, c in enumerate(super().make_cache(rows))]

    def layer(self, i: int, h: mx.array, mask, cache, positions):
        run = distributed.current()
        rank, mine = run.rank, self.stages[run.rank]
        if i not in mine:
            if cache is not None:
                cache.advance(h.shape[1])
            return h
        if i == mine.start and rank > 0:
            h = mx.distributed.recv_like(h, rank - 1, group=run.group)
        h = super().layer(i, h, mask, cache, positions)
        if i == mine.stop - 1 and rank < run.size - 1:
            h = mx.distributed.send(h, rank + 1, group=run.group)
        return h

    def __call__(self, tokens, cache=None, positions=None, mask=None, capture=(), exit_layer=None):
        if exit_layer is not None:
            raise UserError("an early exit runs the first layers alone, which --shard pipeline spreads over the ranks")
        distributed.beat()
        wanted = (*capture, len(self.layers))
        _, states = super().__call__(tokens, cache, positions, mask, wanted)
        # Index i is layer i - 1's output: right on the rank that ran it (the embedding, 0, on every rank).
        owner = [0 if i == 0 else next(r for r, s in enumerate(self.stages) if i - 1 in s) for i in wanted]
        every = mx.distributed.all_gather(mx.stack(states)[None], group=distributed.current().group)  # [N, C+1, B, S, H]
        # Run now whatever the caller evaluates: a prompt's chunk evaluates the caches alone, and this
        # rank's need nothing of the send the next rank waits for.
        mx.async_eval(every)
        picked = [every[r, j] for j, r in enumerate(owner)]
        return self.head(picked[-1]), tuple(picked[:-1])
