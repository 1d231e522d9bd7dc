"""An encoder checkpoint (BERT, RoBERTa, XLM-R, MPNet, ...: what transformers' AutoModel
loads) run on padded batches of token ids, each input pooled into one vector from its
final hidden states: the first token's (CLS), the mean of its tokens' or its last one's."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoTokenizer

from workers.contract.model_config import ModelConfig
from workers.model.cpu_linear import pack_linear_layers
from workers.model.loader import prepare_model_dir, resolve_dtype
from workers.model.model_kind import ENCODER_MODEL_TYPES, own_pooling

logger = logging.getLogger(__name__)

# RoBERTa-style position ids start after the padding id (pad_token_id + 1), so the table
# holds that many fewer positions than max_position_embeddings.
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert"}
_NO_LIMIT = 1_000_000  # tokenizers without a model_max_length report ~1e30


@dataclass
class EncoderModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    pooling: str  # CLS, MEAN or LAST
    normalize: bool
    max_input_tokens: int
    pad_token_id: int

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @torch.inference_mode()
    def pool(self, batch: list[list[int]]) -> list[list[float]]:
        """One vector per input, in order; the batch padded to its longest input (the
        attention mask keeps the padding out of every real token's attention)."""
        lengths = torch.tensor([len(ids) for ids in batch])
        ids = torch.full((len(batch), int(lengths.max())), self.pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(batch):
            ids[row, :len(tokens)] = torch.tensor(tokens)
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        hidden = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        hidden = hidden.float()
        if self.pooling == "CLS":
            vectors = hidden[:, 0]
        elif self.pooling == "MEAN":
            weights = mask.to(hidden.device, hidden.dtype)[..., None]
            vectors = (hidden * weights).sum(dim=1) / lengths.to(hidden.device, hidden.dtype)[:, None]
        else:
            vectors = hidden[torch.arange(len(batch)), lengths.to(hidden.device) - 1]
        if self.normalize:
            vectors = F.normalize(vectors, dim=-1)
        return vectors.cpu().tolist()


def load_encoder(config: ModelConfig) -> EncoderModel:
    """The model config's encoder on its device, in its dtype (`auto`: as for a generating
    model); a ValueError naming the field when the checkpoint is not an encoder."""
    path = prepare_model_dir(config.source, None if config.cache_dir is None else Path(config.cache_dir))
    hf_config = AutoConfig.from_pretrained(path)
    if hf_config.model_type not in ENCODER_MODEL_TYPES:
        raise ValueError(f"runner: pooling serves encoder families ({', '.join(sorted(ENCODER_MODEL_TYPES))}), not "
                         f"{hf_config.model_type!r}; a generating model serves /v1/embeddings with runner: generate")
    device = torch.device(config.device)
    model = _auto_model(path, resolve_dtype(config.dtype, config.device)).to(device).eval()
    if config.pack_cpu_weights and device.type == "cpu":
        pack_linear_layers(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pooler = config.pooler_config
    pooling = pooler.pooling_type or own_pooling(path) or "CLS"
    pad = hf_config.pad_token_id if hf_config.pad_token_id is not None else tokenizer.pad_token_id
    longest = _longest_input(hf_config, tokenizer, config.engine.max_model_len)
    logger.info("encoder %s loaded: %s pooling, at most %d tokens an input", config.id, pooling, longest)
    return EncoderModel(model, tokenizer, device, pooling, pooler.normalize, longest, pad or 0)


def _auto_model(path: Path, dtype) -> torch.nn.Module:
    """The checkpoint's base model, without the pooler head where the family has one (BERT's
    next-sentence dense layer: embeddings pool the hidden states themselves)."""
    try:
        return AutoModel.from_pretrained(path, dtype=dtype, add_pooling_layer=False)
    except TypeError:  # a family without that argument (DistilBERT, ELECTRA, ...)
        return AutoModel.from_pretrained(path, dtype=dtype)


def _longest_input(hf_config, tokenizer, max_model_len: int | None) -> int:
    """The positions the model has (its tokenizer's limit where it names one), at most
    engine.max_model_len."""
    positions = hf_config.max_position_embeddings
    if hf_config.model_type in _OFFSET_POSITIONS:
        positions -= (hf_config.pad_token_id or 0) + 1
    named = getattr(tokenizer, "model_max_length", None) or _NO_LIMIT
    longest = min(positions, named) if named < _NO_LIMIT else positions
    return min(longest, max_model_len) if max_model_len is not None else longest

