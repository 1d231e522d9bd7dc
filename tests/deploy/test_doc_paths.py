"""Every repository path the docs, configs and manifests name exists.

README.md, docs/*.md, configs/*.yaml and k8s/* name files as `serve_app/http/auth.py`,
`tests/deploy/test_configs.py`, `k8s/README.md`, as dotted modules (`tools.bench.compare`,
`serve_app.app:build_app`, `serve_app.http.errors.APIError`), and link each other
(`[CONFIG.md](CONFIG.md)`). A file moved or renamed leaves such a name behind; this test
finds it. Globs and placeholders (`configs/*.yaml`, `<dir>`, `{id}`, `…`) are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

TOP_DIRS = ("serve_app", "workers", "tests", "tools", "configs", "k8s", "docs", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "README.md")
PACKAGES = ("serve_app", "workers", "tools", "tests")

# A path starts a token (not after a letter, `/`, `.`, `-` or `~`, so `bench-results/x`,
# `~/.cache` and URLs do not count) and runs over path characters.
_PATH = re.compile(
    r"(?<![\w/.~-])(?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w./*<>{}…+@-]*"
    r"|(?<![\w/.~-])(?:" + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w.-])")
# A dotted module: `tools.bench.compare`, `serve_app.app:build_app`, `serve_app.http.errors.APIError`.
_MODULE = re.compile(r"(?<![\w/.-])(?:" + "|".join(PACKAGES) + r")(?:\.\w+)+(?::\w+)?(?![\w/-])")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_PLACEHOLDER = ("*", "<", ">", "{", "}", "...", "…")


def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "configs").glob("*.yaml"))]
    files += sorted(p for p in (root / "k8s").iterdir() if p.is_file())
    return files


def _clean(path: str) -> str | None:
    path = path.split("::")[0]  # pytest node ids: tests/x.py::test_y
    path = path.rstrip(".,;:)'\"`]")
    if not path or any(mark in path for mark in _PLACEHOLDER):
        return None
    return path


def named_paths(text: str) -> set[str]:
    """Repository paths written in `text` (slashed form), globs and placeholders left out."""
    found = set()
    for match in _PATH.finditer(text):
        path = _clean(match.group(0))
        if path:
            found.add(path)
    return found


def named_modules(text: str) -> set[str]:
    """Dotted module names written in `text`, with any `:attribute` left off."""
    found = set()
    for match in _MODULE.finditer(text):
        name = match.group(0).split(":")[0].rstrip(".")
        parts = name.split(".")
        # `tools.0.function.parameters`, `tools.N.type`: request field paths, not modules.
        if len(parts) < 2 or any(p[0].isdigit() or (len(p) == 1 and p.isupper()) for p in parts):
            continue
        found.add(name)
    return found


def linked_paths(text: str, doc: Path, root: Path = REPO_ROOT) -> set[str]:
    """Relative Markdown link targets, as paths from the repository root."""
    found = set()
    for target in _LINK.findall(text):
        if "://" in target or target.startswith(("mailto:", "/")):
            continue
        resolved = (doc.parent / target).resolve()
        try:
            found.add(resolved.relative_to(root.resolve()).as_posix())
        except ValueError:
            found.add(target)  # outside the repository: reported as missing
    return found


def path_exists(path: str, root: Path = REPO_ROOT) -> bool:
    return (root / path.rstrip("/")).exists()


def module_exists(name: str, root: Path = REPO_ROOT) -> bool:
    """`a.b.c` is a module file or package; or a module (or package) followed by attributes it defines."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        if base.with_suffix(".py").is_file():
            source = base.with_suffix(".py")
        elif (base / "__init__.py").is_file():
            source = base / "__init__.py"
        elif base.is_dir() and cut == len(parts):
            return True  # a namespace package
        else:
            continue
        attributes = parts[cut:]
        if not attributes:
            return True
        # `serve_app.http.errors.APIError`: the first attribute must be defined or imported there.
        return re.search(rf"\b{re.escape(attributes[0])}\b", source.read_text(encoding="utf-8")) is not None
    return False


def missing_names(text: str, doc: Path, root: Path = REPO_ROOT) -> list[str]:
    missing = [p for p in named_paths(text) | linked_paths(text, doc, root) if not path_exists(p, root)]
    missing += [m for m in named_modules(text) if not module_exists(m, root)]
    return sorted(missing)


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_every_named_repository_path_exists(doc: Path):
    missing = missing_names(doc.read_text(encoding="utf-8"), doc)
    assert not missing, f"{doc.relative_to(REPO_ROOT)} names paths that do not exist: {missing}"


# Made at run time, not in the repository: the Node clients' packages (npm install).
RUNTIME_PATHS = {"tests/clients/node/node_modules"}


def code_files(root: Path = REPO_ROOT) -> list[Path]:
    """The Python files whose docstrings and comments name repository paths, and the Makefile."""
    files = [p for pkg in ("serve_app", "workers", "tools", "tests") for p in sorted((root / pkg).rglob("*.py"))]
    return [root / "Makefile", *(p for p in files if p != Path(__file__))]


def _names_a_module_attribute(path: str, root: Path = REPO_ROOT) -> bool:
    """`tools/servers.stop_session`: a module file, then an attribute of it."""
    stem, _, attribute = path.rpartition(".")
    return bool(stem) and attribute.isidentifier() and (root / f"{stem}.py").is_file()


def test_every_path_named_in_code_comments_exists():
    stale = {}
    for source in code_files():
        missing = [p for p in named_paths(source.read_text(encoding="utf-8"))
                   if not path_exists(p) and p not in RUNTIME_PATHS and not _names_a_module_attribute(p)]
        if missing:
            stale[source.relative_to(REPO_ROOT).as_posix()] = sorted(missing)
    assert not stale, f"docstrings and comments name paths that do not exist: {stale}"


def test_the_extractor_finds_a_missing_path_and_passes_real_ones():
    doc = REPO_ROOT / "docs" / "SAMPLE.md"
    sample = (
        "Run `python -m tools.config_reference --write` (tools/config_reference.py); see "
        "serve_app/no_such_module.py, `serve_app.app:build_app`, serve_app.http.errors.APIError, "
        "`tools.bench.no_such_bench`, tests/deploy/test_configs.py::test_x, configs/*.yaml, "
        "`workers/<pkg>/x.py`, bench-results/gpu.json, ~/.cache/chatserve, Makefile, "
        "[the API](API.md) and [gone](GONE.md#top); the fields tools.0.function.parameters, tools.N.type."
    )
    assert named_paths(sample) == {
        "tools/config_reference.py", "serve_app/no_such_module.py", "tests/deploy/test_configs.py", "Makefile"}
    assert named_modules(sample) == {
        "tools.config_reference", "serve_app.app", "serve_app.http.errors.APIError", "tools.bench.no_such_bench"}
    assert missing_names(sample, doc) == ["docs/GONE.md", "serve_app/no_such_module.py", "tools.bench.no_such_bench"]
