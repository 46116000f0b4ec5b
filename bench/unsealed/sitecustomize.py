"""The XXH3 baseline of `python -m bench.serve_kv_ttft_share --seals xxh3,...` (issue 49):
put on the platform processes' path by that bench only, it has every worker seal blocks as
a platform without a token does (the unkeyed checksum, no encryption, names from token ids).
Never on a served platform's path: there the token's keys seal every block."""
from pdserve.services.worker import kv_seal

kv_seal.KVKeys.from_token = classmethod(lambda cls, token: None)
