"""The CPU KV cache is a mapping of its own, advised onto transparent huge pages before its
first touch (engine/worker/huge_pages.py); the kernel's accounting (/proc/self/smaps) is the
witness."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from engine.config import ModelArchConfig
from engine.worker.huge_pages import HUGE_PAGE, zeros_on_huge_pages
from engine.worker.kv_cache import allocate_kv_caches

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """'always', 'madvise' or 'never' (the bracketed word), '' where the kernel has no THP."""
    if not THP_MODE.exists():
        return ""
    return THP_MODE.read_text().split("[")[1].split("]")[0]


def huge_bytes_around(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, in bytes."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def tiny_arch() -> ModelArchConfig:
    return ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False)


def test_the_cpu_kv_cache_is_backed_by_huge_pages_where_the_kernel_gives_them():
    # memory malloc took back (on small pages already) must not be what the cache gets
    for _ in range(3):
        torch.ones(40 << 20, dtype=torch.uint8).sum()
    caches = allocate_kv_caches(4096, tiny_arch(), 16, torch.float32, torch.device("cpu"))  # 32 MiB
    assert all(not c.any() for c in caches)
    caches[1][1, -1].fill_(1.0)  # every layer's view is writable memory of its own
    assert caches[1].sum() == caches[1][1, -1].numel() and not caches[0].any()
    huge = huge_bytes_around(caches[0].data_ptr() + 8 * HUGE_PAGE) if sys.platform.startswith("linux") else 0
    if thp_mode() in ("always", "madvise"):  # "madvise" (the default): only the advice gives them
        assert huge >= 8 * HUGE_PAGE
    else:
        assert huge == 0


def test_the_mapping_lives_as_long_as_the_tensor():
    t = zeros_on_huge_pages((4, HUGE_PAGE // 4), torch.float32)
    gc.collect()
    t[3, -1] = 7.0
    assert t.shape == (4, HUGE_PAGE // 4) and t.dtype == torch.float32 and t.sum() == 7.0


def test_small_caches_are_plain_zeros():
    t = zeros_on_huge_pages((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and not t.any()
