from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.engine.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
