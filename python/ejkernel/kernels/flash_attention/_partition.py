"""Flash attention's native calls under jit with sharded arrays: each device runs the kernel
on its own batch rows and heads (the kernels treat every (batch, head) alike), instead of
XLA gathering every operand to every device and running the whole call on each.

Sequence and head_dim dims are never split (attention needs all of a row's keys): an operand
split along them is gathered first. Query and key/value heads split alike, and only where
the key/value heads divide evenly, so every device keeps whole GQA groups. A bias or mask
shared across the batch or heads goes to every device whole; its gradient is then summed
over the devices. With dropout each device's call gets its first batch row and head in the
seed operand (semantics.h, DropoutBatchHead), so it draws the masks the whole call would.

Each call is wrapped in jax's custom_partitioning: a Shardy sharding rule that propagates the
batch and head factors, and a partition callback that picks the split from the query's
sharding and lowers the kernel call on the local shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# How an operand's or a result's dims follow the call's batch and heads.
QKV = "qkv"  # [batch, seq, heads, head_dim]
STATS = "stats"  # [batch, q heads, seq_q]
DENSE = "dense"  # [batch|1, q heads|1, seq_q, seq_k]
HEADS = "heads"  # [q heads]
ROWS = "rows"  # [batch, seq]
WHOLE = "whole"  # never split (cum_seqlens, the seed)
# Gradients: a device's part of the sum over the dims it is shared along (a bias broadcast
# over the batch, sinks shared by every batch row) is summed over the devices.
DENSE_SUM = "dense_sum"
HEADS_SUM = "heads_sum"


@dataclasses.dataclass(frozen=True)
class Split:
    batch: tuple[str, ...] = ()  # mesh axes the batch is split over
    heads: tuple[str, ...] = ()  # and the heads


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def choose_split(mesh: Any, query: Any, key: Any) -> Split:
    """The split of a call from its query's sharding: the batch and head axes it is sharded
    along, where the kernels can take them (see the module's docstring)."""
    sharding = query.sharding
    if not isinstance(sharding, NamedSharding):
        return Split()
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    batch, heads = _axes(spec[0]), _axes(spec[2])

    def size(axes: tuple[str, ...]) -> int:
        return math.prod(mesh.shape[a] for a in axes)

    if query.shape[0] % size(batch):
        batch = ()
    if query.shape[2] % size(heads) or key.shape[2] % size(heads):
        heads = ()
    return Split(batch, heads)


def spec_of(kind: str, shape: Sequence[int], split: Split) -> P:
    """The partition spec of an operand or result of this kind and global shape."""
    if kind == WHOLE or tuple(shape) == (0,):  # absent operands travel as [0] placeholders
        return P()
    b, h = _entry(split.batch), _entry(split.heads)
    if kind == QKV:
        return P(b, None, h, None)
    if kind == STATS:
        return P(b, h, None)
    if kind in (DENSE, DENSE_SUM):
        return P(b if shape[0] > 1 else None, h if shape[1] > 1 else None, None, None)
    if kind in (HEADS, HEADS_SUM):
        return P(h)
    if kind == ROWS:
        return P(b, None)
    raise ValueError(f"unknown operand kind {kind!r}")


def _summed(kind: str, shape: Sequence[int], split: Split, x: Any) -> Any:
    """A device's result of a *_SUM kind, summed over the devices it is partial across."""
    if tuple(shape) == (0,):
        return x
    axes: tuple[str, ...] = ()
    if kind == DENSE_SUM:
        axes = (split.batch if shape[0] == 1 else ()) + (split.heads if shape[1] == 1 else ())
    elif kind == HEADS_SUM:
        axes = split.batch
    return jax.lax.psum(x, axes) if axes else x


def _sharding_rule(operand_kinds: Sequence[str], result_kinds: Sequence[str]):
    """Shardy's rule: batch dims share one factor, query head dims another, key/value head dims
    a third (relating them as a compound factor lets Shardy split the query heads over part
    of an axis, which jax cannot hand the partition callback), and every other dim a factor of
    its own, so that only the batch and heads propagate through the call."""

    def rule(mesh, value_types, result_types) -> SdyShardingRule:
        q_heads = value_types[0].shape[2]
        counter = iter(range(1 << 30))

        def own() -> str:
            return f"x{next(counter)}"

        def mapping(kind: str, shape: Sequence[int]) -> ArrayMapping:
            shape = tuple(shape)
            if kind == WHOLE or shape == (0,):
                return ArrayMapping(*(own() for _ in shape))
            if kind == QKV:
                return ArrayMapping("b", own(), "hq" if shape[2] == q_heads else "hk", own())
            if kind == STATS:
                return ArrayMapping("b", "hq", own())
            if kind in (DENSE, DENSE_SUM):
                return ArrayMapping("b" if shape[0] > 1 else own(), "hq" if shape[1] > 1 else own(), own(), own())
            if kind in (HEADS, HEADS_SUM):
                return ArrayMapping("hq")
            return ArrayMapping("b", own())  # ROWS

        operands = tuple(mapping(kind, t.shape) for kind, t in zip(operand_kinds, value_types))
        results = tuple(mapping(kind, t.shape) for kind, t in zip(result_kinds, result_types))
        return SdyShardingRule(operands, results)

    return rule


def _with_origin(seed: Any, split: Split, query: Any, num_q_heads: int) -> Any:
    """The dropout seed operand of one device's part of a split call: the seed, then the part's
    first batch row and first q head and the whole call's q heads."""
    first_batch = jax.lax.axis_index(split.batch) * query.shape[0] if split.batch else 0
    first_head = jax.lax.axis_index(split.heads) * query.shape[2] if split.heads else 0
    words = (seed, first_batch, first_head, num_q_heads)
    return jnp.stack([jnp.asarray(w).astype(jnp.uint32) for w in words])


def partitioned(fn: Callable, operand_kinds: Sequence[str], result_kinds: Sequence[str], *,
                dropout_seed: int | None) -> Callable:
    """`fn` (the kernel call on operands of operand_kinds, returning a tuple of result_kinds;
    operand 0 is the query, 1 the key) run by each device on its part of the batch and heads.
    dropout_seed: the index of the seed operand of a call with dropout, else None."""

    def shardings(mesh, arg_shapes, result_shapes):
        split = choose_split(mesh, arg_shapes[0], arg_shapes[1])
        args = tuple(NamedSharding(mesh, spec_of(k, a.shape, split)) for k, a in zip(operand_kinds, arg_shapes))
        results = tuple(NamedSharding(mesh, spec_of(k, r.shape, split)) for k, r in zip(result_kinds, result_shapes))
        return split, args, results

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes, result_shape)[2]

    def partition(mesh, arg_shapes, result_shape):
        split, args, results = shardings(mesh, arg_shapes, result_shape)
        global_shapes = [r.shape for r in result_shape]
        num_q_heads = arg_shapes[0].shape[2]

        def lower(*operands):
            if dropout_seed is not None and (split.batch or split.heads):
                operands = list(operands)
                operands[dropout_seed] = _with_origin(operands[dropout_seed], split, operands[0], num_q_heads)
            outs = fn(*operands)
            return tuple(_summed(k, shape, split, x) for k, shape, x in zip(result_kinds, global_shapes, outs))

        return mesh, lower, results, args

    wrapped = custom_partitioning(fn)
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=_sharding_rule(operand_kinds, result_kinds),
    )
    return wrapped
