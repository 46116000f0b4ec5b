"""What stays true of an engine once it is built: the facts its callers may read from any
thread (the engine itself is not thread-safe), and the checks computed from them alone."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.core.block_hash import hash_full_blocks
from pdserve.engine.kv_transfer import KVLayout
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.validation import validate_request


@dataclass(frozen=True)
class EngineInfo:
    block_size: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    root_hash: bytes  # the model fingerprint every block hash is chained from
    # one block of a KVPayload: [num_layers, 2, block_size, num_kv_heads, head_dim]
    kv_block_shape: tuple[int, ...]
    kv_layout: KVLayout  # what a block imported from the kvstore must be

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The checks of EngineCore.add_request that need no engine state; raises
        InvalidRequestError naming the field."""
        validate_request("validate", prompt_token_ids, params, self.max_model_len, self.vocab_size, ())

    def prompt_block_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """The names of a prompt's full blocks, as the kvstore and every engine know them."""
        return hash_full_blocks(self.root_hash, token_ids, self.block_size, cache_salt=cache_salt)
