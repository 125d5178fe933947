"""The command line: streamed and JSON output, doctor, and one-line errors."""

import json
import sys

import mlx.core as mx
import pytest

from helpers import assert_one_line_error, run_cli as run



def test_generate_json_and_stream_agree(checkpoints):
    path = str(checkpoints["qwen3"])
    out = run("generate", "--model", path, "--prompt", "Hello fox", "--max-tokens", "12", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("text", "tokens", "prompt_tokens", "prompt_tps", "generation_tps"):
        assert key in data
    assert 0 < len(data["tokens"]) <= 12 and data["prompt_tokens"] > 2
    streamed = run("generate", "--model", path, "--prompt", "Hello fox", "--max-tokens", "12")
    assert streamed.returncode == 0
    assert streamed.stdout == data["text"] + "\n"


def test_sampling_is_seeded(checkpoints):
    path = str(checkpoints["llama"])
    args = ("generate", "--model", path, "--prompt", "Hi", "--max-tokens", "16", "--json", "--temp", "1.0", "--top-p", "0.9")
    a = json.loads(run(*args, "--seed", "1").stdout)["tokens"]
    b = json.loads(run(*args, "--seed", "1").stdout)["tokens"]
    c = json.loads(run(*args, "--seed", "2").stdout)["tokens"]
    assert a == b and a != c


def test_no_chat_template_feeds_raw_text(checkpoints):
    path = str(checkpoints["qwen2"])
    chat = json.loads(run("generate", "--model", path, "--prompt", "Hi", "--max-tokens", "1", "--json").stdout)
    raw = json.loads(
        run("generate", "--model", path, "--prompt", "Hi", "--max-tokens", "1", "--json", "--no-chat-template").stdout
    )
    assert raw["prompt_tokens"] < chat["prompt_tokens"]


def test_doctor_reports_backend_and_blas():
    out = run("doctor", env={"MLX_SPEC_NO_OPENBLAS": ""})
    assert out.returncode == 0
    assert "mlx       " + mx.__version__ in out.stdout
    assert "backend   CPU" in out.stdout or "backend   Metal" in out.stdout
    tree = "tree attn reference (SDPA + dense mask); Metal kernel: not available (no Metal)"
    if mx.metal.is_available():
        tree = "tree attn metal kernel; Metal kernel: passed its self-check"
    assert tree in out.stdout
    assert "targets   llama, mistral, qwen2, qwen3: every drafter, chains and trees" in out.stdout
    assert "qwen3_moe, mimo, mixtral, qwen2_moe, olmoe, gpt_oss, gemma3_text, deepseek_v3: every drafter, chains and trees" in out.stdout
    assert "qwen3_next, qwen3_5, qwen3_5_moe: every drafter, chains (linear-attention layers" in out.stdout
    whole = "gemma4_text, gemma4, gemma2, glm4_moe, lfm2, lfm2_moe, granitemoehybrid, nemotron_h, deepseek_v32"
    assert f"{whole}: chains, every drafter but layerskip and skip" in out.stdout
    assert "any other family mlx-lm implements" in out.stdout and "not checked against transformers" in out.stdout
    if sys.platform.startswith("linux"):
        assert "blas      OpenBLAS" in out.stdout  # .ci/run installs libopenblas0-pthread
        from mlx_spec import _blas
        if chosen := _blas.kernels():  # chosen by the CPU's features; a user's OPENBLAS_CORETYPE stands
            assert f"{chosen} kernels)" in out.stdout
            assert "Prescott kernels)" in run("doctor", env={"MLX_SPEC_NO_OPENBLAS": "",
                                                             "OPENBLAS_CORETYPE": "Prescott"}).stdout
        off = run("doctor", env={"MLX_SPEC_NO_OPENBLAS": "1"})
        assert "reference BLAS" in off.stdout and "MLX_SPEC_NO_OPENBLAS" in off.stdout
        assert "threads   left to the scheduler (disabled by MLX_SPEC_NO_OPENBLAS)" in off.stdout


def test_openblas_kernels_follow_the_cpus_features(tmp_path):
    """AVX-512: SkylakeX's kernels; AVX2 and FMA: Haswell's (OpenBLAS gives a CPU it does not know its SSE3
    ones); else its own."""
    from mlx_spec import _blas

    cpu = tmp_path / "cpuinfo"
    avx512 = "avx512f avx512cd avx512bw avx512dq avx512vl"
    cpu.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma {avx512}\n\nprocessor\t: 1\n")
    assert _blas.kernels(str(cpu)) == "SkylakeX"
    cpu.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n")  # AVX-512 in part
    assert _blas.kernels(str(cpu)) == "Haswell"
    cpu.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx\n")
    assert _blas.kernels(str(cpu)) is None
    assert _blas.kernels(str(tmp_path / "none")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS is preloaded on Linux")
def test_openblas_helpers_get_cores_of_their_own():
    """What the operating system says of the threads: OpenBLAS's helpers on cores no other thread of the
    process may use, the compute thread MLX starts later too; with MLX_SPEC_NO_PIN set, nothing pinned."""
    import ast
    import os
    import subprocess

    code = ("import os, mlx_spec, mlx.core as mx; from mlx_spec import _blas; mx.eval(mx.ones(4) @ mx.ones(4)); "
            "print(sorted(_blas.helpers)); print({int(t): sorted(os.sched_getaffinity(int(t))) "
            "for t in os.listdir('/proc/self/task')})")
    env = {**os.environ, "MLX_SPEC_NO_OPENBLAS": "", "MLX_SPEC_NO_PIN": ""}
    cores = sorted(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    helpers, affinity = map(ast.literal_eval, out.stdout.splitlines())
    if not helpers or len(cores) <= len(helpers):
        pytest.skip(f"{len(helpers)} OpenBLAS helper threads on {len(cores)} cores: nothing to pin")
    own = [core for h in helpers for core in affinity[h]]
    assert len(own) == len(set(own)) == len(helpers)  # one core each
    others = {core for tid, cs in affinity.items() if tid not in helpers for core in cs}
    assert others and not others & set(own)
    doctor = run("doctor", env={"MLX_SPEC_NO_OPENBLAS": "", "MLX_SPEC_NO_PIN": ""})
    assert f"threads   OpenBLAS's helper threads on core{'s' if len(own) > 1 else ''} " in doctor.stdout

    out = subprocess.run([sys.executable, "-c", code], env={**env, "MLX_SPEC_NO_PIN": "1"}, capture_output=True,
                         text=True, check=True)
    helpers, affinity = map(ast.literal_eval, out.stdout.splitlines())
    assert all(cs == cores for cs in affinity.values())
    doctor = run("doctor", env={"MLX_SPEC_NO_OPENBLAS": "", "MLX_SPEC_NO_PIN": "1"})
    assert "left to the scheduler (MLX_SPEC_NO_PIN is set)" in doctor.stdout


@pytest.fixture
def broken(tmp_path, checkpoints):
    """A fresh copy of a good checkpoint to break in one way."""
    import shutil

    dst = tmp_path / "broken"
    shutil.copytree(checkpoints["qwen3"], dst)
    return dst


def gen(path):
    return run("generate", "--model", str(path), "--prompt", "x", "--max-tokens", "2")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    assert_one_line_error(gen(broken), "config.json", "missing")


def test_unknown_model_type(broken):
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "made_up_lm"  # a family neither mlx-spec nor mlx-lm implements
    (broken / "config.json").write_text(json.dumps(config))
    assert_one_line_error(gen(broken), "config.json", "model_type", "made_up_lm")
    config["model_type"] = "gpt_neox"  # one mlx-lm implements, whose fields this config lacks
    (broken / "config.json").write_text(json.dumps(config))
    assert_one_line_error(gen(broken), "config.json", "model_type", "gpt_neox", "layer_norm_eps")


def test_missing_config_field(broken):
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    assert_one_line_error(gen(broken), "config.json", "hidden_size")


def test_truncated_safetensors(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_one_line_error(gen(broken), "model.safetensors")


def test_corrupt_safetensors(broken):
    (broken / "model.safetensors").write_bytes(b"\x07" * 64)
    assert_one_line_error(gen(broken), "model.safetensors")


def test_wrong_shape(broken):
    f = broken / "model.safetensors"
    weights = mx.load(str(f))
    weights["model.layers.1.mlp.up_proj.weight"] = mx.zeros((3, 3))
    mx.save_safetensors(str(f), weights)
    assert_one_line_error(gen(broken), "model.safetensors", "model.layers.1.mlp.up_proj.weight", "shape")


def test_missing_weight(broken):
    f = broken / "model.safetensors"
    weights = mx.load(str(f))
    del weights["model.norm.weight"]
    mx.save_safetensors(str(f), weights)
    assert_one_line_error(gen(broken), "model.norm.weight")


def test_hub_id_offline(tmp_path):
    out = run(
        "generate", "--model", "Qwen/Qwen3-0.6B", "--prompt", "x",
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)},
    )
    assert_one_line_error(out, "Qwen/Qwen3-0.6B", "offline")


def test_missing_directory(tmp_path):
    assert_one_line_error(gen(tmp_path / "nope"), "nope")


def test_bad_flags(checkpoints):
    path = str(checkpoints["qwen3"])
    assert_one_line_error(run("generate", "--model", path, "--prompt", "x", "--top-p", "1.5"), "--top-p")
    assert_one_line_error(run("generate", "--model", path, "--prompt", "x", "--max-tokens", "0"), "--max-tokens")


@pytest.mark.parametrize("drafter", ["lookup", "suffix", "draft={llama}"])
def test_generate_with_drafter_reports_metrics(checkpoints, drafter):
    path = str(checkpoints["qwen3"])
    spec = drafter.format(llama=checkpoints["llama"])
    out = run("generate", "--model", path, "--prompt", "the fox the fox the fox", "--max-tokens", "24",
              "--drafter", spec, "--check", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["drafter"] == spec and data["identical_to_plain"] is True
    for key in ("tau", "acceptance_by_position", "target_forwards", "draft_overhead"):
        assert key in data
    assert data["tau"] >= 1.0 and data["target_forwards"] * data["tau"] >= len(data["tokens"])


def test_drafter_errors(checkpoints, in_process):
    path = str(checkpoints["qwen3"])
    base = ("generate", "--model", path, "--prompt", "x", "--max-tokens", "4")
    assert_one_line_error(in_process(*base, "--drafter", "bogus"), "--drafter", "bogus")
    assert_one_line_error(in_process(*base, "--drafter", "draft"), "--drafter", "draft=")
    assert_one_line_error(in_process(*base, "--drafter", "lookup", "--check", "--temp", "1"), "--check")
    assert_one_line_error(in_process(*base, "--drafter", "lookup", "--num-draft", "0"), "--num-draft")
    assert_one_line_error(in_process(*base, "--drafter", "draft=/nonexistent/dir"), "/nonexistent/dir")


def test_medusa_tree_flags(checkpoints, tmp_path, in_process):
    from mlx_spec.drafters.medusa import MedusaHeads, save_medusa
    from mlx_spec.models import load_model

    path = str(checkpoints["qwen3"])
    target, _ = load_model(path)
    heads = MedusaHeads(3, 1, target.args.hidden_size, target.args.vocab_size)
    heads.init_from_target(target)
    save_medusa(tmp_path / "medusa", heads)
    save_medusa(tmp_path / "narrow", MedusaHeads(2, 1, target.args.hidden_size // 2, target.args.vocab_size))
    base = ("generate", "--model", path, "--prompt", "x", "--max-tokens", "12")
    medusa = ("--drafter", f"medusa={tmp_path / 'medusa'}")
    (tmp_path / "tree.json").write_text("[[0], [0, 0], [1], [0, 0, 0]]")
    for tree in (("--tree", "[[0], [1], [0, 0]]"), ("--tree", tmp_path / "tree.json"), ("--tree-budget", "6"), ()):
        proc = in_process(*base, *medusa, *tree, "--check", "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["identical_to_plain"] is True
    proc = in_process(*base, *medusa, "--acceptance", "typical", "--temp", "1", "--seed", "0")
    assert proc.returncode == 0, proc.stderr
    assert_one_line_error(in_process(*base, *medusa, "--tree", "[[0], [1, 0]]"), "--tree", "[1]")
    assert_one_line_error(in_process(*base, *medusa, "--tree", "[0, 1]"), "--tree", "list of paths")
    assert_one_line_error(in_process(*base, *medusa, "--tree", "nofile.json"), "--tree", "nofile.json")
    assert_one_line_error(in_process(*base, *medusa, "--tree-budget", "0"), "--tree-budget")
    assert_one_line_error(in_process(*base, "--drafter", "lookup", "--tree-budget", "4"), "--tree-budget", "lookup")
    assert_one_line_error(in_process(*base, "--drafter", f"medusa={tmp_path / 'narrow'}"), "--drafter", "hidden size")
    assert_one_line_error(in_process(*base, "--drafter", f"medusa={tmp_path}"), "config.json")


def test_bench_rows_and_json(checkpoints, tmp_path):
    path, draft = checkpoints["qwen3"], checkpoints["llama"]
    # K fixed: the rows report what was drafted (on these random weights the policy would soon draft nothing)
    proc = run("bench", "--model", path, "--drafters", f"draft={draft},lookup", "--temps", "0", "1",
               "--max-tokens", "8", "--repeats", "2", "--num-draft", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    names = {r["name"] for r in rows}
    assert names == {"mlx-spec", "mlx-lm", f"mlx-spec draft={draft}", f"mlx-lm draft={draft}", "mlx-spec lookup"}
    assert len(rows) == 10 and all(r["decode_tps"] > 0 for r in rows)
    assert all(r["ratio_to_plain"] == 1.0 for r in rows if r["name"] == "mlx-spec")
    # the reference BLAS: T=1 and T=k logits are bit-identical, so greedy rows must match
    assert all(r["identical_to_plain"] for r in rows if r["temp"] == 0)
    assert all(r["identical_to_plain"] is None for r in rows if r["temp"] == 1)
    spec = next(r for r in rows if r["name"] == f"mlx-spec draft={draft}" and r["temp"] == 0)
    assert spec["acceptance_by_position"] and spec["tau"] >= 1

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):", "chat_template": False}) + "\n"
                       + json.dumps({"prompt": "Hello"}) + "\n" + json.dumps({"prompt": "not read"}) + "\n")
    assert spec["predicted_speedup"] > 0 and spec["c"] > 0
    report = json.loads(proc.stdout)
    assert report["bound_tps"] is None and spec["of_bound"] is None  # a tiny model's weights fit in the caches
    assert report["dtype"] == "float32" and all(r["peak_memory_mb"] > 0 for r in rows)
    overhead = report["round_overhead"]  # a drafter that costs nothing: the round's own work beside the forward
    assert overhead["k"] == 4 and overhead["forward_ms"] > 0 and overhead["round_ms"] > 0

    out, png = tmp_path / "report.json", tmp_path / "plot.png"
    proc = run("bench", "--model", path, "--prompts", str(prompts), "--drafters", "lookup:num-draft=2",
               "--num-prompts", "2", "--max-tokens", "8", "--repeats", "1", "--json", str(out), "--plot", str(png),
               "--concurrency", "1,3")
    assert proc.returncode == 0, proc.stderr
    assert "mlx-spec lookup:num-draft=2" in proc.stdout and "B=3" in proc.stdout
    assert "the weights fit in this machine's caches, so no memory-bandwidth bound applies" in proc.stdout
    assert "a round's host work (policy, acceptance, cache cuts, commits):" in proc.stdout
    report = json.loads(out.read_text())
    assert report["prompts"] == 2
    # plain decoding measured a second time, as a method is: the run's own noise, beside the drafters' ratios
    assert {(r["name"], r["batch"]) for r in report["concurrency"]} == {
        (n, b) for n in ("mlx-spec", "mlx-spec, again", "mlx-spec lookup:num-draft=2") for b in (1, 3)}
    assert "mlx-spec, again: plain decoding measured twice in the same turns; its ratio is this run's noise" in proc.stdout
    assert set(report["verification_ms"]) == {"1", "3"}  # the cost curve the policy weighs drafts against
    assert all(r["host_ms_per_round"] > 0 and r["k_chosen"] for r in report["rows"] if r["name"] != "mlx-lm")
    # progress on stderr while it runs, every method at every temperature
    assert "elapsed, about" in proc.stderr and "temperature 0, prompt 2/2: mlx-spec lookup:num-draft=2" in proc.stderr
    assert all(r["ratio_to_plain"] > 0 and r["tps"] > 0 for r in report["concurrency"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_prompt_errors(checkpoints, tmp_path, in_process):
    base = ("bench", "--model", checkpoints["qwen3"], "--max-tokens", "4", "--repeats", "1")
    assert_one_line_error(in_process(*base, "--prompts", "nosuch"), "--prompts nosuch", "code")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert_one_line_error(in_process(*base, "--prompts", str(bad)), f"{bad}:2", "prompt")
    bad.write_text('{"prompt": "ok", "chat_template": "yes"}\n')
    assert_one_line_error(in_process(*base, "--prompts", str(bad)), f"{bad}:1", "chat_template")
    assert_one_line_error(in_process(*base, "--drafters", "lookup:depth=x"), "lookup:depth=x", "OPTION=N")
    assert_one_line_error(in_process(*base, "--drafters", "lookup:block-size=4"), "--block-size", "lookup")
    assert_one_line_error(in_process(*base, "--concurrency", "1,x"), "--concurrency", "1,x")
    assert_one_line_error(in_process(*base, "--num-prompts", "-1"), "--num-prompts")
