"""KV blocks sealed and encrypted with a key only the platform holds (AES-256-GCM).

Everything that leaves a worker's memory for the data plane (the kvstore's memory, its
disk tier, Redis, Mooncake) is ciphertext with a tag; a reader decrypts a block only when
the tag holds, so a block read by a process without the platform's secret tells it
nothing, and one written by such a process is refused (counted, recomputed):

    platform token ──HMAC──▶ seal key ──HMAC(cache salt)──▶ tenant key ──HMAC(nonce)──▶ block key
                   └─HMAC──▶ names key   (the root of every block hash: engine/core/block_hash.py)

    block key:  AES-256-GCM, IV 0, AAD = the header's fields (kv_integrity.header_bytes),
                nonce (16 random bytes) and tag (16) in the header's `seal`

- One key per block: the nonce is random per write, so no key ever encrypts twice (two
  writes of one block differ in their low bits when kernels are not bitwise deterministic;
  a repeated GCM nonce under one key would leak their XOR and the tag's key).
- The tenant key is derived from the request's cache salt, so a salted tenant's blocks stay
  opaque to a holder of the platform's token who does not know the salt. The AAD binds the
  block's name (its hash chains from the salt), model, dtype, shape and token count, so a
  block moved under another name, model or request fails.
- The names key makes object names (block hashes, and the file and Mooncake keys built on
  them) unguessable from token ids: without it nobody can probe whether a prompt is cached.

AES-GCM was chosen by measurement (docs/kvstore.md, `python -m bench.kv_checksum`): with
AES-NI and VAES it encrypts and authenticates at 9 GB/s on this machine, where a keyed
BLAKE3 only authenticates at 4.6 GB/s, HMAC-SHA256 at 1.8 and ChaCha20-Poly1305 at 3.3.

With no internal token configured there is no secret: blocks then carry the unkeyed XXH3
checksum (kv_integrity.checksum), which catches corruption but not a forger, and a worker
says so at start. A worker with a key refuses every block without a valid seal (no
downgrade), and one without a key refuses sealed blocks (it cannot check them).
"""
from __future__ import annotations

import hmac
import logging
import secrets
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

logger = logging.getLogger(__name__)

NONCE_BYTES = TAG_BYTES = 16
SEAL_BYTES = NONCE_BYTES + TAG_BYTES  # the header's `seal`: nonce, then tag
_IV = bytes(12)  # every block key encrypts once (its nonce is random), so a fixed IV is safe


class SealBroken(Exception):
    """The tag does not hold: the block was forged, altered, or sealed under another key."""


@dataclass(frozen=True)
class KVKeys:
    """The keys derived from the platform's token; never printed."""
    seal_key: bytes = field(repr=False)
    names_key: bytes = field(repr=False)

    @classmethod
    def from_token(cls, token: str | None) -> KVKeys | None:
        """None without a token (blocks then carry only the unkeyed checksum)."""
        if not token:
            return None
        ikm = token.encode()
        return cls(hmac.digest(ikm, b"pdserve kv seal v3", "sha256"),
                   hmac.digest(ikm, b"pdserve kv names v1", "sha256"))

    def _block_key(self, cache_salt: str, nonce: bytes) -> bytes:
        tenant = hmac.digest(self.seal_key, b"salt\0" + cache_salt.encode(), "sha256")
        return hmac.digest(tenant, nonce, "sha256")

    def seal_into(self, aad: bytes, data, out, cache_salt: str = "") -> bytes:
        """Encrypts `data` into `out` (a writable buffer as long); returns the seal (nonce, tag)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        encryptor = Cipher(algorithms.AES(self._block_key(cache_salt, nonce)), modes.GCM(_IV)).encryptor()
        encryptor.authenticate_additional_data(aad)
        encryptor.update_into(data, out)
        encryptor.finalize()
        return nonce + encryptor.tag

    def open_into(self, aad: bytes, data, seal: bytes, out, cache_salt: str = "") -> None:
        """Decrypts `data` into `out`; raises SealBroken (and `out` holds garbage) unless the
        seal holds over `aad` and `data`."""
        if len(seal) != SEAL_BYTES:
            raise SealBroken(f"the seal is {len(seal)} bytes, not {SEAL_BYTES}")
        nonce, tag = seal[:NONCE_BYTES], seal[NONCE_BYTES:]
        decryptor = Cipher(algorithms.AES(self._block_key(cache_salt, nonce)), modes.GCM(_IV, tag)).decryptor()
        decryptor.authenticate_additional_data(aad)
        decryptor.update_into(data, out)
        try:
            decryptor.finalize()
        except InvalidTag as e:
            raise SealBroken("the tag does not hold") from e


def warn_if_unsealed(keys: KVKeys | None) -> None:
    if keys is None:
        logger.warning("no internal token: KV blocks go to the kvstore unencrypted and carry only an unkeyed "
                       "checksum, and their names can be computed from token ids (see docs/security.md)")
