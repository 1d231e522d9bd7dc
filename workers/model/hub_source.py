"""A model source given as a Hugging Face Hub id (`org/name`, or `org/name@revision`),
resolved to a directory of huggingface_hub's own cache: downloaded where the network
allows, read from the cache alone where it does not (`HF_HUB_OFFLINE=1`, or the Hub
unreachable). The cache is huggingface_hub's (`HF_HUB_CACHE`, else `HF_HOME`/hub), shared
with every other tool of the field, so a model pulled once (or baked into an image) is
found again. Only what serving reads is fetched: configs, tokenizer files and safetensors
weights (no .bin, .gguf or other formats of the same repository); or, for a repository of
GGUF files, the one file a tag names (`org/name:Q4_K_M`, as llama.cpp's `-hf` and Ollama
take it)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# An id of the Hub: one owner, one name (letters, digits, - _ .), an optional @revision
# (a branch, tag or commit), an optional :tag naming one GGUF file of the repository (its
# quantization, or the file's name). Anything with more slashes, or that exists on disk,
# is a path.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<revision>[\w./-]+))?"
                     r"(?::(?P<gguf>[\w.-]+))?")
SERVED_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str | None = None
    gguf: str | None = None  # the :tag: which GGUF file of the repository

    @classmethod
    def parse(cls, source: str) -> "HubId | None":
        """The Hub id `source` names, or None when it is a path (or names a file on disk)."""
        match = _HUB_ID.fullmatch(source)
        if match is None or Path(source).exists() or (source.endswith(".gguf") and match["gguf"] is None):
            return None
        return cls(match["repo"], match["revision"], match["gguf"])

    def __str__(self) -> str:
        revision = "" if self.revision is None else f"@{self.revision}"
        return self.repo + revision + ("" if self.gguf is None else f":{self.gguf}")


def hub_cache_dir() -> Path:
    """huggingface_hub's cache, read from the environment at each call (not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(hub: HubId) -> Path:
    """The cached snapshot directory of `hub`, downloaded first unless offline; a
    FileNotFoundError naming the id, the cache and what was looked for when there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache, offline = hub_cache_dir(), hub_offline()
    try:
        path = Path(snapshot_download(hub.repo, revision=hub.revision, cache_dir=cache, local_files_only=offline,
                                      allow_patterns=SERVED_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        where = "HF_HUB_OFFLINE is set" if offline else f"the Hub did not answer ({type(exc).__name__}: {exc})"
        raise FileNotFoundError(
            f"model source {str(hub)!r} (a Hub id): no snapshot of revision {hub.revision or 'main'} in "
            f"huggingface_hub's cache at {cache}, and {where}; download it there, or give a local directory "
            "or .gguf file") from None
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"model source {str(hub)!r} (a Hub id): its snapshot at {path} has no config.json "
                                "and safetensors weights (for a repository of GGUF files, name one with a tag: "
                                f"{hub.repo}:Q4_K_M; .bin weights are not served)")
    return path


def resolve_hub_gguf(hub: HubId) -> Path:
    """The cached GGUF file of `hub` its tag names, downloaded first unless offline: the
    file whose name is the tag, or the one whose stem ends with it (`Q4_K_M` picks
    `model-Q4_K_M.gguf`, case aside). A FileNotFoundError listing the repository's GGUF
    files when none or several fit."""
    from huggingface_hub import hf_hub_download

    files = _gguf_files(hub)
    tag = (hub.gguf or "").lower()
    chosen = [name for name in files if Path(name).name.lower() == tag] or [
        name for name in files if Path(name).stem.lower().endswith(tag)]
    if len(chosen) != 1:
        found = ", ".join(sorted(files)) or "none"
        raise FileNotFoundError(f"model source {str(hub)!r} (a Hub GGUF): {'several' if chosen else 'no'} GGUF "
                                f"files fit the tag {hub.gguf!r}; the repository's GGUF files: {found}")
    return Path(hf_hub_download(hub.repo, chosen[0], revision=hub.revision, cache_dir=hub_cache_dir(),
                                local_files_only=hub_offline()))


def _gguf_files(hub: HubId) -> list[str]:
    """The .gguf files of the repository: listed by the Hub, or, offline, those of the
    cached snapshot."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache, offline = hub_cache_dir(), hub_offline()
    try:
        if not offline:
            return [name for name in HfApi().list_repo_files(hub.repo, revision=hub.revision) if name.endswith(".gguf")]
        snapshot = Path(snapshot_download(hub.repo, revision=hub.revision, cache_dir=cache, local_files_only=True,
                                          allow_patterns=["*.gguf"]))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        where = "HF_HUB_OFFLINE is set" if offline else f"the Hub did not answer ({type(exc).__name__}: {exc})"
        raise FileNotFoundError(f"model source {str(hub)!r} (a Hub GGUF): no snapshot of revision "
                                f"{hub.revision or 'main'} in huggingface_hub's cache at {cache}, and {where}") from None
    return [str(path.relative_to(snapshot)) for path in snapshot.rglob("*.gguf")]
