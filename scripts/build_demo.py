"""Rebuild the demo that ships inside mlx-spec: a target and all its drafters.

    python scripts/build_demo.py WORK [--install]

Everything is trained here, offline, on the Python standard library's own
source (the one corpus every machine with Python has):

1. corpus: the stdlib's modules as raw code, plus chat pairs (a function's
   docstring as the user's request, the function as the answer) so that the
   chat template means something; whole modules are held out for evaluation
   and for the benchmark's prompts. A byte-level BPE of 2048 tokens.
2. the target, a deep and narrow Qwen3 (8 layers, 7M parameters; on a CPU a
   step costs about the same per layer whatever the width, so depth is what
   makes drafting cheap in comparison), trained as a language model; beside it,
   on the other core, a 2-layer student on the labels.
3. self-distillation data: the target answers 3000 prompts like the
   benchmark's (chat requests, functions' signatures and docstrings, windows
   of code), greedily and a quarter sampled, batched (`Decoder`).
4. every drafter, with `mlx-spec` commands against the target, two at a
   time, on the target's own answers: the student distilled from it
   (`mlx-spec distill`; the same student trained on the corpus's labels
   alone, as long as this first distillation, is the baseline it has to
   beat), then distilled again on 3000 more answers, most sampled at
   temperature 1; Medusa heads,
   EAGLE-3, DFlash, parallel MTP heads, and a copy of the target tuned for
   early exit (`mlx-spec train layerskip`, for `--model demo-layerskip`).
5. `--install` writes them in float16 (loading upcasts to the compute dtype)
   to `mlx_spec/demo/`, with the held-out prompts, where `--model demo` finds
   them.

Each stage leaves its result in WORK and is skipped when run again, so an
interrupted build continues where it stopped.
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import mlx_spec  # noqa: F401  (preloads OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_spec import demo
from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams
from tiny import SPECIAL_TOKENS, make_config, make_tokenizer, write_checkpoint
from mlx_spec.tokenizer import encode_prompt, load_tokenizer
from mlx_spec.train.data import Example, encode_example, regenerate
from mlx_spec.train.lm import lm_loss, train_lm

VOCAB_SIZE = 2048
SEQ_LEN = 256
TOKENS_PER_STEP = 1024
# Whole modules (file stems) kept out of training.
HELD_OUT = {"difflib", "textwrap", "fractions", "shlex", "heapq", "calendar", "ipaddress", "string"}
# Not code: the stdlib's tests (data blobs, deliberately odd code), codec
# tables (`encodings`), the help texts of `pydoc_data`.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data"}
MAX_FUNCTION_CHARS = 2000
# Self-distillation data: raw-code prompts' length, answers' length.
SELF_PROMPT, SELF_ANSWER = 96, 160

TARGET = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, intermediate_size=768)
STUDENT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, intermediate_size=384)

DISTILL_LR, DISTILL_WARMUP = 1e-3, 20


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- 1. corpus ---------------------------------------------------------------

def chat_pairs(source: str) -> list[dict]:
    """{"messages": [user: the docstring's first paragraph, assistant: the function]}
    for every documented function of a module."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        code = ast.get_source_segment(source, node)
        if not doc or not code or len(code) > MAX_FUNCTION_CHARS or node.name.startswith("_"):
            continue
        request = " ".join(doc.split("\n\n")[0].split())
        code = textwrap.dedent(" " * node.col_offset + code)
        pairs.append({"messages": [
            {"role": "user", "content": f"Write a Python function `{node.name}`: {request}"},
            {"role": "assistant", "content": code},
        ]})
    return pairs


def build_corpus(work: Path, held_out: set[str] = HELD_OUT) -> None:
    data = work / "data"
    if (data / "valid.jsonl").exists():
        return
    root = Path(sysconfig.get_paths()["stdlib"])
    rows: dict[str, list[dict]] = {"train": [], "valid": []}
    texts = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        split = "valid" if path.stem in held_out else "train"
        rows[split].append({"text": source})
        rows[split].extend(chat_pairs(source))
        if split == "train":
            texts.append(source)
    vocab = make_tokenizer(work / "tokenizer", VOCAB_SIZE, corpus=texts)
    data.mkdir(parents=True, exist_ok=True)
    for split, split_rows in rows.items():
        with open(data / f"{split}.jsonl.tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in split_rows)
    os.replace(data / "train.jsonl.tmp", data / "train.jsonl")
    os.replace(data / "valid.jsonl.tmp", data / "valid.jsonl")
    log(f"corpus: {len(rows['train'])} training rows, {len(rows['valid'])} held-out rows; vocab {vocab}")


def token_stream(work: Path, split: str) -> np.ndarray:
    """Every row of a split as tokens, one stream; raw text ends with <|endoftext|>."""
    cached = work / f"tokens-{split}.npy"
    if cached.exists():
        return np.load(cached)
    tokenizer = load_tokenizer(work / "tokenizer")
    eot = SPECIAL_TOKENS.index("<|endoftext|>")
    ids: list[int] = []
    for n, line in enumerate(open(work / "data" / f"{split}.jsonl", encoding="utf-8")):
        row = json.loads(line)
        ids.extend(encode_example(tokenizer, row, f"{split}:{n}").tokens)
        if "text" in row:
            ids.append(eot)
    stream = np.array(ids, dtype=np.int32)
    np.save(work / f"tokens-{split}.tmp.npy", stream)
    os.replace(work / f"tokens-{split}.tmp.npy", cached)
    return stream


# --- 2. language models ------------------------------------------------------

def random_windows(ids: np.ndarray, steps: int, seed: int) -> Iterator[mx.array]:
    """`steps` batches of random windows of the stream, `TOKENS_PER_STEP` each:
    the first three quarters `SEQ_LEN // 2` long (attention's cost grows with
    length), the last quarter `SEQ_LEN`, to learn the positions up to it."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        length = SEQ_LEN // 2 if step < 3 * steps // 4 else SEQ_LEN
        starts = rng.integers(0, len(ids) - length, TOKENS_PER_STEP // length)
        yield mx.array(np.stack([ids[s : s + length + 1] for s in starts]))  # [B, length + 1]


def held_out_loss(model: Model, ids: np.ndarray, length: int = SEQ_LEN + 1, batch: int = 16) -> float:
    """Mean next-token loss over consecutive windows of the held-out stream."""
    n = len(ids) // length
    windows = ids[: n * length].reshape(n, length)  # [N, length]
    total = 0.0
    for i in range(0, n, batch):
        chunk = mx.array(windows[i : i + batch])
        total += lm_loss(model, chunk).item() * len(chunk)
    return total / n


def train_lm_stages(work: Path, name: str, arch: dict, stages: list[tuple[str, int, float, int]],
                    seed: int) -> dict[str, float]:
    """Train one model; after each (folder, steps, lr, warmup) stage save it to
    WORK/folder with the tokenizer. Returns each folder's held-out loss."""
    train_ids, held_ids = token_stream(work, "train"), token_stream(work, "valid")
    eos = SPECIAL_TOKENS.index("<|im_end|>")
    config = make_config("qwen3", vocab_size=VOCAB_SIZE, eos_token_id=eos, **arch)
    mx.random.seed(seed)
    model = Model(parse_config(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    total = sum(stage[1] for stage in stages)
    log(f"{name}: {n_params / 1e6:.2f}M parameters, {total} steps of {TOKENS_PER_STEP} tokens "
        f"({len(train_ids)} training tokens)")
    tic = time.perf_counter()
    losses = {}
    batches = random_windows(train_ids, total, seed)
    done = 0
    for folder, steps, lr, warmup in stages:
        def on_log(step: int, loss: float) -> None:
            log(f"  {name} step {done + step:5d}  loss {loss:.3f}  {time.perf_counter() - tic:5.0f}s")

        train_lm(model, batches, steps, lr, warmup=warmup, log_every=100, on_log=on_log)
        done += steps
        out = work / folder
        write_checkpoint(out, config, dict(tree_flatten(model.parameters())))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(work / "tokenizer" / f, out / f)
        losses[folder] = held_out_loss(model, held_ids)
        log(f"{name}: wrote {folder}, held-out loss {losses[folder]:.3f} (perplexity {np.exp(losses[folder]):.1f})")
    return losses


@contextmanager
def one_per_core(n: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of `n` processes with one BLAS thread each: MLX's CPU backend runs
    the elementwise ops on one core, so n processes use n cores."""
    before = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read by the spawned processes as they start
    try:
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
            yield pool
    finally:
        if before is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = before


def build_language_models(work: Path, args: argparse.Namespace) -> None:
    if (work / "target-lm" / "model.safetensors").exists() and (work / "student-labels" / "model.safetensors").exists():
        return
    # The labels-only student trains on as many tokens as the distilled one
    # sees in pre-training plus distillation (16 x 128 tokens a step), at
    # distillation's learning rate.
    extra = args.distill_steps * 2048 // TOKENS_PER_STEP
    jobs = {
        "target": (TARGET, [("target-lm", args.target_steps, 3e-3, 100)]),
        "student": (STUDENT, [("student-lm", args.student_steps, 3e-3, 100),
                              ("student-labels", extra, DISTILL_LR, DISTILL_WARMUP)]),
    }
    with one_per_core(len(jobs)) as pool:
        futures = [pool.submit(train_lm_stages, work, name, arch, stages, args.seed)
                   for name, (arch, stages) in jobs.items()]
        losses = {}
        for f in futures:
            losses.update(f.result())
    (work / "lm_losses.json").write_text(json.dumps(losses, indent=2))


# --- 3, 4. self-distillation data and the drafters ---------------------------

def parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def function_head(source: str) -> str:
    """A function's signature and docstring: the text a code prompt gives."""
    tree = ast.parse(source).body[0]
    body_start = tree.body[1].lineno - 1 if len(tree.body) > 1 else len(source.splitlines())
    return "\n".join(source.splitlines()[:body_start]) + "\n"


def self_prompts(work: Path, split: str, count: int, seed: int) -> list[list[int]]:
    """`count` prompts like the benchmark's, from one split, a third each:
    chat requests through the template, functions' signatures and docstrings
    to complete, and windows of raw code to continue."""
    tokenizer = load_tokenizer(work / "tokenizer")
    rng = np.random.default_rng(seed)
    pairs = []
    for line in open(work / "data" / f"{split}.jsonl", encoding="utf-8"):
        row = json.loads(line)
        if "messages" in row:
            pairs.append([m["content"] for m in row["messages"]])
    picked = [pairs[i] for i in rng.permutation(len(pairs))[: 2 * count // 3]]
    chats = [encode_prompt(tokenizer, request) for request, _ in picked[::2]]
    heads = [encode_prompt(tokenizer, function_head(code), chat_template=False)
             for _, code in picked[1::2] if parses(code)]
    ids = token_stream(work, split)
    starts = rng.integers(0, len(ids) - SELF_PROMPT, count - len(chats) - len(heads))
    prompts = chats + heads + [ids[s : s + SELF_PROMPT].tolist() for s in starts]
    return [prompts[i] for i in rng.permutation(len(prompts))]


def regenerate_rows(work: Path, prompts: list[list[int]], temps: list[float], out: Path) -> None:
    """The target's answers (`SELF_ANSWER` tokens or to its end of turn) to
    `prompts`, each at its temperature, as token rows (prompt and answer)."""
    from mlx_spec.models import load_model

    target, _ = load_model(work / "target-lm")
    eos = {SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")}
    rows = []
    for temp in sorted(set(temps)):
        mine = [p for p, t in zip(prompts, temps) if t == temp]
        examples = [Example(p + [0] * SELF_ANSWER, len(p)) for p in mine]
        rows += regenerate(target, examples, max(map(len, mine)) + SELF_ANSWER, eos, SamplingParams(temp=temp),
                           batch_size=32)
    with open(out.with_suffix(".tmp"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"tokens": ex.tokens}) + "\n" for ex in rows)
    os.replace(out.with_suffix(".tmp"), out)


def write_answers(work: Path, folder: Path, make_splits: Callable[[], dict[str, tuple[list, list[float]]]]) -> Path:
    """The target's answers to each split's prompts (`make_splits()`: split -> prompts, temperatures), each at
    its temperature, as FOLDER/SPLIT.jsonl, unless already written. Two processes, one a core."""
    if (folder / "valid.jsonl").exists():
        return folder
    folder.mkdir(exist_ok=True)
    splits = make_splits()
    log(f"{folder.name}: the target answers {sum(len(prompts) for prompts, _ in splits.values())} prompts")
    jobs = [(prompts[half::2], temps[half::2], folder / f"{split}-{half}.jsonl")
            for split, (prompts, temps) in splits.items() for half in (0, 1)]
    with one_per_core(2) as pool:
        for f in [pool.submit(regenerate_rows, work, *job) for job in jobs if not job[2].exists()]:
            f.result()
    for split in splits:
        parts = [folder / f"{split}-{half}.jsonl" for half in (0, 1)]
        (folder / f"{split}.tmp").write_text("".join(p.read_text(encoding="utf-8") for p in parts), encoding="utf-8")
        os.replace(folder / f"{split}.tmp", folder / f"{split}.jsonl")
        for p in parts:
            p.unlink()
    return folder


def build_self_data(work: Path, args: argparse.Namespace) -> Path:
    """Self-distillation data: the target's own answers to prompts like the
    benchmark's (greedy, a quarter sampled at temperature 1), the data the
    drafters train on: what they must predict is what this target says, not
    what the corpus says."""
    def splits() -> dict:
        return {split: (self_prompts(work, split, count, args.seed), [1.0 if i % 4 == 3 else 0.0 for i in range(count)])
                for split, count in (("train", args.self_examples), ("valid", 64))}

    return write_answers(work, work / "data-self", splits)


def build_sampled_data(work: Path, args: argparse.Namespace) -> Path:
    """The student's second distillation data: the target's answers to 3000 new
    prompts, 2100 of them sampled at temperature 1 (a draft model sampling at
    temperature 1 meets the target's samples, a quarter of the first data), the
    held-out prompts sampled."""
    def splits() -> dict:
        first, more = self_prompts(work, "train", 1200, args.seed + 1), self_prompts(work, "train", 1800, args.seed + 2)
        return {"train": (first + more, [1.0] * len(first) + [float(i % 2) for i in range(len(more))]),
                "valid": (self_prompts(work, "valid", 64, args.seed), [1.0] * 64)}

    return write_answers(work, work / "data-sampled", splits)


def mlx_spec_command(work: Path, name: str, argv: list[str]) -> subprocess.Popen | None:
    """Start `mlx-spec ARGV -o WORK/NAME` (logged to WORK/logs/NAME.log), unless
    it already finished; with `--resume` an interrupted one continues."""
    out = work / name
    if (out / "config.json").exists():
        return None
    (work / "logs").mkdir(exist_ok=True)
    resume = ["--resume"] if out.exists() else []
    cmd = [sys.executable, "-m", "mlx_spec", *argv, "-o", str(out), "--quiet", *resume]
    log(f"{name}: mlx-spec {' '.join(argv)}")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=open(work / "logs" / f"{name}.log", "a"), stderr=subprocess.STDOUT, env=env)


def run_commands(work: Path, jobs: dict[str, list[str]], parallel: int = 2) -> None:
    """Run the commands, `parallel` at a time (one per core)."""
    pending = list(jobs.items())
    running: dict[str, subprocess.Popen] = {}
    while pending or running:
        while pending and len(running) < parallel:
            name, argv = pending.pop(0)
            proc = mlx_spec_command(work, name, argv)
            if proc is not None:
                running[name] = proc
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                if proc.returncode:
                    sys.exit(f"{name} failed (exit {proc.returncode}); see {work / 'logs' / (name + '.log')}")
                log(f"{name}: done")
        time.sleep(1)


def distill_argv(work: Path, args: argparse.Namespace, data: Path, student: str = "student-lm",
                 steps: int | None = None) -> list[str]:
    """The student distilled from the target on the target's answers (sequence-level
    distillation) with the forward KL at temperature 1 (what speculative sampling
    compares) and a little cross-entropy."""
    steps = args.distill_steps if steps is None else steps
    return ["distill", "--teacher", str(work / "target-lm"), "--student", str(work / student),
            "--data", str(data), "--steps", str(steps), "--batch-size", "16", "--seq-len", "128",
            "--lr", str(DISTILL_LR), "--warmup", str(DISTILL_WARMUP), "--save-every", "50", "--eval-batches", "16",
            "--temperature", "1", "--alpha", "0.1"]


def build_drafters(work: Path, args: argparse.Namespace) -> None:
    self_data = build_self_data(work, args)
    target = str(work / "target-lm")
    common = ["--seq-len", "256", "--batch-size", "8", "--save-every", "50", "--eval-batches", "16"]
    drafter = [*common, "--data", str(self_data), "--target", target, "--lr", "1e-3", "--warmup", "20"]
    # Longest first, two at a time.
    run_commands(work, {
        "eagle3": ["train", "eagle3", *drafter, "--steps", str(args.eagle_steps), "--ttt-steps", "3"],
        # Four of the eight layers: the block is filled from the target's features alone.
        "dflash": ["train", "dflash", *drafter, "--steps", str(args.dflash_steps), "--block-size", str(args.block_size),
                   "--target-layers", "1,3,5,7"],
        "student-kd": distill_argv(work, args, self_data),
        # A copy of the target tuned for early exit, for `--model demo-layerskip --drafter layerskip`.
        "layerskip": ["train", "layerskip", *common, "--data", str(self_data), "--target", target,
                      "--steps", str(args.layerskip_steps), "--lr", "3e-4", "--warmup", "10"],
        "medusa": ["train", "medusa", *drafter, "--steps", str(args.medusa_steps), "--heads", "4"],
        "mtp-heads": ["train", "mtp-heads", *drafter, "--steps", str(args.mtp_steps), "--heads", "2"],
    })
    # The student's second distillation, mostly on the target's samples: on held-out samples its expected
    # acceptance at temperature 1 (sum of min(p, q)) went 0.72 -> 0.77, its top-1 agreement 0.62 -> 0.68.
    sampled = build_sampled_data(work, args)
    run_commands(work, {"student": distill_argv(work, args, sampled, "student-kd", args.sampled_steps)})


# --- 5. prompts and installing ------------------------------------------------

def held_out_functions(work: Path, count: int) -> list[tuple[str, str]]:
    """(request, source) of `count` held-out functions of moderate length,
    taken from each held-out module in turn."""
    modules: list[list[tuple[str, str]]] = []
    for line in open(work / "data" / "valid.jsonl", encoding="utf-8"):
        row = json.loads(line)
        if "text" in row:  # a module, followed by its functions' pairs
            modules.append([])
            continue
        user, answer = (m["content"] for m in row["messages"])
        if 300 <= len(answer) <= 1200:
            modules[-1].append((user, answer))
    rounds = zip(*(m[:: max(1, len(m) // count)] for m in modules if m))
    return [f for functions in rounds for f in functions][:count]


def write_prompt_suites(work: Path, folder: Path, count: int = 8) -> None:
    """The benchmark's built-in suites, from held-out modules:
    code (raw text: a function's signature and docstring, to complete),
    chat (the request of a docstring -> function pair, through the chat template),
    copy (raw text: a function twice, then its signature and docstring again:
    the answer repeats the body)."""
    functions = held_out_functions(work, count)
    suites = {"code": [], "chat": [], "copy": []}
    for request, source in functions:
        suites["code"].append({"prompt": function_head(source), "chat_template": False})
        suites["chat"].append({"prompt": request})
        copy = f"{source}\n\n\n{source}\n\n\n{function_head(source)}"
        suites["copy"].append({"prompt": copy, "chat_template": False})
    folder.mkdir(parents=True, exist_ok=True)
    for suite, rows in suites.items():
        (folder / f"{suite}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def portable_config(config: dict, work: Path, name: str) -> dict:
    """`config` with this machine's paths replaced by the demo's names: the
    target is "mlx-spec/demo" (how the drafter registry knows it), the other
    models "mlx-spec/demo-NAME"."""
    def demo_name(folder: str) -> str:
        return demo.NAME if folder in ("target", "target-lm") else f"{demo.NAME}-{folder}"

    def fix(value):
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and value.startswith(str(work)):
            return demo_name(Path(value).relative_to(work).as_posix())
        return value

    config = fix(config)
    if "model_type" in config:  # a whole model: say which
        config["_name_or_path"] = demo_name(name)
        if isinstance(config.get("mlx_spec"), dict):
            config["mlx_spec"]["source"] = demo_name(name)
    return config


def install(work: Path) -> None:
    """Write the demo into the package: float16 weights, portable configs, tokenizers, prompts."""
    for name in ("target", "layerskip", "student-labels", *demo.DRAFTERS.values()):
        src, dst = work / ("target-lm" if name == "target" else name), demo.ROOT / name
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        config = portable_config(json.loads((src / "config.json").read_text()), work, name)
        (dst / "config.json").write_text(json.dumps(config, indent=2))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (src / f).exists():
                shutil.copy(src / f, dst / f)
        for f in src.glob("*.safetensors"):
            weights = mx.load(str(f))
            half = {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
            mx.save_safetensors(str(dst / f.name), half, metadata={"format": "mlx"})
    write_prompt_suites(work, Path(mlx_spec.__file__).parent / "prompts")
    size = sum(f.stat().st_size for f in demo.ROOT.rglob("*") if f.is_file())
    log(f"installed the demo in {demo.ROOT}: {size / 2**20:.1f} MiB")


def add_language_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The target's and the student's training, and the self-distillation data."""
    parser.add_argument("--target-steps", type=int, default=1600)
    parser.add_argument("--student-steps", type=int, default=1600)
    parser.add_argument("--distill-steps", type=int, default=400)
    parser.add_argument("--self-examples", type=int, default=3000, help="prompts the target answers for the drafters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="folder for the corpus, checkpoints and logs")
    add_language_model_arguments(parser)
    parser.add_argument("--sampled-steps", type=int, default=800, help="the student's second distillation")
    parser.add_argument("--eagle-steps", type=int, default=750)
    parser.add_argument("--dflash-steps", type=int, default=800)
    parser.add_argument("--medusa-steps", type=int, default=200)
    parser.add_argument("--mtp-steps", type=int, default=400)
    parser.add_argument("--layerskip-steps", type=int, default=150)
    parser.add_argument("--block-size", type=int, default=8, help="DFlash's block")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--install", action="store_true", help="write the results into mlx_spec/demo/")
    args = parser.parse_args()
    start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    build_corpus(args.work)
    for split in ("train", "valid"):
        token_stream(args.work, split)
    build_language_models(args.work, args)
    build_drafters(args.work, args)
    if args.install:
        install(args.work)
    log(f"done in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
