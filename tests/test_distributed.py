"""The demo target split over 2 processes on this machine (MLX's ring backend on localhost), as
`mlx.launch -n 2 --backend ring ... --shard tensor|pipeline` runs it: each rank holding its share of the
weights; greedy output identical to one
process for plain decoding, a draft model, EAGLE-3 and DFlash; sampled output identical to one process
with the same seed (and across the ranks); a killed or hung rank ends the other with one line within the
timeout; a different checkpoint on one rank is refused at the start."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import assert_one_line_error
from tiny import make_checkpoint

PROMPT = "def is_prime(n):\n"
DRAFTERS = ("none", "draft", "eagle3", "dflash")
TOKENS = 16
# Each rank reads a larger checkpoint (argv[3]: `read`), then decodes with the demo (`decode`), and writes
# both to OUT.RANK: only rank 0 may print.
DRIVER = """
import json, os, sys
from pathlib import Path

from mlx_spec import api, distributed
import mlx.core as mx

sys.path.insert(0, {tests!r})
from test_distributed import decode, read

distributed.start(sys.argv[1])
out = read(sys.argv[3])
mx.reset_peak_memory()
out["decoded"] = decode(api.load("demo"))
Path(sys.argv[2] + "." + os.environ["MLX_RANK"]).write_text(json.dumps(out))
""".format(tests=str(Path(__file__).parent))


def read(model: str) -> dict:
    """`model` loaded: the peak memory it took, and its greedy tokens."""
    from mlx_spec import api
    import mlx.core as mx  # (after mlx-spec, which picks the BLAS)

    target = api.load(model)
    peak = mx.get_peak_memory()
    return {"peak": peak, "tokens": api.generate(target, "def f(x):", chat_template=False, max_tokens=8).tokens}


def decode(target) -> dict:
    """Greedy with each drafter, then a sampled run with a draft model (seed and K fixed)."""
    import mlx.core as mx

    from mlx_spec import api
    from mlx_spec.sampling import SamplingParams

    def run(spec, **options):
        return api.generate(target, PROMPT, api.drafter(spec, target), chat_template=False, max_tokens=TOKENS,
                            **options).tokens

    out = {spec: run(spec) for spec in DRAFTERS}
    mx.random.seed(3)
    out["sampled"] = run("draft", params=SamplingParams(temp=1.0), num_draft=3)
    return out


def _free_ports(n: int) -> int:
    """The first of n consecutive free ports on localhost (mlx.launch numbers its ranks' from it)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports")


def mlx_launch(*args) -> subprocess.CompletedProcess:
    """`mlx.launch -n 2 --backend ring ARGS` on localhost."""
    launch = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    return subprocess.run([launch, "-n", "2", "--backend", "ring", "-p", str(_free_ports(2)), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def ranks(commands: list[list], tmp_path: Path, env: dict | None = None,
          stdin: Path | None = None) -> list[subprocess.Popen]:
    """Each command as one rank, started as mlx.launch starts them (MLX_RANK, a ring hostfile), each
    with its own stdout, stderr and exit code, and reading the file `stdin`."""
    first = _free_ports(len(commands))
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(len(commands))]))
    return [subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", *map(str, c)],
                             stdin=stdin.open() if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **(env or {}), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile),
                                  "PYTHONUNBUFFERED": "1"})
            for r, c in enumerate(commands)]


