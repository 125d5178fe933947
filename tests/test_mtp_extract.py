"""Qwen3.5/3.6 MTP blocks split out of their model, as mlx-community publishes them
(mlx-community/Qwen3.5-4B-MTP-4bit, Qwen3.6-27B-MTP-bf16: folders mlx-vlm's splitter writes,
`model_type: qwen3_5_mtp`), as `--drafter mtp=FOLDER`: a target whose own checkpoint has no `mtp.*`
tensors (mlx-community's conversions drop them) drafts with its block, quantized or not."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import api
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from mlx_spec.weights import read_safetensors_file

SOURCE = Path(__file__).parent / "fixtures" / "mlxlm_reference" / "qwen3_5"  # Qwen3.5 as transformers saves it
# The norms mlx-vlm's `Qwen3_5MTPDraftModel.sanitize` turns from zero-centred to plain (+1) on an HF source.
NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
         "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
GREEDY = SamplingParams()


def split(out: Path, bits: int | None = None, group_size: int = 64) -> Path:
    """What mlx-vlm's `Qwen3_5MTPSplitter` writes from a transformers checkpoint: the `mtp.*` tensors
    without the prefix, norms made plain, one model.safetensors (format mlx); config.json with
    `model_type: qwen3_5_mtp`, the source's `text_config`, `block_size` (depth + 2) and
    `tie_word_embeddings`; with `bits`, its affine quantization of every 2-D `.weight` the group
    divides (`mlp.gate.weight` kept), recorded as `quantization` and `quantization_config`."""
    source = read_safetensors_file(SOURCE / "model.safetensors")
    weights = {k[len("mtp."):]: v for k, v in source.items() if k.startswith("mtp.")}
    weights = {k: v + 1.0 if k.endswith(NORMS) and v.ndim == 1 else v for k, v in weights.items()}
    text = json.loads((SOURCE / "config.json").read_text())["text_config"]
    config = {"model_type": "qwen3_5_mtp", "text_config": text, "block_size": text["mtp_num_hidden_layers"] + 2,
              "tie_word_embeddings": bool(text.get("tie_word_embeddings", True))}
    if bits:
        for key in [k for k in weights if k.endswith(".weight") and not k.endswith("mlp.gate.weight")]:
            if weights[key].ndim == 2 and weights[key].shape[-1] % group_size == 0:
                stem = key[: -len(".weight")]
                weights[key], weights[stem + ".scales"], weights[stem + ".biases"] = mx.quantize(
                    weights[key], group_size=group_size, bits=bits)
        config["quantization"] = config["quantization_config"] = {"group_size": group_size, "bits": bits,
                                                                   "mode": "affine"}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2))
    return out


@pytest.fixture(scope="module")
def target():
    model, _ = load_model(str(SOURCE))
    return api.Target(model, None, SOURCE, str(SOURCE))  # weights and config only: no tokenizer


def rounds(target, spec: str):
    """The rounds of greedy decoding with `spec`; the block is read as published (nothing is converted)."""
    prompt = np.load(SOURCE / "reference.npz")["prompt"].tolist()
    heard = []
    drafter = api.drafter(spec, target, report=heard.append).new_session()
    assert heard == []
    return list(speculative_steps(target.model, prompt, GREEDY, 24, drafter, num_draft=2)), prompt


def test_an_extract_drafts_as_the_checkpoints_own_block(target, tmp_path):
    """Unquantized (Qwen3.6-27B-MTP-bf16's form): round for round the drafts of `--drafter mtp` alone,
    which reads the same block from the target's own `mtp.*` tensors."""
    extract = split(tmp_path / "Qwen3.5-MTP")
    events, prompt = rounds(target, f"mtp={extract}")
    own, _ = rounds(target, "mtp")
    assert [e.drafted for e in events] == [e.drafted for e in own]
    assert [t for e in events for t in e.tokens] == [t for e in plain_steps(target.model, prompt, GREEDY, 24)
                                                     for t in e.tokens]
    assert sum(len(e.drafted) for e in events) > 0


def test_a_quantized_extract_drafts_losslessly(target, tmp_path):
    """4-bit (Qwen3.5-4B-MTP-4bit's form): read, dequantized, greedy-identical to plain."""
    extract = split(tmp_path / "Qwen3.5-MTP-4bit", bits=4)
    assert any(k.endswith(".scales") for k in read_safetensors_file(extract / "model.safetensors"))
    events, prompt = rounds(target, f"mtp={extract}")
    assert [t for e in events for t in e.tokens] == [t for e in plain_steps(target.model, prompt, GREEDY, 24)
                                                     for t in e.tokens]
    assert sum(len(e.drafted) for e in events) > 0
