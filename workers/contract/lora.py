"""What names a LoRA adapter across the ingress and the workers, and where its files may be.

Torch-free: the ingress resolves a request's `model` to a `LoraRequest`, checks a runtime
load's path against the model's `lora.adapter_dir`, and passes both to the worker.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from workers.contract.errors import WorkerError


class LoraAdapterError(WorkerError, ValueError):
    """An adapter that cannot be served here: a bad path, bad files, or something PEFT
    allows that chatserve does not compute (a 400 naming the adapter)."""

    param = "model"  # the request's `model` names the adapter; the load route's field is `lora_path`
    code = "invalid_lora_adapter"


@dataclass(frozen=True)
class LoraRequest:
    """One adapter as a request names it. `key` identifies these weights: the name with the
    path and the registration it came from, so an adapter unloaded and loaded again under
    the same name never meets the old weights in a replica's slots or prefix cache."""

    name: str
    path: str
    key: str

    @classmethod
    def of(cls, name: str, path: str, generation: str = "config") -> LoraRequest:
        digest = hashlib.blake2b(f"{name}\0{path}\0{generation}".encode(), digest_size=8).hexdigest()
        return cls(name=name, path=path, key=f"{name}@{digest}")


def adapter_path_inside(adapter_dir: str | None, path: str) -> Path:
    """`path` resolved (symlinks followed), if it lies inside `adapter_dir`; raises
    LoraAdapterError otherwise, or when runtime loading is off (no `adapter_dir`)."""
    if adapter_dir is None:
        raise LoraAdapterError("this model loads no adapters at run time (its lora.adapter_dir is not set)")
    root = Path(adapter_dir).resolve()
    candidate = Path(path)
    resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if resolved != root and root not in resolved.parents:
        raise LoraAdapterError(f"lora_path {path!r} is outside the adapter directory")
    if not resolved.is_dir():
        raise LoraAdapterError(f"lora_path {path!r} is not a directory")
    return resolved
