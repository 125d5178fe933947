"""`mlx-spec distill` (a student learns a teacher's distributions) and
`mlx-spec train KIND` (a drafter learns on a frozen target: each kind's `Recipe`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_spec.drafters import REGISTRY
from mlx_spec.errors import UserError
from mlx_spec.train.common import add_train_args, data_batches, train_config


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
    for kind in REGISTRY.values():  # every kind that declares how it trains (`Kind.train`)
        if kind.train is not None:
            k = kinds.add_parser(kind.name, help=kind.summary, description=kind.train.description)
            add_train_args(k)
            kind.train.add_arguments(k)  # after the shared flags: it may change their defaults
            k.set_defaults(func=kind.train)

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
