"""The server's prompt cache (mlx_spec/prefix.py): a conversation's next turn reads only its new tokens,
its answer the one the prompt gets read anew; for a chain drafter (a draft model), a drafter reading
the target's features (EAGLE-3) and a hybrid target (Qwen3.5's linear-attention layers); the usage and
`/metrics` say how many tokens were read."""

import contextlib
import json
import re
import threading
import urllib.request

import numpy as np
import pytest

from mlx_spec import api
from mlx_spec.decoding import plain_steps
from mlx_spec.sampling import SamplingParams
from mlx_spec.serve import serve

from test_mlxlm_targets import FIXTURES
from tiny import make_tokenizer


ENGINES: list = []  # the engine of the server `served` runs now


@contextlib.contextmanager
def served(model: str, drafter: str, **options):
    ready, servers = threading.Event(), []
    threading.Thread(target=serve, args=(model, drafter, "127.0.0.1", 0),
                     kwargs=dict(max_batch=4, ready=ready, servers=servers, **options), daemon=True).start()
    assert ready.wait(120)
    ENGINES[:] = [servers[0].RequestHandlerClass.site.engine]
    try:
        yield f"http://127.0.0.1:{servers[0].server_port}"
    finally:
        servers[0].shutdown()


def complete(url: str, prompt: list[int], n: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": n}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))


def answer(target, prompt: list[int], n: int) -> tuple[list[int], int]:
    """Plain greedy decoding's answer to `prompt` alone (its tokens, as the server cuts it at the end of
    text), and how many of the tokens its decoding leaves in the cache are its prompt and answer (all but
    the last token, which it has not read, unless the end of text came first)."""
    tokens = [t for e in plain_steps(target.model, prompt, SamplingParams(), n) for t in e.tokens]
    eos = next((i for i, t in enumerate(tokens) if t in target.tokenizer.eos_token_ids), None)
    kept = tokens if eos is None else tokens[:eos]
    return kept, len(prompt) + len(kept) - (eos is None)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The Qwen3.5 fixture (Gated DeltaNet layers beside attention) with a tokenizer beside it."""
    import shutil

    folder = tmp_path_factory.mktemp("hybrid") / "qwen3_5"
    shutil.copytree(FIXTURES / "qwen3_5", folder)
    make_tokenizer(folder, 256)
    return str(folder)


@pytest.mark.parametrize("case", ["draft model", "draft model, exact", "eagle3", "hybrid", "suffix"])
def test_the_next_turn_reads_only_its_new_tokens(case, hybrid):
    """(Under --exact, the answer with the cache is the one without, bit for bit. Suffix decoding: the row
    handed over counts on in the trie its suffixes are nodes of.)"""
    model, drafter = {"draft model": ("demo", "draft"), "draft model, exact": ("demo", "draft"),
                      "eagle3": ("demo", "eagle3"), "hybrid": (hybrid, "lookup"), "suffix": ("demo", "suffix")}[case]
    exact = {"exact": True} if case.endswith("exact") else {}
    target = api.load(model)
    rng = np.random.default_rng(0)
    first = [int(t) for t in rng.integers(5, 250, 48)]
    kept, held = answer(target, first, 8)
    second = first + kept + [int(t) for t in rng.integers(5, 250, 12)]  # the answer, then the next message
    with served(model, drafter, prompt_cache_bytes=0, **exact) as url:  # each prompt read anew
        anew = [complete(url, prompt, 8)["choices"][0]["text"] for prompt in (first, second)]
    with served(model, drafter, **exact) as url:
        one, two = complete(url, first, 8), complete(url, second, 8)
        assert [one["choices"][0]["text"], two["choices"][0]["text"]] == anew
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        usage = two["usage"]
        assert usage["prompt_tokens"] == len(second) and usage["prompt_tokens_details"]["cached_tokens"] == held
        assert metric(url, "mlx_spec_prompt_tokens_cached_total") == held
        assert metric(url, "mlx_spec_prompt_tokens_total") == len(first) + len(second)
        assert metric(url, "mlx_spec_prompt_cache_hits_total") == 1


def test_entries_on_disk_serve_the_next_start(tmp_path):
    """A conversation's next turn, sent after a restart, reads only its new tokens from the entry the first
    turn left in --prompt-cache-dir; the answer is the one read anew."""
    target = api.load("demo")
    rng = np.random.default_rng(1)
    first = [int(t) for t in rng.integers(5, 250, 40)]
    kept, held = answer(target, first, 8)
    second = first + kept + [int(t) for t in rng.integers(5, 250, 10)]
    with served("demo", "lookup", prompt_cache_bytes=0) as url:
        anew = complete(url, second, 8)["choices"][0]["text"]
    with served("demo", "lookup", prompt_cache_dir=str(tmp_path)) as url:
        complete(url, first, 8)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    with served("demo", "lookup", prompt_cache_dir=str(tmp_path)) as url:
        two = complete(url, second, 8)
    assert two["choices"][0]["text"] == anew and two["usage"]["prompt_tokens_details"]["cached_tokens"] == held


WRITER = """
import os, signal, sys
import mlx_spec
import mlx.core as mx
from mlx_spec import prefix
from mlx_spec.cache import KVCache

cache = KVCache()
cache.update_and_fetch(mx.ones((1, 2, 6, 4)), mx.ones((1, 2, 6, 4)))
store = prefix.PrefixCache(1 << 20, sys.argv[1], model="m")
if sys.argv[2] == "kill":  # killed between writing the entry's file and naming it
    os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
store.store(list(range(6)), [cache], None)
"""


def test_a_kill_mid_write_and_broken_entries_are_ignored(tmp_path, capfd):
    """A server killed (-9) while writing an entry leaves a temporary file, which the next start removes;
    an entry cut short, one whose bytes changed and another model's are ignored with a warning; a whole
    one still serves."""
    import subprocess
    import sys

    from mlx_spec.cache import KVCache
    from mlx_spec.prefix import PrefixCache

    good, bad = tmp_path / "good", tmp_path / "bad"
    assert subprocess.run([sys.executable, "-c", WRITER, str(good), "keep"]).returncode == 0
    killed = subprocess.run([sys.executable, "-c", WRITER, str(bad), "kill"])
    assert killed.returncode == -9 and [p.name[:9] for p in bad.iterdir()] == [".writing-"]
    whole = next(good.glob("*.safetensors"))
    data = whole.read_bytes()
    (bad / "short.safetensors").write_bytes(data[:-10])
    (bad / "changed.safetensors").write_bytes(data[:-4] + bytes(4))
    capfd.readouterr()
    store = PrefixCache(1 << 20, bad, model="m")
    assert not list(bad.glob(".writing-*")) and "half written" in capfd.readouterr().err
    assert sorted(p.name for p in store.files) == ["changed.safetensors"]  # (whole: its checksum is read on use)
    assert store.lookup(list(range(8)), lambda: [KVCache()]) is None
    err = capfd.readouterr().err
    assert "changed.safetensors: ignored (ValueError: its checksum does not match)" in err
    (bad / "good.safetensors").write_bytes(data)
    assert "another model" in (PrefixCache(1 << 20, bad, model="other"), capfd.readouterr().err)[1]
    n, cache, session = PrefixCache(1 << 20, bad, model="m").lookup(list(range(8)), lambda: [KVCache()])
    assert n == 6 and cache[0].lengths == [6] and session is None
    assert mx_equal(cache[0].keys[..., :6, :], 1.0)


def mx_equal(array, value) -> bool:
    import mlx.core as mx

    return bool(mx.all(array == value))


def test_two_hundred_conversations_from_eight_clients(copy_model):
    """A soak, bounded: 200 two-turn conversations on three shared system prompts, 8 clients at once, the
    prompt cache bounded far below what they leave: every answer is the one its request gets alone
    (greedy), the cache holds no more than its bound, and once the clients are gone nothing is left
    decoding (no row, no queued request, no drafter row) and MLX holds no more than before but the cache."""
    import queue
    from types import SimpleNamespace

    import mlx.core as mx

    from mlx_spec.serve.engine import InFlight

    target = api.load(str(copy_model))
    rng = np.random.default_rng(2)
    systems = [[int(t) for t in rng.integers(20, 300, 24)] for _ in range(3)]

    def alone(prompt: list[int]) -> tuple[str, list[int]]:
        tokens = [t for e in plain_steps(target.model, prompt, SamplingParams(), 4) for t in e.tokens]
        flight = InFlight(SimpleNamespace(max_tokens=4, stop=[], out=queue.Queue()), target.tokenizer)
        kept = next((tokens[:i] for i, t in enumerate(tokens) if flight.feed([t]) is not None), tokens)
        return flight.text, kept

    turns = []  # per conversation: [(prompt, the answer alone)] in order
    for c in range(200):
        first = systems[c % 3] + [int(t) for t in rng.integers(20, 300, 5)]
        text, kept = alone(first)
        second = first + kept + [int(t) for t in rng.integers(20, 300, 5)]
        turns.append([(first, text), (second, alone(second)[0])])
    bound = 256 << 10
    answers: dict = {}
    with served(str(copy_model), "lookup", prompt_cache_bytes=bound) as url:
        engine = ENGINES[0]
        before = mx.get_active_memory()
        work: queue.Queue = queue.Queue()
        for c in range(len(turns)):
            work.put(c)

        def client():
            while True:
                try:
                    c = work.get_nowait()
                except queue.Empty:
                    return
                answers[c] = [complete(url, prompt, 4)["choices"][0]["text"] for prompt, _ in turns[c]]

        clients = [threading.Thread(target=client) for _ in range(8)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(600)
        assert answers == {c: [text for _, text in turn] for c, turn in enumerate(turns)}
        assert metric(url, "mlx_spec_prompt_cache_hits_total") > 100  # (the system prompts, the first turns)
        assert 0 < metric(url, "mlx_spec_prompt_cache_bytes") <= bound
        assert metric(url, "mlx_spec_requests_running") == metric(url, "mlx_spec_requests_waiting") == 0
        assert not engine.decoder.rows and not engine.running and engine.drafter.rows == 0
        assert mx.get_active_memory() <= before + bound + (4 << 20)


def test_a_prompt_cache_dir_that_cannot_be_one_is_a_one_line_error(tmp_path, in_process):
    from helpers import assert_one_line_error

    (tmp_path / "file").write_text("not a folder")
    proc = in_process("serve", "--model", "demo", "--prompt-cache-dir", tmp_path / "file", "--port", "0")
    assert_one_line_error(proc, "--prompt-cache-dir", "cannot keep entries there")


def test_a_context_shorter_than_the_prompt_is_a_one_line_error(in_process):
    from helpers import assert_one_line_error

    proc = in_process("bench", "--model", "demo", "--prompts", "code", "--num-prompts", "1", "--context", "8")
    assert_one_line_error(proc, "--context 8", "a prompt alone is longer")
