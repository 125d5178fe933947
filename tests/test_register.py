"""A drafter method added from outside the package, by one registration: a `Kind` that says how
the drafter is built from a folder and how `mlx-spec train KIND` makes that folder. Once
registered it is a `--drafter` kind like the others: generate, bench, serve and train take it."""

import json
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import openai
import pytest

from mlx_spec.drafters import REGISTRY, register
from mlx_spec.drafters.base import Draft, HostDrafter, Kind, Recipe
from mlx_spec.sampling import SamplingParams


class Bigrams(HostDrafter):
    """Drafts by following, from the last token, the most frequent next token of the training data."""

    kind = "bigram"
    guesses = True

    def __init__(self, table: dict[int, int]):
        super().__init__()
        self.table = table

    def _session(self) -> "Bigrams":
        return Bigrams(self.table)

    def _chain(self, context: list[int], k: int) -> list[int]:
        out, token = [], context[-1]
        while len(out) < k and token in self.table:
            token = self.table[token]
            out.append(token)
        return out

    def propose_row(self, b: int, context: list[int], k: int, params: SamplingParams) -> Draft:
        return Draft(mx.array(self._chain(context, k), dtype=mx.int32))

    def guess(self, b: int, context: list[int]) -> int | None:
        return next(iter(self._chain(context, 1)), None)


def build(target, options) -> Bigrams:
    table = json.loads((Path(options.source) / "bigrams.json").read_text())
    return Bigrams({int(a): b for a, b in table.items()})


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="whose tokenizer the table is in")


def train(args) -> int:
    from mlx_spec import api

    tokenizer = api.load(args.target).tokenizer
    pairs: dict[int, Counter] = {}
    for line in Path(args.data).read_text().splitlines():
        ids = tokenizer.encode(json.loads(line)["text"])
        for a, b in zip(ids, ids[1:]):
            pairs.setdefault(a, Counter())[b] += 1
    args.out.mkdir(parents=True)
    (args.out / "bigrams.json").write_text(json.dumps({a: c.most_common(1)[0][0] for a, c in pairs.items()}))
    return 0


BIGRAM = Kind("bigram", "the most frequent next token of the training data, followed from the last token",
              build, train=Recipe("A table of each token's most frequent successor.", add_arguments, train))


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    register(BIGRAM)
    yield
    del REGISTRY["bigram"]


@pytest.fixture(scope="module")
def trained(bigram, tmp_path_factory) -> Path:
    from mlx_spec.cli import main

    work = tmp_path_factory.mktemp("bigram")
    texts = [json.loads(line)["prompt"] for line in
             (Path(__file__).parents[1] / "mlx_spec" / "prompts" / "code.jsonl").read_text().splitlines()]
    (work / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["train", "bigram", "--target", "demo", "--data", str(work / "data.jsonl"), "-o", str(work / "out")]) == 0
    return work / "out"


def test_a_registered_kind_trains_and_generates(trained, in_process):
    out = in_process("generate", "--drafter", f"bigram={trained}", "--prompt", "def is_prime(n):", "--max-tokens", "32",
                     "--check", "--json", "--num-draft", "3")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["identical_to_plain"] is True and result["drafted_tokens"] > 0
    listed = in_process("generate", "--help").stdout
    assert "bigram=PATH_OR_REPO" in listed  # the --drafter help lists it


def test_a_registered_kind_names_its_published_drafters(trained, in_process, checkpoints):
    """`Kind(published=...)`: `--drafter bigram` alone, on a model the kind lists, finds that model's drafter."""
    REGISTRY["bigram"] = replace(BIGRAM, source="optional", published={"mlx-spec/demo": (str(trained),)})
    try:
        out = in_process("generate", "--drafter", "bigram", "--prompt", "def is_prime(n):", "--max-tokens", "32",
                         "--check", "--json", "--num-draft", "3")
        other = in_process("generate", "--model", str(checkpoints["qwen3"]), "--drafter", "bigram", "--prompt", "x")
    finally:
        REGISTRY["bigram"] = BIGRAM
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["drafted_tokens"] > 0
    assert other.returncode == 2 and "no published bigram drafter" in other.stderr


def test_a_registered_kind_is_benchmarked(trained, in_process, tmp_path):
    report = tmp_path / "bench.json"
    out = in_process("bench", "--drafters", f"bigram={trained}", "--prompts", "code", "--num-prompts", "1",
                     "--max-tokens", "8", "--temps", "0", "--repeats", "1", "--no-mlx-lm", "--json", str(report))
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows[f"mlx-spec bigram={trained}"]["identical_to_plain"] is True


def test_a_registered_kind_is_served(trained):
    from mlx_spec.serve import serve

    ready, servers = threading.Event(), []
    threading.Thread(target=serve, args=("demo", f"bigram={trained}", "127.0.0.1", 0),
                     kwargs=dict(max_batch=2, ready=ready, servers=servers), daemon=True).start()
    assert ready.wait(120)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{servers[0].server_port}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="demo", prompt="def is_prime(n):", max_tokens=16, temperature=0)
        assert reply.usage.completion_tokens == 16 and reply.model_extra["mlx_spec"]["drafted_tokens"] > 0
    finally:
        servers[0].shutdown()
