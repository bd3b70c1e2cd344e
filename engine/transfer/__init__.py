"""Handing one request's KV cache from a prefill engine to a decode engine of any TP size."""
from engine.transfer.handle import KVHandle, KVTransferError, ModelFingerprint, SourceRank

__all__ = ["KVHandle", "KVTransferError", "ModelFingerprint", "SourceRank"]
