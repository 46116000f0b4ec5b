"""GGUF weights kept in their blocks (`quantization="gguf"`, issue 51; engine/model/gguf_linear.py,
gguf_loading.py): tiny random Llamas written here as llama.cpp writes them, in Q4_0, Q4_1 and
Q8_0, give the greedy tokens of transformers running the same file (which dequantizes it),
offline, chunked, prefix-cached and at TP = 2; the embedded SmolLM2 (Q4_1, its embedding
Q8_0) gives the tokens of its dequantized weights in about a sixth of their memory; what
does not apply is refused naming `quantization`."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.engine_setup import model_naming
from pdserve.engine.errors import ModelLoadError
from pdserve.engine.model.gguf_file import GGUFFile
from pdserve.engine.model.gguf_linear import KEPT_TYPES, GGUFEmbedding, GGUFLinear
from pdserve.engine.model.loader import load_model, weight_bytes
from pdserve.engine.model.source import resolve_model
from tests.engine.correctness import varied_prompts
from tests.engine.hf_reference import hf_greedy, load_hf_model
from tests.gguf_models import write_tiny_gguf
from tests.models import build_tiny_llama

MAX_TOKENS = 16
# projections' type -> the embedding's (the LM head is tied to it)
FILES = {"Q4_0": "Q4_0", "Q4_1": "Q8_0", "Q5_1": "Q5_0", "Q8_0": "Q8_0"}


@pytest.fixture(scope="module")
def gguf_files(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    return {kind: write_tiny_gguf(tiny_llama_dir, str(root / f"tiny-{kind}.gguf"), kind, embedding)
            for kind, embedding in FILES.items()}


@pytest.fixture(scope="module")
def prompts(tiny):
    return varied_prompts(tiny.arch.vocab_size, [3, 17, 40, 90])


def _load(path: str):
    return load_model(resolve_model(path), torch.float32, "cpu", progress=False, quantization="gguf")


def _tensor_bytes(path: str) -> int:
    """The weights' bytes in a GGUF file (its tokenizer's metadata aside)."""
    return sum(t.data.nbytes for t in GGUFFile(path).tensors)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("kind", sorted(FILES))
def test_greedy_equals_transformers_on_the_same_file(kind, gguf_files, prompts):
    path = gguf_files[kind]
    loaded = _load(path)
    expected = hf_greedy(load_hf_model(path), prompts, MAX_TOKENS, loaded.eos_token_ids)
    assert _greedy(LLM(path, loaded_model=loaded, quantization="gguf", progress=False), prompts) == expected
    chunked = LLM(path, loaded_model=loaded, quantization="gguf", progress=False, long_prefill_token_threshold=7,
                  max_num_batched_tokens=40)
    assert _greedy(chunked, prompts) == expected
    before = chunked.engine.kv_manager.num_hit_tokens
    assert _greedy(chunked, prompts) == expected  # again: the prompts' blocks from the prefix cache
    assert chunked.engine.kv_manager.num_hit_tokens > before


@pytest.mark.parametrize("kind", sorted(FILES))
def test_the_weights_stay_in_their_blocks(kind, gguf_files, tiny):
    loaded = _load(gguf_files[kind])
    model = loaded.model
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 4 * loaded.arch.num_layers + 1  # qkv, o, gate_up, down; the LM head
    assert isinstance(model.embed_tokens, GGUFEmbedding) and model.embed_tokens.ggml_type == model.lm_head.ggml_type
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one table of blocks
    assert all(p.dtype == torch.uint8 for m in linears for p in m.parameters())
    on_disk = _tensor_bytes(gguf_files[kind])
    assert abs(weight_bytes(model) - on_disk) <= 0.1 * on_disk
    assert weight_bytes(model) < weight_bytes(tiny.model) / 3


def test_tensor_parallel_splits_the_blocks_with_their_rows_and_columns(gguf_files, prompts):
    """TP = 2 narrows q/k/v, gate/up and the vocabulary by rows and o/down by whole blocks of columns."""
    path = gguf_files["Q4_1"]
    single = _greedy(LLM(path, quantization="gguf", progress=False), prompts)
    llm = LLM(path, quantization="gguf", tensor_parallel_size=2, progress=False, collective_timeout_s=60)
    try:
        assert _greedy(llm, prompts) == single
    finally:
        llm.engine.shutdown()


def test_fused_parts_of_unlike_types_are_dequantized_alone(tiny_llama_dir, tmp_path, prompts):
    path = write_tiny_gguf(tiny_llama_dir, str(tmp_path / "mixed.gguf"), "Q4_1", mixed_layer=1)
    loaded = _load(path)
    assert not isinstance(loaded.model.layers[1].attn.qkv_proj, GGUFLinear)  # Q4_1 q, Q8_0 k: dequantized
    assert isinstance(loaded.model.layers[1].attn.o_proj, GGUFLinear)
    assert isinstance(loaded.model.layers[0].attn.qkv_proj, GGUFLinear)
    kept = _greedy(LLM(path, loaded_model=loaded, quantization="gguf", progress=False), prompts)
    assert kept == _greedy(LLM(path, progress=False), prompts)


def test_the_embedded_model_in_its_own_4_bit_weights(smollm2_loaded, smollm2_path):
    """Q4_1 projections, a Q8_0 embedding and head: the tokens of the dequantized weights
    (test_correctness_smollm2 proves those equal transformers'), in a sixth of their memory."""
    loaded = load_model(resolve_model("smollm2"), torch.float32, "cpu", progress=False, quantization="gguf")
    tokenizer = loaded.tokenizer
    paragraph = "The keeper climbed the stairs each evening and lit the lamp before the fog came. "
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                             paragraph * 8 + "What did the keeper light?")]
    float_run = _greedy(LLM("smollm2", loaded_model=smollm2_loaded, progress=False), prompts)
    kept = LLM("smollm2", loaded_model=loaded, quantization="gguf", progress=False, long_prefill_token_threshold=64,
               max_num_batched_tokens=96)
    assert _greedy(kept, prompts) == float_run
    on_disk = _tensor_bytes(smollm2_path)
    assert abs(weight_bytes(loaded.model) - on_disk) <= 0.1 * on_disk
    assert weight_bytes(loaded.model) <= weight_bytes(smollm2_loaded.model) / 5


