"""Tiny random-weight models and tokenizers, built offline in a few seconds for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I assist you today? I am a helpful assistant.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000, and punctuation: ,.;:!?\"'()[]{}",
    "Unicode: café naïve 你好 世界 😀 — emoji and accents.",
    "def add(a, b):\n    return a + b\n",
] * 20


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(vocab_size: int, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**{**settings, **overrides})
    model = LlamaForCausalLM(config)
    # Larger weights than the default init so logits are far from ties (greedy is stable).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval()


def write_tiny_model_dir(path: Path, seed: int = 0, **config_overrides) -> Path:
    tokenizer = build_tokenizer()
    model = build_tiny_llama(len(tokenizer), seed=seed, **config_overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_tiny_encoder_dir(path: Path, model_type: str = "bert", seed: int = 0, pooling: str | None = None) -> Path:
    """A random-weight encoder (BERT, or RoBERTa with its offset positions) with the tiny
    tokenizer; `pooling` (a flag such as pooling_mode_mean_tokens) writes a sentence-transformers
    Pooling module that sets it."""
    import json

    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    kinds = {"bert": (BertConfig, BertModel), "roberta": (RobertaConfig, RobertaModel)}
    config_class, model_class = kinds[model_type]
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=66, pad_token_id=tokenizer.pad_token_id)
    model = model_class(config, add_pooling_layer=False).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if pooling is not None:
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, pooling: True}))
    return path
