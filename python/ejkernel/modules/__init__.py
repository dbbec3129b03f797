"""High-level operations: each picks its platform and config and runs (seeds' module API)."""

from .flash_attention import FlashAttention, create_default_executor, flash_attention
from .paged_attention import (
    PageAttention,
    PagedAttentionKernel,
    PrefillPageAttention,
    RaggedDecodeAttention,
    RaggedPageAttention,
    RaggedPageAttentionV2,
    RaggedPageAttentionV3,
    UnifiedAttention,
    page_attention,
    prefill_page_attention,
    ragged_decode_attention,
    ragged_page_attention,
    ragged_page_attention_v2,
    ragged_page_attention_v3,
    unified_attention,
)
from ..kernels.flash_attention import FlashAttentionConfig
from ..kernels.paged_attention import PagedAttentionConfig

__all__ = [
    "FlashAttention",
    "FlashAttentionConfig",
    "PageAttention",
    "PagedAttentionConfig",
    "PagedAttentionKernel",
    "PrefillPageAttention",
    "RaggedDecodeAttention",
    "RaggedPageAttention",
    "RaggedPageAttentionV2",
    "RaggedPageAttentionV3",
    "UnifiedAttention",
    "create_default_executor",
    "flash_attention",
    "page_attention",
    "prefill_page_attention",
    "ragged_decode_attention",
    "ragged_page_attention",
    "ragged_page_attention_v2",
    "ragged_page_attention_v3",
    "unified_attention",
]