def test_a_quantized_engine_names_its_kv_apart(gguf_files, tiny):
    """A prefill and a decode worker loading one file in two ways compute different KV: they
    never share a block name."""
    source = resolve_model(gguf_files["Q4_1"])
    plain_key, plain_root = model_naming(source, torch.float32, tiny.arch, 16)
    kept_key, kept_root = model_naming(source, torch.float32, tiny.arch, 16, quantization="gguf")
    assert kept_key == plain_key + "+gguf" and kept_root != plain_root


def test_what_does_not_apply_is_refused_naming_quantization(gguf_files, tiny_llama_dir):
    with pytest.raises(ValueError, match=r"quantization: must be one of \['fp8', 'gguf'\].*'awq'"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match=r"quantization: 'gguf' does not apply to a Hugging Face folder"):
        load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False, quantization="gguf")
    with pytest.raises(ValueError, match=r"quantization: 'fp8' does not apply to a GGUF file"):
        load_model(resolve_model(gguf_files["Q8_0"]), torch.float32, "cpu", progress=False, quantization="fp8")
    with pytest.raises(ModelLoadError, match=r"quantization: 'fp8' needs a checkpoint saved in it"):
        load_model(resolve_model(tiny_llama_dir), torch.float32, "cpu", progress=False, quantization="fp8")


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory) -> str:
    """A tiny Llama whose rows hold 256-column blocks, mixed as llama.cpp's Q4_K_M mixes them:
    Q4_K projections, layer 1's v_proj and down_proj in Q6_K, a Q6_K embedding (the tied head)."""
    root = tmp_path_factory.mktemp("tiny-k-quants")
    hf_dir = build_tiny_llama(root / "hf", hidden_size=512, num_heads=8, num_kv_heads=4)
    return write_tiny_gguf(hf_dir, str(root / "tiny-Q4_K_M.gguf"), "Q4_K", "Q6_K",
                           types={"blk.1.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"})


def test_k_quants_stay_in_their_blocks_and_decode_as_transformers_does(k_quant_file):
    loaded = _load(k_quant_file)
    model = loaded.model
    assert model.embed_tokens.ggml_type == KEPT_TYPES["Q6_K"] and model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].attn.qkv_proj.ggml_type == KEPT_TYPES["Q4_K"]
    assert not isinstance(model.layers[1].attn.qkv_proj, GGUFLinear)  # Q4_K q/k with a Q6_K v: dequantized
    assert model.layers[1].mlp.down_proj.ggml_type == KEPT_TYPES["Q6_K"]
    on_disk = _tensor_bytes(k_quant_file)
    assert weight_bytes(model) < 1.2 * on_disk
    prompts = varied_prompts(loaded.arch.vocab_size, [3, 17, 40])
    expected = hf_greedy(load_hf_model(k_quant_file), prompts, MAX_TOKENS, loaded.eos_token_ids)
    assert _greedy(LLM(k_quant_file, loaded_model=loaded, quantization="gguf", progress=False), prompts) == expected
    llm = LLM(k_quant_file, quantization="gguf", tensor_parallel_size=2, progress=False, collective_timeout_s=60)
    try:  # o_proj's 512 columns split as one 256-column block a rank
        assert _greedy(llm, prompts) == expected
    finally:
        llm.engine.shutdown()
