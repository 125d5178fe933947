"""Running the command line from tests."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """`mlx-spec ARGS` in a subprocess, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def cli_here(*args, env=None) -> subprocess.CompletedProcess:
    """`mlx-spec ARGS` run by `cli.main` in this process, as `cli` runs it in a subprocess (its exit code,
    stdout and stderr), without an interpreter's start; `env` is laid over the environment while it runs
    (what mlx-spec reads as it goes: MLX_SPEC_HOME, not the BLAS it started with)."""
    import contextlib
    import io

    from mlx_spec.cli import main

    out, err, before = io.StringIO(), io.StringIO(), dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's own errors
                code = e.code
    finally:
        os.environ.clear()
        os.environ.update(before)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def run_cli(*args, env=None) -> subprocess.CompletedProcess:
    """`cli_here`, or `cli` where `env` sets what mlx-spec (or huggingface_hub, or the BLAS) reads as it starts."""
    return cli(*args, env=env) if env else cli_here(*args)


def rendered_prompt(monkeypatch, *args) -> list[int]:
    """The prompt ids `mlx-spec generate ARGS` decodes from (run in this process, output aside)."""
    from mlx_spec import api
    from mlx_spec.cli import main

    seen = []
    prompt_ids = api.prompt_ids

    def spy(*a, **kw):
        seen.append(prompt_ids(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(api, "prompt_ids", spy)
    assert main(["generate", "--max-tokens", "1", *map(str, args)]) == 0
    return seen[0]


def fake_hub_cache(root: Path, repo: str, src: Path, revisions=("main",)) -> None:
    """A Hugging Face cache (HF_HUB_CACHE) holding `src` as `repo`, laid out as snapshot_download leaves it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(src, storage / "snapshots" / commit)
    (storage / "refs").mkdir()
    for revision in revisions:
        (storage / "refs" / revision).write_text(commit)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles) -> None:
    """Exit code 2 and a single stderr line naming each of `needles`, no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert str(needle) in lines[0], lines[0]


def tau_on_held_out_rows(target, model_dir, make_drafter, num_draft=None, max_tokens=24) -> float:
    """Tokens per target forward over 8 stride rows the training never saw;
    checks each output against plain greedy decoding on the way."""
    import numpy as np

    from mlx_spec.decoding import plain_steps, speculative_steps
    from mlx_spec.metrics import Metrics
    from mlx_spec.sampling import SamplingParams
    from tiny import copy_token_ids, stride_row

    ids = copy_token_ids(model_dir)
    metrics = Metrics()
    prompts = np.random.default_rng(99)
    greedy = SamplingParams()
    for _ in range(8):
        prompt = stride_row(prompts, ids, 6)
        events = list(speculative_steps(target, prompt, greedy, max_tokens, make_drafter(), num_draft=num_draft))
        plain = [t for e in plain_steps(target, prompt, greedy, max_tokens) for t in e.tokens]
        assert [t for e in events for t in e.tokens] == plain
        for e in events:
            metrics.add(e)
    return metrics.tau


def later_turns_are_exact(target, session, prompt, max_tokens=12) -> list[int]:
    """A chat keeps the target's cache across turns: the next prompt extends the
    last context (or parts from it), the cache is trimmed to what they share,
    and the output must be what a fresh run on the whole prompt gives. `session`
    is a drafter (None: plain decoding). Returns, per later turn, how many
    cached tokens the drafter let the target keep."""
    from mlx_spec.cache import rewound
    from mlx_spec.decoding import plain_steps, speculative_steps
    from mlx_spec.drafters.base import common_prefix
    from mlx_spec.sampling import SamplingParams

    greedy = SamplingParams()
    cache = target.make_cache()
    kept = []
    if session is not None:
        restart = session.restart

        def spy(b, p, cached=0):
            kept.append(restart(b, p, cached))
            return kept[-1]

        session.restart = spy

    def run(p, cache=None):
        if session is None or cache is None:
            events = plain_steps(target, p, greedy, max_tokens, cache=cache)
        else:
            events = speculative_steps(target, p, greedy, max_tokens, session, cache=cache)
        return [t for e in events for t in e.tokens]

    context = prompt + run(prompt, cache)
    for follow_up in (context + [40, 41, 42], context[:-3] + [7, 8]):  # extends it; parts from it
        held = cache[0].offset
        assert 0 < held < len(context)  # at most the last token is not in the cache yet
        cache = rewound(cache, min(common_prefix(context, follow_up), held), target.make_cache)
        out = run(follow_up, cache)
        assert out == run(follow_up)  # a fresh plain run
        context = follow_up + out
    return kept[1:]


def cli_bounded(*args, address_space: int = 1536 << 20) -> subprocess.CompletedProcess:
    """`mlx-spec ARGS` under an address-space limit (RLIMIT_AS): an allocation beyond
    it fails, so a test shows that a small input never takes the machine's memory."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", *map(str, args)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=120,
    )


def assert_rounds_are(ref, target, drafter, k: int, recorded: list, as_round, atol: float) -> None:
    """Greedy decoding of `ref["prompt"]` with `drafter`, k drafts a round: its tokens are `ref["tokens"]` and
    plain decoding's, and every round the reference drafted from the context it had (`ref["drafts"]`
    `[R, k]`, `ref["logits"]` `[R, k, V]`) is drafted here the same, its logits within `atol`. `recorded`
    fills with a round's logits as the drafter computes them (a spy the test set); `as_round` makes them `[k, V]`."""
    from mlx_spec.decoding import plain_steps, speculative_steps
    from mlx_spec.sampling import SamplingParams

    seen, propose = {}, drafter.propose

    def spy(contexts, ks, params):
        recorded.clear()
        drafts = propose(contexts, ks, params)
        seen[len(contexts[0])] = (drafts[0].tokens.tolist(), as_round(recorded))
        return drafts

    drafter.propose = spy
    prompt, greedy = ref["prompt"].tolist(), SamplingParams()
    tokens = [t for e in speculative_steps(target, prompt, greedy, len(ref["tokens"]), drafter, num_draft=k)
              for t in e.tokens]
    assert tokens == ref["tokens"].tolist() == [t for e in plain_steps(target, prompt, greedy, len(tokens))
                                               for t in e.tokens]
    n = len(prompt) + 1
    for drafts, want in zip(ref["drafts"].tolist(), ref["logits"]):
        if n - len(prompt) >= len(tokens) - 1:
            break  # the last token is a plain round's
        got, got_logits = seen[n]  # (the last rounds draft fewer: no more than the tokens left)
        assert got == drafts[: len(got)] and len(got) >= 1
        np.testing.assert_allclose(got_logits, want[: len(got)], atol=atol, rtol=0)
        n += next((i for i, (d, t) in enumerate(zip(drafts, tokens[n - len(prompt):])) if d != t), k) + 1


def assert_batch_is_greedy_identical(target, drafter, prompts: list[list[int]], max_tokens: int, k: int) -> None:
    """Rows of different lengths decoded in one batch with `drafter` (k drafts a round): each its plain tokens."""
    from mlx_spec.decoding import Decoder, plain_steps
    from mlx_spec.sampling import SamplingParams

    greedy, decoder = SamplingParams(), Decoder(target, num_draft=k)
    out = {b: [] for b in range(len(prompts))}
    for b, prompt in enumerate(prompts):
        decoder.add(b, prompt, greedy, max_tokens, drafter)
    drafted = 0
    while not decoder.done:
        for b, event in decoder.step().items():
            out[b] += event.tokens
            drafted += len(event.drafted)
    assert drafted > 0
    for b, prompt in enumerate(prompts):
        assert out[b] == [t for e in plain_steps(target, prompt, greedy, max_tokens) for t in e.tokens]
