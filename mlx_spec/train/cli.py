"""`mlx-spec distill` (a student learns a teacher's distributions) and
`mlx-spec train medusa` (Medusa heads learn on a frozen target)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_spec.errors import UserError


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Flags every training command shares."""
    p.add_argument("--data", required=True, help="a .jsonl file, or a folder with train.jsonl (and valid.jsonl)")
    p.add_argument("-o", "--out", required=True, type=Path, help="the trained model's folder")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute activations: less memory")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations (0: at the end)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10, help="steps between lines of OUT/train_log.jsonl")
    p.add_argument("--no-pack", action="store_true", help="pad examples by length instead of packing them")
    p.add_argument("--mask-prompt", action="store_true", help="train on the answers only")
    p.add_argument("--valid-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full fine-tuning)")
    p.add_argument("--lora-scale", type=float, default=20.0)
    p.add_argument("--fuse", action="store_true", help="with --lora-rank: write a plain model with the adapters fused")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "distill",
        help="train a student model on a teacher's distributions",
        description="Knowledge distillation; OUT is a model folder that generate and --drafter draft=OUT load.",
    )
    p.add_argument("--teacher", required=True, help="teacher model: folder or Hub repo id")
    p.add_argument("--student", required=True, help="student model to start from: folder or Hub repo id")
    p.add_argument("--loss", default="kl", help="kl (softened KL plus alpha x cross-entropy) | mse (on logits)")
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.5, help="weight of the cross-entropy on the labels")
    p.add_argument("--teacher-topk", type=int, default=0, help="cache the teacher's top-k logits on disk (0: on the fly)")
    p.add_argument("--on-policy", type=float, default=0.0, help="fraction of batches the student writes itself")
    p.add_argument("--beta", type=float, default=0.5, help="on-policy: generalised JSD beta (0 forward KL, 1 reverse KL)")
    add_train_args(p)
    p.set_defaults(func=run)

    t = subparsers.add_parser("train", help="train a drafter for a target", description="Train a drafter for a target.")
    kinds = t.add_subparsers(dest="kind", required=True, metavar="KIND")
    m = kinds.add_parser(
        "medusa",
        help="Medusa heads on a frozen target",
        description="Medusa-1: heads on the frozen target; OUT is a folder that --drafter medusa=OUT loads.",
    )
    m.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    m.add_argument("--heads", type=int, default=4, help="number of heads (head k predicts token t + 2 + k)")
    m.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    add_train_args(m)
    m.set_defaults(func=run_medusa, lr=1e-3)
    for kind, version in (("eagle3", 3), ("eagle", 1)):
        e = kinds.add_parser(
            kind,
            help=f"an EAGLE-{version} drafter on a frozen target",
            description=f"EAGLE-{version}: a one-layer drafter on the target's features, trained with "
                        f"training-time test; OUT is a folder that --drafter {kind}=OUT loads.",
        )
        e.add_argument("--target", required=True, help="target model: folder or Hub repo id")
        e.add_argument("--ttt-steps", type=int, default=3, help="drafting steps unrolled in training (training-time test)")
        e.add_argument("--intermediate-size", type=int, default=None, help="the drafter's MLP width (default: the target's)")
        e.add_argument("--regenerate", action="store_true",
                       help="replace the answers of prompt/completion and chat examples by the target's own (greedy)")
        if version == 3:
            e.add_argument("--draft-vocab", type=int, default=32000,
                           help="predict only the N most frequent tokens of the data (at most the target's vocabulary)")
            e.add_argument("--layers", default=None, help="target layers to read, e.g. 2,14,25 (default: 2, L/2, L-3)")
            e.add_argument("--recycle-normed", action="store_true",
                           help="EAGLE 3.1: feed the normed output state to the next drafting step")
        add_train_args(e)
        e.set_defaults(func=run_eagle, lr=1e-3, version=version)
    d = kinds.add_parser(
        "dflash",
        help="a DFlash block drafter on a frozen target",
        description="DFlash: a few layers that fill a block of drafts in one forward, reading the target's "
                    "features as keys and values; OUT is a folder that --drafter dflash=OUT loads.",
    )
    d.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    d.add_argument("--num-layers", type=int, default=2, help="drafter layers (started from target layers)")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--target-layers", default=None, help="target layers whose outputs it reads, e.g. 1,9,17 (default: z-lab's spread)")
    d.add_argument("--mask-token-id", type=int, default=None, help="the mask token (default: the embedding's last row)")
    d.add_argument("--loss-decay", type=float, default=0.9, help="weight of block position i: decay^(i-1)")
    d.add_argument("--blocks-per-row", type=int, default=None, help="anchors sampled per row (default: seq-len / block-size)")
    d.add_argument("--intermediate-size", type=int, default=None, help="the drafter's MLP width (default: the target's)")
    d.add_argument("--regenerate", action="store_true",
                   help="replace the answers of prompt/completion and chat examples by the target's own (greedy)")
    add_train_args(d)
    d.set_defaults(func=run_dflash, lr=1e-3)
    ls = kinds.add_parser(
        "layerskip",
        help="fine-tune a target so that its early layers draft (LayerSkip)",
        description="LayerSkip: the target is fine-tuned in place with layer dropout rising with depth and an "
                    "early-exit loss; OUT is a model folder to use with --drafter layerskip[=E].",
    )
    ls.add_argument("--target", required=True, help="the model to fine-tune: folder or Hub repo id")
    ls.add_argument("--layer-dropout", type=float, default=0.1, help="skip probability of the last layer (rising from 0)")
    ls.add_argument("--exit-scale", type=float, default=1.0, help="weight of the early exits' losses (layer l: scale x (l+1)/L)")
    add_train_args(ls)
    ls.set_defaults(func=run_layerskip, lr=1e-4)
    mh = kinds.add_parser(
        "mtp-heads",
        help="parallel multi-token-prediction heads on a frozen target",
        description="MTP heads (Gloeckle et al.): a transformer block per head on the target's last hidden state, "
                    "sharing its unembedding; OUT is a folder that --drafter mtp-heads=OUT loads.",
    )
    mh.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    mh.add_argument("--heads", type=int, default=3, help="number of heads (head k predicts the token k + 1 ahead)")
    add_train_args(mh)
    mh.set_defaults(func=run_mtp_heads, lr=1e-3)
    mt = kinds.add_parser(
        "mtp",
        help="DeepSeek-style sequential multi-token-prediction modules on a frozen target",
        description="MTP modules (DeepSeek-V3): module k combines the depth k-1 hidden state with the embedding of "
                    "the token k ahead; OUT is a folder that --drafter mtp=OUT loads.",
    )
    mt.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    mt.add_argument("--modules", type=int, default=1, help="depth D (drafting reuses the last module beyond it)")
    add_train_args(mt)
    mt.set_defaults(func=run_mtp, lr=1e-3)
    add_registered(kinds)


def add_registered(kinds: argparse._SubParsersAction) -> None:
    """`mlx-spec train KIND` for every registered kind that declares how it trains (`Kind.train`)."""
    from mlx_spec.drafters import REGISTRY

    for kind in REGISTRY.values():
        if kind.train is not None:
            p = kinds.add_parser(kind.name, help=kind.summary, description=kind.train.description)
            kind.train.add_arguments(p)
            add_train_args(p)
            p.set_defaults(func=kind.train.run)


# What a resumed run may change: how far it goes, how often it logs, evaluates and saves, what it shows
# (the command and kind need no check: another drafter's weights differ from the checkpoint's).
RESUMABLE = ("resume", "steps", "save_every", "eval_every", "eval_batches", "log_every", "quiet", "grad_checkpoint",
             "out", "command", "kind")


def train_config(args: argparse.Namespace):
    from mlx_spec.train.trainer import TrainConfig

    settings = {k: v for k, v in vars(args).items()
                if k not in RESUMABLE and (v is None or isinstance(v, (str, int, float, bool)))}
    config = TrainConfig(
        out=args.out, steps=args.steps, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
        grad_accum=args.grad_accum, grad_checkpoint=args.grad_checkpoint, eval_every=args.eval_every,
        eval_batches=args.eval_batches, save_every=args.save_every, log_every=args.log_every,
        progress=not args.quiet, settings=settings,
    )
    config.check()
    return config


def data_batches(args: argparse.Namespace, tokenizer, train=None, valid=None):
    """Training and validation batches of `--data` (or of the given examples), shaped by the flags."""
    from mlx_spec.train.data import Batches, load_splits

    if train is None:
        train, valid = load_splits(args.data, tokenizer, args.valid_fraction)
    eos = next(iter(tokenizer.eos_token_ids))
    shape = dict(batch_size=args.batch_size, seq_len=args.seq_len, eos=eos, pack=not args.no_pack,
                 mask_prompt=args.mask_prompt, seed=args.seed)
    return Batches(train, **shape), Batches(valid, **shape)


def prepare_student(args: argparse.Namespace):
    """The student, loaded for training, with LoRA adapters when asked."""
    from mlx_spec.models import load_model

    student, path = load_model(args.student, for_training=True)
    if args.lora_rank < 0:
        raise UserError(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.fuse and not args.lora_rank:
        raise UserError("--fuse needs --lora-rank")
    if args.lora_rank:
        from mlx_lm.tuner.utils import linear_to_lora_layers

        student.freeze()
        config = {"rank": args.lora_rank, "scale": args.lora_scale, "dropout": 0.0}
        linear_to_lora_layers(student, len(student.layers), config)
    return student, path


def export(args: argparse.Namespace, student, student_path: Path) -> None:
    """Write OUT: a plain model folder (LoRA fused), or the base plus adapters."""
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_spec.files import write_model_files
    from mlx_spec.models.load import read_json

    config = read_json(student_path / "config.json")
    if args.lora_rank and args.fuse:
        fused = [(name, m.fuse()) for name, m in student.named_modules() if hasattr(m, "fuse")]
        student.update_modules(tree_unflatten(fused))
    if args.lora_rank and not args.fuse:
        config["lora"] = {"rank": args.lora_rank, "scale": args.lora_scale}
    write_model_files(args.out, config, dict(tree_flatten(student.parameters())), student_path)


def run(args: argparse.Namespace) -> int:
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import check_same_vocab, load_tokenizer
    from mlx_spec.train.distill import DistillBatches, DistillConfig, TeacherCache, agreement, make_objective
    from mlx_spec.train.trainer import Trainer

    dconfig = DistillConfig(args.loss, args.temperature, args.alpha, args.teacher_topk, args.on_policy, args.beta, args.seed)
    dconfig.check()
    tconfig = train_config(args)
    teacher, teacher_path = load_model(args.teacher, for_training=True)
    teacher.freeze()
    student, student_path = prepare_student(args)
    tokenizer = load_tokenizer(student_path)
    check_same_vocab(tokenizer, load_tokenizer(teacher_path), f"--student {args.student}", "the teacher")
    batches, valid_batches = data_batches(args, tokenizer)
    cache = TeacherCache(args.out / "teacher_cache", teacher, batches, args.teacher_topk) if args.teacher_topk else None
    n_eval = min(args.eval_batches, len(valid_batches))
    trainer = Trainer(
        student,
        make_objective(teacher, dconfig),
        DistillBatches(batches, student, dconfig, cache),
        tconfig,
        valid=valid_batches,
        evaluate=lambda m: agreement(m, teacher, valid_batches, n_eval),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        export(args, student, student_path)
        print(json.dumps({"out": str(args.out), **result}))
    return 0


def run_medusa(args: argparse.Namespace) -> int:
    from mlx_spec.drafters.medusa import MedusaHeads, save_medusa
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import load_tokenizer
    from mlx_spec.train.medusa import head_accuracy, make_objective
    from mlx_spec.train.trainer import Trainer

    if args.heads < 1 or args.layers < 0:
        raise UserError(f"--heads must be >= 1 and --layers >= 0, got {args.heads}, {args.layers}")
    tconfig = train_config(args)
    target, target_path = load_model(args.target, for_training=True)
    target.freeze()
    batches, valid_batches = data_batches(args, load_tokenizer(target_path))
    heads = MedusaHeads(args.heads, args.layers, target.args.hidden_size, target.args.vocab_size)
    heads.init_from_target(target)
    n_eval = min(args.eval_batches, len(valid_batches))
    trainer = Trainer(
        heads, make_objective(target), batches, tconfig, valid=valid_batches,
        evaluate=lambda m: head_accuracy(m, target, valid_batches, n_eval),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        save_medusa(args.out, heads, {"base_model_name_or_path": args.target})
        print(json.dumps({"out": str(args.out), **result}))
    return 0


def run_eagle(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import numpy as np

    from mlx_spec.drafters.eagle import EagleNet, default_layers, eagle_config, save_eagle
    from mlx_spec.train.eagle import acceptance, draft_vocabulary, make_objective
    from mlx_spec.train.trainer import Trainer

    if args.ttt_steps < 1:
        raise UserError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    tconfig = train_config(args)
    target, train, batches, valid_batches = frozen_target_and_data(args)
    L, V = target.args.num_hidden_layers, target.args.vocab_size
    draft_ids = None
    if args.version == 3:
        layers = _layer_list("--layers", args.layers, L + 1) if args.layers else default_layers(L)
        if args.draft_vocab < 1:
            raise UserError(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
        size = min(args.draft_vocab, V)
        config = eagle_config(target, 3, layers, size, args.intermediate_size)
        config["eagle"]["recycle_normed"] = args.recycle_normed
        used = draft_vocabulary(train, V, size)
        net = EagleNet(config)
        net.d2t = mx.array(used - np.arange(size), dtype=mx.int32)
        # Start the drafter's head and norm from the target's: the same tokens, the same scale.
        full = target.model.embed_tokens.weight if target.args.tie_word_embeddings else target.lm_head.weight
        net.lm_head.weight = full[mx.array(used)]
        net.norm.weight = mx.array(target.model.norm.weight)
        net.freeze(keys=["d2t"])
        if size < V:
            draft_ids = mx.array(used)
    else:
        config = eagle_config(target, 1, intermediate_size=args.intermediate_size)
        net = EagleNet(config)
    n_eval = min(args.eval_batches, len(valid_batches))
    trainer = Trainer(
        net, make_objective(target, args.ttt_steps, draft_ids), batches, tconfig, valid=valid_batches,
        evaluate=lambda m: acceptance(m, target, valid_batches, n_eval),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        save_eagle(args.out, net, config)
        print(json.dumps({"out": str(args.out), **result}))
    return 0


def frozen_target_and_data(args: argparse.Namespace):
    """The target (frozen), the training examples (answers regenerated by the
    target with `--regenerate`), and the batches of both splits."""
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import load_tokenizer
    from mlx_spec.train.data import load_splits, regenerate

    target, target_path = load_model(args.target, for_training=True)
    target.freeze()
    tokenizer = load_tokenizer(target_path)
    train, valid = load_splits(args.data, tokenizer, args.valid_fraction)
    if args.regenerate:
        eos = set(tokenizer.eos_token_ids)
        train, valid = regenerate(target, train, args.seq_len, eos), regenerate(target, valid, args.seq_len, eos)
    batches, valid_batches = data_batches(args, tokenizer, train, valid)
    return target, train, batches, valid_batches


def _layer_list(flag: str, value: str, count: int) -> list[int]:
    try:
        layers = [int(i) for i in value.split(",")]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated layer indices, got '{value}'") from None
    if not layers or any(not 0 <= i < count for i in layers):
        raise UserError(f"{flag} must be indices in 0..{count - 1}, got '{value}'")
    return layers


def run_dflash(args: argparse.Namespace) -> int:
    from mlx_spec.drafters.dflash import DFlashNet, dflash_config, save_dflash
    from mlx_spec.train.dflash import AnchoredBatches, make_objective
    from mlx_spec.train.trainer import Trainer

    if args.num_layers < 1 or args.block_size < 2 or not 0 < args.loss_decay <= 1:
        raise UserError("--num-layers must be >= 1, --block-size >= 2 and --loss-decay in (0, 1]")
    if args.block_size > args.seq_len:
        raise UserError(f"--block-size {args.block_size} is longer than --seq-len {args.seq_len}")
    tconfig = train_config(args)
    target, _, batches, valid_batches = frozen_target_and_data(args)
    L, V = target.args.num_hidden_layers, target.args.vocab_size
    taps = _layer_list("--target-layers", args.target_layers, L) if args.target_layers else None
    mask_id = V - 1 if args.mask_token_id is None else args.mask_token_id
    if not 0 <= mask_id < V:
        raise UserError(f"--mask-token-id must be a row of the target's embedding (0..{V - 1}), got {mask_id}")
    per_row = args.blocks_per_row or max(1, args.seq_len // args.block_size)
    config = dflash_config(target, args.num_layers, args.block_size, mask_id, taps, args.intermediate_size)
    net = DFlashNet(config)
    for i, layer in enumerate(net.layers):  # from target layers spread over its depth: a useful start
        _start_from(layer, target.layers[round(i * (L - 1) / max(args.num_layers - 1, 1))])
    trainer = Trainer(
        net, make_objective(target, args.loss_decay), AnchoredBatches(batches, args.block_size, per_row, args.seed),
        tconfig, valid=AnchoredBatches(valid_batches, args.block_size, per_row, args.seed + 1),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        save_dflash(args.out, net, config)
        print(json.dumps({"out": str(args.out), **result}))
    return 0


def run_layerskip(args: argparse.Namespace) -> int:
    from mlx_spec.files import write_model_files
    from mlx_spec.models import load_model
    from mlx_spec.models.load import read_json
    from mlx_spec.tokenizer import load_tokenizer
    from mlx_spec.train.layerskip import KeyedBatches, exit_agreement, make_objective
    from mlx_spec.train.trainer import Trainer

    if not 0 <= args.layer_dropout < 1 or args.exit_scale < 0:
        raise UserError("--layer-dropout must be in [0, 1) and --exit-scale >= 0")
    tconfig = train_config(args)
    model, path = load_model(args.target, for_training=True)
    batches, valid_batches = data_batches(args, load_tokenizer(path))
    n_eval = min(args.eval_batches, len(valid_batches))
    exit_layer = max(len(model.layers) // 2, 1)
    trainer = Trainer(
        model, make_objective(args.layer_dropout, args.exit_scale), KeyedBatches(batches, args.seed), tconfig,
        valid=KeyedBatches(valid_batches, args.seed + 1),
        evaluate=lambda m: exit_agreement(m, valid_batches, n_eval, exit_layer),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        write_model_files(args.out, read_json(path / "config.json"), model.weights(), path)
        print(json.dumps({"out": str(args.out), **result}))
    return 0


def _start_from(block, layer) -> None:
    """A new drafter block starts as a copy of the target's `layer` where it holds the same
    parameters (names and shapes: not an mlx-lm target's experts or linear attention; copies keep
    the frozen target apart from what trains); else from its random initialisation."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    mine = {k: v.shape for k, v in tree_flatten(block.parameters())}
    if all(mine.get(k) == v.shape for k, v in tree_flatten(layer.parameters())):
        block.update(tree_map(mx.array, layer.parameters()))


def _train_blocks_on_target(args: argparse.Namespace, make_net, make_objective) -> int:
    """Train a drafter made by `make_net(target) -> (net, config, blocks)` on the
    frozen target; each of `blocks` starts as the target's last layer."""
    from mlx.utils import tree_flatten

    from mlx_spec.files import write_model_files
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import load_tokenizer
    from mlx_spec.train.trainer import Trainer

    tconfig = train_config(args)
    target, path = load_model(args.target, for_training=True)
    target.freeze()
    batches, valid_batches = data_batches(args, load_tokenizer(path))
    net, config, blocks = make_net(target)
    for block in blocks:
        _start_from(block, target.layers[-1])
    trainer = Trainer(net, make_objective(target), batches, tconfig, valid=valid_batches)
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        write_model_files(args.out, config, dict(tree_flatten(net.parameters())))
        print(json.dumps({"out": str(args.out), **result}))
    return 0


def run_mtp_heads(args: argparse.Namespace) -> int:
    from mlx_spec.drafters.mtp_heads import MTPHeads, mtp_heads_config
    from mlx_spec.train.mtp_heads import make_objective

    if args.heads < 1:
        raise UserError(f"--heads must be >= 1, got {args.heads}")

    def make_net(target):
        config = mtp_heads_config(target, args.heads)
        heads = MTPHeads(config)
        return heads, config, heads.heads

    return _train_blocks_on_target(args, make_net, make_objective)


def run_mtp(args: argparse.Namespace) -> int:
    from mlx_spec.drafters.mtp import MTPNet
    from mlx_spec.train.mtp import make_objective, mtp_config

    if args.modules < 1:
        raise UserError(f"--modules must be >= 1, got {args.modules}")

    def make_net(target):
        config = mtp_config(target, args.modules)
        net = MTPNet(config)
        return net, config, [module.block for module in net.layers]

    return _train_blocks_on_target(args, make_net, make_objective)
