"""A near-free model for transport benchmarks: a random Llama (hidden 128, 2 layers) with the
default model's tokenizer and chat template, saved as a transformers directory.

    python -m tools.bench.near_free_model bench-results/near-free-model

Its forward pass costs almost nothing, so a server's throughput on it measures the path from
the engine to the client (and the engine's own per-step host work), not the model. Both
chatserve and vLLM load the same directory. The weights are seeded: the same every time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from workers.contract.model_config import BUILTIN_DEFAULT_MODEL
from workers.model.loader import prepare_model_dir

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)


def write_near_free_model(target: Path) -> Path:
    """Write the model to `target` (skipped when it is already there); returns `target`."""
    if (target / "config.json").is_file():
        return target
    tokenizer = AutoTokenizer.from_pretrained(prepare_model_dir(BUILTIN_DEFAULT_MODEL))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True, torch_dtype="float32", **SHAPE)
    model = LlamaForCausalLM(config).eval()
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path)
    print(write_near_free_model(parser.parse_args().target))


if __name__ == "__main__":
    main()
