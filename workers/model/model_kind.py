"""What a checkpoint is, read from its config files alone (no weights, no torch): a
generating decoder or an encoder that pools (the model config's `runner: auto`), and how
its authors pool it (sentence-transformers' Pooling module, the `pooler_config` default)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from workers.model.hub_source import HubId, hub_cache_dir, hub_offline

logger = logging.getLogger(__name__)

# transformers' encoder families (bidirectional attention, no generation) that AutoModel
# loads and embedding checkpoints are built on: BERT, RoBERTa and XLM-R (bge, e5, gte,
# all-MiniLM), MPNet (all-mpnet), DistilBERT, ELECTRA, DeBERTa, ModernBERT, ...
ENCODER_MODEL_TYPES = frozenset({
    "albert", "bert", "camembert", "deberta", "deberta-v2", "distilbert", "electra", "ernie", "megatron-bert",
    "mobilebert", "modernbert", "mpnet", "roberta", "roformer", "xlm-roberta", "xlm-roberta-xl",
})

# sentence-transformers' Pooling config flags -> the pooler_config name (max pooling and
# the weighted modes have no counterpart: the model's default applies then).
_SENTENCE_POOLING = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_lasttoken": "LAST"}
_POOLING_MODULE = "sentence_transformers.models.Pooling"


def is_encoder(config: dict[str, Any]) -> bool:
    """Whether a config.json (as a dict) describes an encoder family."""
    return config.get("model_type") in ENCODER_MODEL_TYPES


def resolved_runner(runner: str, source: str) -> str:
    """`runner` with `auto` decided: pooling when the source's config.json names an encoder
    family, else generate (also when it cannot be read here: a GGUF file, the built-in
    model, a Hub id neither cached nor reachable; the worker then refuses an encoder it was
    asked to generate with, naming the field)."""
    if runner != "auto":
        return runner
    config = checkpoint_config(source)
    return "pooling" if config is not None and is_encoder(config) else "generate"


def checkpoint_config(source: str) -> dict[str, Any] | None:
    """The config.json of a transformers directory, or of a Hub id (its cached copy, else
    downloaded unless offline); None for anything else or when it cannot be had."""
    local = Path(source) / "config.json"
    if local.is_file():
        return _read_json(local)
    hub = HubId.parse(source)
    if hub is None or hub.gguf is not None:
        return None
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(hub.repo, "config.json", revision=hub.revision, cache_dir=hub_cache_dir(),
                               local_files_only=hub_offline())
    except Exception as exc:  # noqa: BLE001 - unreachable or missing: auto falls back to generate
        logger.info("no config.json for %s (%s): runner auto takes it as a generating model", source, exc)
        return None
    return _read_json(Path(path))


def own_pooling(model_dir: Path) -> str | None:
    """The pooling the checkpoint's sentence-transformers config names (CLS, MEAN or LAST),
    or None when it has none or names a mode chatserve does not pool by."""
    module_dir = "1_Pooling"
    modules = _read_json(model_dir / "modules.json")
    if isinstance(modules, list):
        module_dir = next((m.get("path", module_dir) for m in modules
                           if isinstance(m, dict) and m.get("type") == _POOLING_MODULE), module_dir)
    config = _read_json(model_dir / module_dir / "config.json")
    if not isinstance(config, dict):
        return None
    chosen = [name for flag, name in _SENTENCE_POOLING.items() if config.get(flag)]
    return chosen[0] if len(chosen) == 1 else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
