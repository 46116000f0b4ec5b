"""cache_salt enters the first block's hash only; unsalted hashes are unchanged; the
kvstore's fingerprint from a block header is the engine's root hash."""
from __future__ import annotations

from pdserve.engine.core.block_hash import (check_cache_salt, hash_block_tokens, hash_full_blocks, kv_layout_fingerprint,
                                            model_fingerprint)

ROOT = model_fingerprint("m", "torch.float32", 2, 2, 16, 4)
TOKENS = list(range(12))


def test_the_salt_changes_every_hash_through_the_first_block_only():
    plain, salted = hash_full_blocks(ROOT, TOKENS, 4), hash_full_blocks(ROOT, TOKENS, 4, cache_salt="a")
    assert salted[0] == hash_block_tokens(ROOT, TOKENS[:4], ("a",))
    assert salted[1] == hash_block_tokens(salted[0], TOKENS[4:8])  # later blocks: no extra key, chained
    assert all(p != s for p, s in zip(plain, salted))
    assert hash_full_blocks(ROOT, TOKENS, 4, cache_salt="b") != salted
    assert hash_full_blocks(ROOT, TOKENS, 4, cache_salt="") == plain == hash_full_blocks(ROOT, TOKENS, 4)


def test_hashing_on_from_a_parent_keeps_the_salt_where_it_was():
    salted = hash_full_blocks(ROOT, TOKENS, 4, cache_salt="a")
    assert hash_full_blocks(ROOT, TOKENS, 4, salted[0], 1, cache_salt="a") == salted[1:]


def test_a_bad_salt_is_named():
    assert check_cache_salt("tenant-1") is None and check_cache_salt("") is None
    assert "string" in check_cache_salt(7)
    assert "257" in check_cache_salt("s" * 257)
    assert "surrogate" in check_cache_salt("\ud800")


def test_the_fingerprint_from_a_header_is_the_engines_root():
    assert kv_layout_fingerprint("m", "float32", (2, 2, 4, 2, 16)) == ROOT
    assert kv_layout_fingerprint("m", "float16", (2, 2, 4, 2, 16)) != ROOT