def finished(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def one_process():
    from mlx_spec import api

    return decode(api.load("demo"))


@pytest.fixture(scope="module")
def read_alone(tmp_path_factory) -> tuple[Path, dict]:
    """A 32 MB checkpoint of 8 layers, and what one process holds at its peak and decodes with it."""
    root = tmp_path_factory.mktemp("shares")
    model = make_checkpoint(root / "model", "qwen3", seed=3, hidden_size=256, intermediate_size=1024,
                            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_distributed import read; print(json.dumps(read({str(model)!r})))")
    one = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    return model, json.loads(one.stdout)


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_ranks_read_their_shares_and_decode_as_one_process(mode, one_process, read_alone, tmp_path):
    """One process holds all of a 32 MB checkpoint at its peak; each of 2 ranks reads its share of every
    layer (tensor) or its 4 layers (pipeline), and the embedding and norms every rank keeps, and peaks well
    below the whole, decoding what one process decodes. With the demo, greedy: plain, a draft model, EAGLE-3
    and DFlash token for token as one process (tensor parallel sums in another order, within rounding of the
    logits; pipeline is bit-exact); sampled at temperature 1 with a seed and K fixed, the same tokens too, on
    both ranks."""
    model, alone = read_alone
    (tmp_path / "driver.py").write_text(DRIVER)
    run = mlx_launch(sys.executable, tmp_path / "driver.py", mode, tmp_path / "out", model)
    assert run.stdout == "" and "error" not in run.stderr.lower(), run.stderr
    shares = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    whole = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    assert alone["peak"] > 0.95 * whole  # (the files hold their headers too)
    for share in shares:
        assert share["peak"] < 0.6 * whole, (share["peak"], whole)  # here 0.54 (tensor) and 0.51 (pipeline)
        assert share["tokens"] == alone["tokens"]
    assert shares[0]["decoded"] == shares[1]["decoded"] == one_process
    assert all(len(tokens) == TOKENS for tokens in one_process.values())


def test_generate_under_mlx_launch_prints_once(one_process):
    """The command line as a user runs it: rank 0 alone prints (one JSON object), one process's tokens."""
    two = mlx_launch(sys.executable, "-m", "mlx_spec.cli", "generate", "--no-chat-template", "--prompt", PROMPT,
                     "--drafter", "eagle3", "--max-tokens", TOKENS, "--json", "--shard", "pipeline")
    assert json.loads(two.stdout)["tokens"] == one_process["eagle3"], two.stderr
    assert two.stderr == "", two.stderr


def test_bench_reports_communication_beside_compute():
    report = json.loads(mlx_launch(sys.executable, "-m", "mlx_spec.cli", "bench", "--no-chat-template", "--prompt",
                                   PROMPT, "--drafters", "eagle3", "--max-tokens", 8, "--repeats", 1, "--json",
                                   "--shard", "pipeline").stdout)
    assert report["shard"] == {"mode": "pipeline", "ranks": 2}
    assert [r["name"] for r in report["rows"]] == ["mlx-spec", "mlx-spec eagle3"]  # no mlx-lm rows
    for row in report["rows"]:
        costs = row["shard"]
        assert costs["comm_ms_per_round"] > 0 and costs["round_ms"] > 0, costs
        assert costs["comm_share"] == pytest.approx(costs["comm_ms_per_round"] / costs["round_ms"])
        assert row["identical_to_plain"]


def _long_run(tmp_path, timeout: float) -> list[subprocess.Popen]:
    """Two ranks decoding long enough to be stopped midway, once rank 0 has printed a little."""
    args = ["generate", "--no-chat-template", "--prompt", PROMPT, "--drafter", "draft", "--max-tokens", 3000,
            "--shard", "tensor", "--shard-timeout", timeout]
    procs = ranks([args, args], tmp_path)
    assert procs[0].stdout.read(8)  # decoding (the rank has printed its first tokens)
    return procs


def test_a_killed_rank_ends_the_other_with_one_line(tmp_path):
    """Rank 0 stops within --shard-timeout with one line: the connection lost, or, where MLX's ring backend
    loses the error in a forward queued ahead (a plain round), no word from the other rank."""
    procs = _long_run(tmp_path, 4)
    procs[1].kill()
    tic = time.monotonic()
    survivor = finished(procs[0])
    took = time.monotonic() - tic
    procs[1].wait()
    assert_stopped_for_a_lost_rank(survivor, took, 4)


def assert_stopped_for_a_lost_rank(survivor, took: float, timeout: int) -> None:
    """Rank 0 ended with exit 1 within 10 s and one line: the connection lost, or no word within `timeout`."""
    assert survivor.returncode == 1 and took < 10, (took, survivor.stderr)
    lines = survivor.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] in (
        "mlx-spec: error: rank 0: lost the connection to another rank (it ended, or the link between them went down): "
        "the run stops",
        f"mlx-spec: error: rank 0: no word from the other ranks for {timeout} s (one died or hangs; --shard-timeout): "
        "the run stops"), survivor.stderr


def test_the_ring_backends_words_are_kept_from_stderr():
    """MLX's ring backend writes each failed socket call in pieces from several threads: whatever line its
    pieces land in, none passes, nor the line of an error it lands ahead of; the run's own lines do (on the
    other ranks, error lines only, naming the rank)."""
    from mlx_spec.distributed import passed

    error = b"mlx-spec: error: rank 0: lost the connection to another rank\n"
    ring = [b"[ring] Sending to socket 4 failed with errno 104\n", b"[ring][ring] Receiving from socket 5\n",
            b" Sending to socket 4 failed with errno 104\n", b" 104\n", b"[ring] Recv failed with errno=104\n"]
    for rank in (0, 1):
        assert [passed(line, rank) for line in ring] == [None] * len(ring)
    assert passed(b"[ring] Sending to socket" + error, 0) == error
    assert passed(error, 1) == b"mlx-spec: error: rank 1: rank 0: lost the connection to another rank\n"
    assert passed(b"[####......] 40% 0:01 elapsed\r", 0) == b"[####......] 40% 0:01 elapsed\r"
    assert passed(b"[####......] 40% 0:01 elapsed\r", 1) is None


def test_a_hung_rank_ends_the_other_within_the_timeout(tmp_path):
    procs = _long_run(tmp_path, 3)
    os.kill(procs[1].pid, signal.SIGSTOP)
    tic = time.monotonic()
    try:
        survivor = finished(procs[0], timeout=60)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert 2 < time.monotonic() - tic < 15
    assert survivor.returncode == 1
    assert survivor.stderr.strip().splitlines() == [
        "mlx-spec: error: rank 0: no word from the other ranks for 3 s (one died or hangs; --shard-timeout): "
        "the run stops"], survivor.stderr


def test_another_checkpoint_on_one_rank_is_refused_at_the_start(checkpoints, tmp_path):
    other = make_checkpoint(tmp_path / "other", "qwen3", seed=5)  # the same shapes, other weights
    args = ["generate", "--prompt", "hi", "--max-tokens", 4, "--shard", "pipeline", "--model"]
    procs = ranks([args + [checkpoints["qwen3"]], args + [other]], tmp_path)
    for rank, proc in enumerate(procs):
        assert_one_line_error(finished(proc), "--model", "rank 1 loaded another target", *(["rank 1:"] if rank else []))


def test_shard_without_mlx_launch_is_refused(in_process):
    assert_one_line_error(in_process("generate", "--prompt", "hi", "--shard", "tensor"), "--shard tensor",
                          "mlx.launch -n")


def _answers(port: int, bodies: list[dict]) -> list[dict]:
    """The server's answers to `bodies`, sent at once (one batch)."""
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    def ask(body):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        return {"text": answer["choices"][0]["text"], "usage": answer["usage"]}

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(ask, bodies))


