"""Kernel implementations, one package per operation, each with its XLA and native forms.
Importing a package registers its implementations in `kernel_registry`."""

from . import flash_attention, paged_attention

__all__ = ["flash_attention", "paged_attention"]
