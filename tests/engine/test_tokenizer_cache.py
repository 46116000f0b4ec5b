"""A GGUF model's tokenizer is converted once and then read from the cache folder; the
cached one tokenizes, decodes and templates as the conversion does; a changed file converts
again; a folder others could write to is not trusted; a damaged entry is replaced."""
from __future__ import annotations

import os
import shutil

import pytest

from pdserve.engine.model import tokenizer_cache
from pdserve.engine.model.tokenizer_cache import load_gguf_tokenizer
from tests.models import smollm2_gguf_path, smollm2_tokenizer

TEXTS = ["Hello world", "<|im_start|>user\nHi<|im_end|>", " héllo  \n\n tabs\t", "日本語のテキスト", "x" * 300]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(root))
    return root / "tokenizers"


@pytest.fixture(scope="module")
def gguf_copy(tmp_path_factory):
    """A copy of the embedded model, so a test may change its modification time."""
    path = tmp_path_factory.mktemp("model") / os.path.basename(smollm2_gguf_path())
    shutil.copyfile(smollm2_gguf_path(), path)
    return str(path)


def _entries(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def _assert_same_tokenizer(ours, reference) -> None:
    for text in TEXTS:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
    ids = list(range(0, len(reference), 97))
    assert ours.decode(ids) == reference.decode(ids)
    assert ours.all_special_ids == reference.all_special_ids and ours.eos_token_id == reference.eos_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_converted_once_then_read_from_the_cache(cache, gguf_copy):
    first = load_gguf_tokenizer(gguf_copy)
    [entry] = _entries(cache)
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    second = load_gguf_tokenizer(gguf_copy)
    assert second.name_or_path == str(cache / entry)  # read from the cache, not converted again
    _assert_same_tokenizer(first, smollm2_tokenizer())
    _assert_same_tokenizer(second, smollm2_tokenizer())

    st = os.stat(gguf_copy)
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed
    load_gguf_tokenizer(gguf_copy)
    assert len(_entries(cache)) == 2


def test_a_damaged_entry_is_converted_again_and_replaced(cache, gguf_copy):
    load_gguf_tokenizer(gguf_copy)
    [entry] = _entries(cache)
    (cache / entry / "tokenizer.json").write_text("{not json")
    _assert_same_tokenizer(load_gguf_tokenizer(gguf_copy), smollm2_tokenizer())
    assert load_gguf_tokenizer(gguf_copy).name_or_path == str(cache / entry)  # whole again


@pytest.mark.parametrize("unsafe", ["writable by others", "owned by another user"])
def test_a_folder_others_control_is_not_used(cache, unsafe):
    cache.mkdir(parents=True)
    if unsafe == "writable by others":
        cache.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.fail("this test runs as root (as `make test` does here and in CI) to give the folder away")
        os.chown(cache, 12345, 12345)
        cache.chmod(0o700)
    assert tokenizer_cache._usable_folder(str(cache)) is None


def test_without_a_usable_folder_the_tokenizer_is_converted_and_nothing_is_saved(cache, gguf_copy):
    cache.mkdir(parents=True)
    cache.chmod(0o777)
    tokenizer = load_gguf_tokenizer(gguf_copy)
    assert _entries(cache) == []
    assert tokenizer(TEXTS[1])["input_ids"] == smollm2_tokenizer()(TEXTS[1])["input_ids"]


def test_no_cache_when_the_folder_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert tokenizer_cache._usable_folder(str(blocker / "below-a-file" / "tokenizers")) is None
