"""A model's identity in block hashes and the KV wire header is its files' digest: the same
files at two paths are one model, one changed weight (same name, same shapes) is another."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine import EngineCore
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.model.identity import checkpoint_identity
from pdserve.engine.model.source import resolve_model


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _change_one_weight(folder: str) -> None:
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if tensors[n].dim() > 1)
    tensors[name][0, 0] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture
def two_copies(tiny_llama_dir, tmp_path):
    # the same folder name under two parents: a name says nothing of the weights
    return _copy(tiny_llama_dir, tmp_path / "a" / "model"), _copy(tiny_llama_dir, tmp_path / "b" / "model")


def test_the_same_files_at_two_paths_are_one_identity(two_copies, tiny_llama_dir):
    a, b = two_copies
    assert checkpoint_identity(resolve_model(a)) == checkpoint_identity(resolve_model(b)) \
        == checkpoint_identity(resolve_model(tiny_llama_dir))


def test_one_changed_weight_is_another_identity_and_a_readme_is_not(two_copies):
    a, b = two_copies
    with open(f"{b}/README.md", "w") as f:
        f.write("notes beside the weights change no output\n")
    assert checkpoint_identity(resolve_model(b)) == checkpoint_identity(resolve_model(a))
    _change_one_weight(b)
    assert checkpoint_identity(resolve_model(b)) != checkpoint_identity(resolve_model(a))
    assert checkpoint_identity(resolve_model(b)).startswith("sha256:")


def test_a_changed_tokenizer_or_config_is_another_identity(two_copies):
    a, b = two_copies
    with open(f"{b}/tokenizer_config.json") as f:
        text = f.read()
    with open(f"{b}/tokenizer_config.json", "w") as f:
        f.write(text.replace("{", '{"model_max_length_note": 1, ', 1))
    assert checkpoint_identity(resolve_model(b)) != checkpoint_identity(resolve_model(a))


def test_new_weights_written_over_old_ones_name_other_blocks(two_copies):
    """The weights of a folder rewritten in place (same name, same shapes): an engine over
    the new files hashes every block differently from one over the old, and its KV header
    names the new identity, so neither a prefix cache nor a kvstore can mix the two."""
    a, _ = two_copies
    config = EngineConfig(model=a, cache=CacheConfig(kv_cache_memory_bytes=4 << 20))
    old = EngineCore(config, progress=False)
    prompt = list(range(1000, 1040))
    old_hashes = old.info.prompt_block_hashes(prompt, "")
    _change_one_weight(a)
    new = EngineCore(config, progress=False)
    new_hashes = new.info.prompt_block_hashes(prompt, "")
    assert len(new_hashes) == len(old_hashes) > 0
    assert not set(new_hashes) & set(old_hashes)
    assert new.info.kv_layout.model_id == checkpoint_identity(resolve_model(a)) != old.info.kv_layout.model_id
    assert new.info.kv_layout.fingerprint != old.info.kv_layout.fingerprint
    assert torch.equal(torch.tensor(new.info.kv_layout.block_shape), torch.tensor(old.info.kv_layout.block_shape))
