"""Write the transformers (PyTorch) reference fixture for tests/test_hf_parity.py.

Needs torch and transformers, which mlx-spec itself does not depend on:

    pip install torch==2.13.0 transformers
    python scripts/make_hf_reference.py

For each case (llama with llama3 RoPE scaling, qwen2, mistral with a sliding
window of 8, qwen3 with YaRN) it builds a tiny model with scripts/tiny.py's seeded weights,
saves it with transformers' `save_pretrained` (so the config is in the format
of the installed transformers), and records the logits of a fixed token
sequence and 16 greedy tokens, computed by transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from tiny import make_config, random_weights

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_reference"

SMALL = dict(vocab_size=256, intermediate_size=96, max_position_embeddings=512)
CASES = {
    "llama": make_config(
        "llama",
        **SMALL,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "qwen2": make_config("qwen2", **SMALL),
    # Mistral-7B-v0.1's sliding window, shorter than the 40 + 16 tokens here: it decides the output
    "mistral": make_config("llama", **SMALL, model_type="mistral", architectures=["MistralForCausalLM"],
                           sliding_window=8),
    "qwen3": make_config(
        "qwen3",
        **SMALL,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ),
}
GREEDY_TOKENS = 16


def main() -> None:
    torch.manual_seed(0)
    input_ids = np.random.default_rng(1).integers(0, SMALL["vocab_size"], size=(1, 40))
    for name, config in CASES.items():
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
        model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32).eval()
        state = {k: torch.from_numpy(v) for k, v in random_weights(config, seed=0).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
        model.save_pretrained(out, safe_serialization=True)
        with torch.no_grad():
            ids = torch.from_numpy(input_ids)
            logits = model(ids).logits.numpy()
            for _ in range(GREEDY_TOKENS):
                nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], dim=1)
        np.savez_compressed(
            out / "reference.npz",
            input_ids=input_ids.astype(np.int32),
            logits=logits.astype(np.float32),
            greedy=ids[0, input_ids.shape[1] :].numpy().astype(np.int32),
        )
        (out / "versions.json").write_text(
            json.dumps({"torch": torch.__version__, "transformers": transformers.__version__})
        )
        print(name, "->", out)


if __name__ == "__main__":
    main()
