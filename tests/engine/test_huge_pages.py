"""The CPU KV cache asks Linux for transparent huge pages before its first touch
(engine/worker/huge_pages.py); the kernel's own accounting (/proc/self/smaps) is the witness."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from engine.config import ModelArchConfig
from engine.worker.huge_pages import HUGE_PAGE, advise_huge_pages, zeros_on_huge_pages
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


def test_advice_covers_the_whole_huge_pages_inside_the_tensor():
    tensor = torch.empty(5 * HUGE_PAGE, dtype=torch.uint8)
    advised = advise_huge_pages(tensor)
    if not sys.platform.startswith("linux"):
        assert advised == 0
        return
    start = tensor.data_ptr()
    whole_pages = ((start + tensor.numel()) // HUGE_PAGE) - (-(-start // HUGE_PAGE))
    assert advised == whole_pages * HUGE_PAGE >= 4 * HUGE_PAGE


def test_small_tensors_are_left_alone():
    assert advise_huge_pages(torch.empty(HUGE_PAGE // 2, dtype=torch.uint8)) == 0


def test_the_cpu_kv_cache_is_backed_by_huge_pages_where_the_kernel_gives_them():
    arch = ModelArchConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False)
    caches = allocate_kv_caches(4096, arch, 16, torch.float32, torch.device("cpu"))  # 32 MiB
    assert all(not c.any() for c in caches)
    huge = huge_bytes_around(caches[0].data_ptr() + 8 * HUGE_PAGE) if sys.platform.startswith("linux") else 0
    if thp_mode() in ("always", "madvise"):  # "madvise" (the default): only the advice gives them
        assert huge >= HUGE_PAGE
    else:
        assert huge == 0


def test_zeros_on_huge_pages_is_zeros():
    t = zeros_on_huge_pages((3, HUGE_PAGE // 4), torch.float32)
    assert t.shape == (3, HUGE_PAGE // 4) and t.dtype == torch.float32 and not t.any()
