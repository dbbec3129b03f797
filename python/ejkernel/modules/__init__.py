"""High-level operations: each picks its platform and config and runs (seeds' module API)."""

from .flash_attention import FlashAttention, create_default_executor, flash_attention
from ..kernels.flash_attention import FlashAttentionConfig

__all__ = ["FlashAttention", "FlashAttentionConfig", "create_default_executor", "flash_attention"]
