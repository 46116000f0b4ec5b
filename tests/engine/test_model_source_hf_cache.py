"""--model org/name from the local Hugging Face cache (engine/model/source.py): the hub's
layout (refs/<revision> -> snapshots/<commit>/, files linked into blobs/), found through
HF_HUB_CACHE, HF_HOME or the default; a branch, a tag or a commit as the revision; and every
miss an error naming the path searched, with no network access ever."""
from __future__ import annotations

import argparse
import os
import shutil
import socket
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.source import ModelSource, hf_hub_cache, resolve_model
from pdserve.services.router.core.model_info import describe_model
from pdserve.services.worker.config import add_worker_arguments, worker_config_from_args
from tests.models import build_tiny_llama

REPO = "tiny-org/tiny-llama"
MAIN, OTHER = "a" * 40, "b" * 40


def add_snapshot(cache: Path, repo_id: str, commit: str, files: str | Path, refs: tuple[str, ...] = ()) -> Path:
    """The hub's layout: the snapshot's files are links into blobs/, the refs hold the commit."""
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(Path(files).iterdir()):
        blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-seed-1"), seed=1)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_llama_dir, other_weights) -> Path:
    """main -> the tiny llama; v1 -> other weights; HF_HUB_CACHE points here."""
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, MAIN, tiny_llama_dir, refs=("main",))
    add_snapshot(cache, REPO, OTHER, other_weights, refs=("v1",))
    for var in ("HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_name_resolves_to_its_main_snapshot(hub):
    snapshot = str(hub / f"models--tiny-org--tiny-llama/snapshots/{MAIN}")
    assert resolve_model(REPO) == ModelSource("hf_dir", snapshot, REPO)
    assert resolve_model(REPO, "main") == resolve_model(REPO)


def test_a_branch_or_a_commit_picks_the_snapshot(hub):
    assert resolve_model(REPO, "v1").path.endswith(f"/snapshots/{OTHER}")
    assert resolve_model(REPO, OTHER).path.endswith(f"/snapshots/{OTHER}")  # a full hash needs no ref
    assert resolve_model(REPO, "v1").model_id == REPO  # the name shown is the name asked for


@pytest.mark.parametrize("env,where", [
    ({"HF_HUB_CACHE": "{tmp}/direct"}, "{tmp}/direct"),
    ({"HF_HOME": "{tmp}/home"}, "{tmp}/home/hub"),
    ({"HF_HUB_CACHE": "{tmp}/direct", "HF_HOME": "{tmp}/home"}, "{tmp}/direct"),
    ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/huggingface/hub"),
    ({"HOME": "{tmp}/user"}, "{tmp}/user/.cache/huggingface/hub"),
])
def test_where_the_cache_is(monkeypatch, tmp_path, env, where):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value.format(tmp=tmp_path))
    assert hf_hub_cache() == where.format(tmp=tmp_path)


def test_the_engine_runs_a_cached_model_and_the_revision_reaches_it(hub, tiny, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    folder = LLM(tiny_llama_dir, loaded_model=tiny, progress=False, kv_cache_memory_bytes=4 << 20)
    cached = LLM(REPO, progress=False, kv_cache_memory_bytes=4 << 20)
    assert cached.engine.source.model_id == REPO
    assert cached.engine.model_key == folder.engine.model_key  # the same files: the same KV identity
    prompt = "The rivers of"
    assert cached.generate(prompt, params)[0].token_ids == folder.generate(prompt, params)[0].token_ids
    v1 = LLM(REPO, revision="v1", progress=False, kv_cache_memory_bytes=4 << 20)
    assert v1.engine.source.path.endswith(OTHER) and v1.engine.model_key != folder.engine.model_key


def test_the_router_describes_a_cached_model_at_its_revision(hub):
    info = describe_model(REPO, revision="v1")
    assert (info.name, info.model_id, info.served_name) == (REPO, REPO, REPO)


def test_the_workers_take_revision():
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, default_port=0)
    assert worker_config_from_args(parser.parse_args(["--model", REPO, "--revision", "v1"])).engine.revision == "v1"
    assert worker_config_from_args(parser.parse_args([])).engine.revision is None


# ---- misses: each names the path it searched ---------------------------------------------
def test_a_repo_not_in_the_cache(hub):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("tiny-org/absent")
    message = str(e.value)
    assert message.startswith("tiny-org/absent: no such model folder, .gguf file or alias")
    assert f"{hub}/models--tiny-org--absent does not exist (revision 'main'" in message
    assert "never downloads" in message


def test_a_revision_without_its_ref(hub):
    with pytest.raises(ModelLoadError) as e:
        resolve_model(REPO, "v2")
    message = str(e.value)
    assert f"revision 'v2' in the Hugging Face cache: {hub}/models--tiny-org--tiny-llama/refs/v2 does not exist" \
        in message
    assert "refs there: main, v1" in message


def test_a_ref_whose_snapshot_is_missing(hub):
    shutil.rmtree(hub / f"models--tiny-org--tiny-llama/snapshots/{OTHER}")
    for revision in ("v1", OTHER):
        with pytest.raises(ModelLoadError) as e:
            resolve_model(REPO, revision)
        assert f"{hub}/models--tiny-org--tiny-llama/snapshots/{OTHER} does not exist" in str(e.value)
        assert f"revision {revision!r}" in str(e.value)


def test_a_snapshot_without_config_json(hub, tmp_path):
    (tmp_path / "empty").mkdir()
    add_snapshot(hub, "tiny-org/no-config", MAIN, tmp_path / "empty", refs=("main",))
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model("tiny-org/no-config")


def test_a_ref_that_holds_no_commit(hub):
    (hub / "models--tiny-org--tiny-llama/refs/broken").write_text("not a hash\n")
    with pytest.raises(ModelLoadError, match="holds 'not a hash', not a commit hash"):
        resolve_model(REPO, "broken")


def test_a_revision_cannot_leave_refs(hub):
    with pytest.raises(ModelLoadError, match="not a branch, tag or commit name"):
        resolve_model(REPO, "../snapshots")


def test_the_engine_fails_with_the_miss(hub):
    with pytest.raises(ModelLoadError, match="revision 'nope'"):
        LLM(REPO, revision="nope", progress=False)


def test_an_existing_folder_still_wins_and_a_typo_is_still_an_error(hub, tiny_llama_dir, tmp_path, monkeypatch):
    org = tmp_path / "tiny-org"
    shutil.copytree(tiny_llama_dir, org / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO) == ModelSource("hf_dir", str(org / "tiny-llama"), "tiny-llama")  # a path first
    with pytest.raises(ModelLoadError, match="no such model folder"):
        resolve_model("no/such/path")  # two slashes: never a repo id


def test_a_revision_with_a_folder_file_or_alias_is_refused(tiny_llama_dir):
    for model in (tiny_llama_dir, "smollm2"):
        with pytest.raises(ModelLoadError, match="^revision: 'v1' applies to a model from the Hugging Face cache"):
            resolve_model(model, "v1")
