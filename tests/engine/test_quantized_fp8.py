"""fp8 checkpoints (issue 51, engine/model/quantization.py, fp8_linear.py): a tiny random
Llama quantized here in the format's own layout (per tensor, per channel, block-wise) gives
the greedy tokens of transformers running the dequantized weights, offline, chunked,
prefix-cached and at TP = 2; its projection weights stay one byte each in memory; every
format or field it does not serve is refused naming the field."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.fp8_linear import Fp8Linear
from pdserve.engine.model.loader import load_model, weight_bytes
from pdserve.engine.model.source import resolve_model
from tests.engine.correctness import varied_prompts
from tests.engine.hf_reference import hf_greedy, load_hf_model
from bench.fp8_checkpoints import edit_fp8_folder, write_fp8_folders

MAX_TOKENS = 16
SCHEMES = ("tensor", "channel", "block")


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """scheme -> (fp8 folder, its dequantized reference); "channel" carries static input scales."""
    out = {}
    for scheme in SCHEMES:
        root = tmp_path_factory.mktemp(f"fp8-{scheme}")
        fp8, ref = str(root / "fp8"), str(root / "reference")
        write_fp8_folders(tiny_llama_dir, fp8, ref, scheme,
                          activation_scheme="static" if scheme == "channel" else "dynamic")
        out[scheme] = (fp8, ref)
    return out


@pytest.fixture(scope="module")
def prompts(tiny):
    return varied_prompts(tiny.arch.vocab_size, [3, 17, 40, 90])


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_equals_transformers_on_the_dequantized_weights(scheme, folders, prompts):
    fp8, ref = folders[scheme]
    loaded = load_model(resolve_model(fp8), torch.float32, "cpu", progress=False)
    expected = hf_greedy(load_hf_model(ref), prompts, MAX_TOKENS, loaded.eos_token_ids)
    assert _greedy(LLM(fp8, loaded_model=loaded, progress=False), prompts) == expected
    chunked = LLM(fp8, loaded_model=loaded, progress=False, long_prefill_token_threshold=7, max_num_batched_tokens=40)
    assert _greedy(chunked, prompts) == expected
    before = chunked.engine.kv_manager.num_hit_tokens
    assert _greedy(chunked, prompts) == expected  # again: the prompts' blocks from the prefix cache
    assert chunked.engine.kv_manager.num_hit_tokens > before


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_projections_stay_one_byte_a_weight_in_memory(scheme, folders, tiny):
    fp8, _ = folders[scheme]
    loaded = load_model(resolve_model(fp8), torch.float32, "cpu", progress=False)
    linears = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 4 * loaded.arch.num_layers  # qkv, o, gate_up, down in every layer
    assert all(m.weight.dtype == torch.uint8 and m.weight_scale.dtype == torch.float32 for m in linears)
    assert loaded.quantization is not None and loaded.quantization.method == "fp8"
    on_disk = os.path.getsize(os.path.join(fp8, "model.safetensors"))
    assert abs(weight_bytes(loaded.model) - on_disk) <= 0.1 * on_disk
    assert weight_bytes(loaded.model) < weight_bytes(tiny.model)


def test_tensor_parallel_splits_block_scales_with_their_weights(folders, prompts):
    """TP = 2 narrows q/k/v and gate/up by rows (each row keeps its block's scale) and o/down
    by columns (their column blocks split with them)."""
    fp8, _ = folders["block"]
    single = _greedy(LLM(fp8, progress=False), prompts)
    llm = LLM(fp8, tensor_parallel_size=2, progress=False, collective_timeout_s=60)
    try:
        assert _greedy(llm, prompts) == single
    finally:
        llm.engine.shutdown()


@pytest.fixture
def fp8_copy(folders, tmp_path):
    def copy(scheme: str = "tensor") -> str:
        dest = str(tmp_path / scheme)
        shutil.copytree(folders[scheme][0], dest)
        return dest
    return copy


@pytest.mark.parametrize("edit,field", [
    (lambda q: q.update(quant_method="gptq"), "quantization_config.quant_method"),
    (lambda q: q.update(quant_method="bitsandbytes"), "quantization_config.quant_method"),
    (lambda q: q.update(activation_scheme="per-token"), "quantization_config.activation_scheme"),
    (lambda q: q.update(fmt="e5m2"), "quantization_config.fmt"),
    (lambda q: q.update(weight_block_size=[128]), "quantization_config.weight_block_size"),
])
def test_a_format_or_field_not_served_is_refused_naming_it(edit, field, fp8_copy):
    folder = fp8_copy()
    edit_fp8_folder(folder, config_edit=edit)
    with pytest.raises(ModelLoadError, match=field.replace(".", r"\.")):
        load_model(resolve_model(folder), torch.float32, "cpu", progress=False)


def test_fused_projections_quantized_unalike_are_refused(fp8_copy):
    folder = fp8_copy()
    edit_fp8_folder(folder, tensors_edit=lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    with pytest.raises(ModelLoadError, match=r"layer 1: .*k_proj.* must be quantized alike"):
        load_model(resolve_model(folder), torch.float32, "cpu", progress=False)


def test_an_fp8_tensor_without_a_scale_is_refused_not_upcast(fp8_copy):
    folder = fp8_copy()
    edit_fp8_folder(folder, tensors_edit=lambda t: t.update(
        {"model.embed_tokens.weight": t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)}))
    with pytest.raises(ModelLoadError, match=r"model\.embed_tokens\.weight is torch\.float8_e4m3fn without a scale"):
        load_model(resolve_model(folder), torch.float32, "cpu", progress=False)


def test_a_quantized_lm_head_is_refused_naming_the_tensor(fp8_copy):
    folder = fp8_copy()
    edit_fp8_folder(folder, tensors_edit=lambda t: t.update({"lm_head.weight_scale": torch.tensor(1.0)}))
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight_scale"):
        load_model(resolve_model(folder), torch.float32, "cpu", progress=False)