GREEDY = [{"prompt": p, "max_tokens": n, "temperature": 0}
          for p, n in ((PROMPT, 24), ("class Stack:\n", 12), ("import os\n", 20))]
# (Which tokens a seed gives depends on the K each round drafts, which follows measured times.)
SAMPLED = [{"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 7},
           {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}]


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_serve_under_two_ranks_answers_as_one_process(mode, tmp_path):
    """`mlx-spec serve --shard` on 2 ranks with a draft model: rank 0 listens, the other decodes its batch
    (requests joining and leaving between rounds); three greedy requests at once get one process's answers,
    and two sampled ones (seeded and not) the same tokens on both ranks (a rank that parts from rank 0 stops);
    an idle server outlives --shard-timeout (rank 0 tells the others it is there); SIGTERM to rank 0 ends
    both, exit 0, nothing on stderr but rank 0's stopping line."""
    import threading

    from mlx_spec.serve import serve

    # Long enough that a forward compiling new shapes on a loaded machine is not taken for a hung rank.
    args = ["serve", "--drafter", "draft", "--port", 0, "--shard", mode, "--shard-timeout", 6]
    procs = ranks([args, args], tmp_path)
    try:
        line = procs[0].stdout.readline()
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        idle = time.monotonic()
        ready, servers = threading.Event(), []  # one process's answers, while the ranks stay idle
        threading.Thread(target=serve, args=("demo", "draft", "127.0.0.1", 0), daemon=True,
                         kwargs=dict(ready=ready, servers=servers)).start()
        assert ready.wait(120)
        try:
            expected = _answers(servers[0].server_port, GREEDY)
        finally:
            servers[0].shutdown()
        time.sleep(max(0.0, idle + 7 - time.monotonic()))  # idle past --shard-timeout
        assert _answers(port, GREEDY) == expected
        assert all(a["usage"]["completion_tokens"] == 16 for a in _answers(port, SAMPLED))
        procs[0].send_signal(signal.SIGTERM)
        done = [finished(p, timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    assert done[0].stderr.strip().splitlines() == [
        "mlx-spec serve: SIGTERM: stopping; requests in flight end with an error"]
    assert done[1].stdout == done[1].stderr == ""


def test_a_killed_rank_ends_the_server_with_one_line(tmp_path):
    """A rank lost while `serve --shard` runs a request: rank 0 stops within --shard-timeout with one line
    (the connection lost, or no word from it), exit 1."""
    import threading
    import urllib.request

    args = ["serve", "--drafter", "draft", "--port", 0, "--shard", "tensor", "--shard-timeout", 3]
    procs = ranks([args, args], tmp_path)
    try:
        port = int(procs[0].stdout.readline().rsplit(":", 1)[1].split("/")[0])
        body = json.dumps({"prompt": PROMPT, "max_tokens": 3000}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        client = threading.Thread(target=lambda: pytest.raises(Exception, urllib.request.urlopen, request, timeout=60))
        client.start()
        time.sleep(2)
        procs[1].kill()
        tic = time.monotonic()
        survivor = finished(procs[0], timeout=60)
        took = time.monotonic() - tic
        client.join()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert_stopped_for_a_lost_rank(survivor, took, 3)


def test_chat_under_two_ranks_answers_as_one_process(tmp_path):
    """`mlx-spec chat --shard` under mlx.launch reads the lines mlx.launch passes every rank: rank 0 prints
    one process's answers, turn after turn (the cache kept between them), and alone saves the conversation."""
    messages = "def is_prime(n):\nclass Stack:\n"
    args = ["chat", "--drafter", "eagle3", "--max-tokens", 12]
    one = subprocess.run([sys.executable, "-m", "mlx_spec.cli", *map(str, args)], input=messages, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "MLX_SPEC_HOME": str(tmp_path / "one")})
    assert one.returncode == 0, one.stderr
    home = tmp_path / "two"
    (tmp_path / "messages").write_text(messages)  # every rank reads them, as mlx.launch passes its stdin to all
    procs = ranks([args + ["--shard", "pipeline"]] * 2, tmp_path, env={"MLX_SPEC_HOME": str(home)},
                  stdin=tmp_path / "messages")
    done = [finished(p) for p in procs]
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    assert done[0].stdout == one.stdout and one.stdout.strip()
    assert done[1].stdout == ""
    saved = list((home / "conversations").iterdir())
    assert len(saved) == 1 and len(json.loads(saved[0].read_text())["messages"]) == 4
