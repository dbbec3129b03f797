"""Native calls under jit with sharded arrays: each device runs the kernel on its own batch
rows and heads (the kernels treat every (batch, head) alike), instead of XLA gathering every
operand to every device and running the whole call on each.

An operation describes each operand and result by a `Kind`: which of its dims are the batch,
the heads, the query's rows and the keys. Query and key/value heads split alike, and only
where the key/value heads divide evenly, so every device keeps whole GQA groups. A query split
along its sequence has the call split over heads instead, where they divide; where they do
not (MQA, or more devices than key/value heads) and the operation can run a part of the rows
on its own (`rows_fn`), the query's rows stay split and every device gets all the keys.
Every other dim is never split (attention needs all of a row's keys, a paged cache all of
its pages): operands split along one are gathered first. An operand broadcast over the batch
or heads (a dim of size 1, or no such dim) goes to every device whole; a result of a
`summed` kind (the gradient of such an operand) is then summed over the devices, and so is
one over the keys when the rows are split (each device's part of dK and dV). With dropout
each device's call gets its first batch row and head in the seed operand (semantics.h,
DropoutBatchHead), so it draws the masks the whole call would.

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

BATCH, HEADS, SEQUENCE, KEYS = "batch", "heads", "sequence", "keys"


@dataclasses.dataclass(frozen=True)
class Kind:
    """How an operand's or result's dims follow the call's batch and heads: one entry per dim,
    BATCH, HEADS (query or key/value heads, told apart by their count), SEQUENCE (the query's
    rows: split only where the call's rows stay split, see the module's docstring), KEYS
    (never split) or None. dims=None: never split, any rank. summed: a device's value is its
    part of a sum over the batch rows and heads the array does not carry (a broadcast
    operand's gradient), and over the query's rows where they are split."""

    dims: tuple[str | None, ...] | None
    summed: bool = False


WHOLE = Kind(None)


@dataclasses.dataclass(frozen=True)
class Split:
    batch: tuple[str, ...] = ()  # mesh axes the batch is split over
    heads: tuple[str, ...] = ()  # the heads
    rows: tuple[str, ...] = ()  # and the query's rows (every device holding all the keys)

    def axes(self, label: str) -> tuple[str, ...]:
        return {BATCH: self.batch, HEADS: self.heads, SEQUENCE: self.rows}.get(label, ())


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _labels(kind: Kind, shape: Sequence[int]) -> tuple[str | None, ...]:
    """kind.dims where the array may split: none for a whole or absent operand (absent ones
    travel as [0] placeholders), and neither the keys nor a dim of size 1 (a broadcast)."""
    if kind.dims is None or tuple(shape) == (0,):
        return (None,) * len(shape)
    if len(kind.dims) != len(shape):
        raise ValueError(f"an operand of dims {kind.dims} has shape {tuple(shape)}")
    return tuple(label if size > 1 and label != KEYS else None for label, size in zip(kind.dims, shape))


def _size_along(kind: Kind, shape: Sequence[int], label: str) -> int | None:
    return shape[kind.dims.index(label)] if kind.dims and label in kind.dims else None


def choose_split(mesh: Any, kinds: Sequence[Kind], query: Any, key: Any, splits_rows: bool = False) -> Split:
    """The split of a call from its query's sharding (operand 0; operand 1 holds the key/value
    heads): the batch and head axes it is sharded along, where the kernels can take them
    (see the module's docstring). The axes its sequence is sharded along split the heads
    too, where they divide: each device then gets whole sequences of fewer heads, which
    XLA delivers with an all-to-all (as DeepSpeed-Ulysses' sequence parallelism does)
    instead of gathering every operand and computing every head on every device. Where they
    do not and the call `splits_rows`, its rows stay split along those axes, the keys and
    values gathered (small where there are few key/value heads)."""
    sharding = query.sharding
    if not isinstance(sharding, NamedSharding):
        return Split()
    spec = tuple(sharding.spec) + (None,) * (len(query.shape) - len(sharding.spec))

    def size(axes: tuple[str, ...]) -> int:
        return math.prod(mesh.shape[a] for a in axes)

    def sharded_along(label: str) -> tuple[str, ...]:
        dims = kinds[0].dims or ()
        return _axes(spec[dims.index(label)]) if label in dims else ()

    def divides(label: str, axes: tuple[str, ...]) -> bool:
        sizes = [_size_along(kinds[0], query.shape, label)]
        if label == HEADS:
            sizes.append(_size_along(kinds[1], key.shape, label))
        return all(s is not None and s % size(axes) == 0 for s in sizes)

    batch = sharded_along(BATCH) if divides(BATCH, sharded_along(BATCH)) else ()
    heads = sharded_along(HEADS) if divides(HEADS, sharded_along(HEADS)) else ()
    moved = tuple(a for a in sharded_along(SEQUENCE) if a not in batch + heads)
    rows: tuple[str, ...] = ()
    if moved and divides(HEADS, heads + moved):
        heads += moved
    elif moved and splits_rows and divides(SEQUENCE, moved):
        rows = moved
    return Split(batch, heads, rows)


def spec_of(kind: Kind, shape: Sequence[int], split: Split) -> P:
    """The partition spec of an operand or result of this kind and global shape."""
    return P(*(None if label is None else _entry(split.axes(label)) for label in _labels(kind, shape)))


def _summed(kind: Kind, shape: Sequence[int], split: Split, x: Any) -> Any:
    """A device's result, summed over the devices it is partial across: for a summed kind the
    split axes of the batch or heads it does not carry, and for a summed kind or one over the
    keys the axes the rows are split over (its value gathers every row's contribution)."""
    if tuple(shape) == (0,):
        return x
    axes: tuple[str, ...] = ()
    if kind.summed:
        carried = _labels(kind, shape)
        axes = tuple(a for label in (BATCH, HEADS) if label not in carried for a in split.axes(label))
    if kind.summed or KEYS in (kind.dims or ()):
        axes += split.rows
    return jax.lax.psum(x, axes) if axes else x


def _sharding_rule(operand_kinds: Sequence[Kind], result_kinds: Sequence[Kind]):
    """Shardy's rule: batch dims share one factor, query head dims another, key/value head dims
    a third (relating them as a compound factor lets Shardy split the query heads over part
    of an axis, which jax cannot hand the partition callback), sequence dims of the query's
    length a fourth and of the keys' a fifth, and every other dim a factor of its own, so that
    only the batch, heads and sequences propagate through the call."""

    def rule(mesh, value_types, result_types) -> SdyShardingRule:
        q_heads = _size_along(operand_kinds[0], value_types[0].shape, HEADS)
        q_length = _size_along(operand_kinds[0], value_types[0].shape, SEQUENCE)
        k_length = _size_along(operand_kinds[1], value_types[1].shape, KEYS)
        counter = iter(range(1 << 30))

        def factor(label: str | None, size: int) -> str:
            if label == BATCH and size > 1:
                return "b"
            if label == HEADS and size > 1:
                return "hq" if size == q_heads else "hk"
            # so that a result comes back split along its sequence like its operand
            if label == SEQUENCE and size == q_length:
                return "sq"
            if label == KEYS and size == k_length:
                return "sk"
            return f"x{next(counter)}"

        def mapping(kind: Kind, shape: Sequence[int]) -> ArrayMapping:
            labels = kind.dims if kind.dims is not None and tuple(shape) != (0,) else (None,) * len(shape)
            return ArrayMapping(*(factor(label, size) for label, size in zip(labels, shape)))

        operands = tuple(mapping(kind, t.shape) for kind, t in zip(operand_kinds, value_types))
        results = tuple(mapping(kind, t.shape) for kind, t in zip(result_kinds, result_types))
        return SdyShardingRule(operands, results)

    return rule


def _with_origin(seed: Any, split: Split, query_kind: Kind, query: Any, num_q_heads: int) -> Any:
    """The dropout seed operand of one device's part of a split call: the seed, then the part's
    first batch row and first q head and the whole call's q heads."""

    def first(label: str) -> Any:
        axes = split.axes(label)
        return jax.lax.axis_index(axes) * _size_along(query_kind, query.shape, label) if axes else 0

    words = (seed, first(BATCH), first(HEADS), num_q_heads)
    return jnp.stack([jnp.asarray(w).astype(jnp.uint32) for w in words])


def partitioned(fn: Callable, operand_kinds: Sequence[Kind], result_kinds: Sequence[Kind], *,
                dropout_seed: int | None = None, rows_fn: Callable | None = None) -> Callable:
    """`fn` (the kernel call on operands of operand_kinds, returning a tuple of result_kinds;
    operand 0 is the query, 1 holds the key/value heads) run by each device on its part of
    the batch and heads. dropout_seed: the index of the seed operand of a call with dropout,
    else None. rows_fn(first_row, rows, *operands): `fn` on the query's rows from first_row
    (traced) of its `rows`, against all the keys, its results summed over the rows possibly in
    a wider dtype than `fn`'s; where given, a split sequence that the heads cannot take keeps
    the rows split (not with dropout)."""

    def shardings(mesh, arg_shapes, result_shapes):
        split = choose_split(mesh, operand_kinds, arg_shapes[0], arg_shapes[1], splits_rows=rows_fn is not None)
        args = tuple(NamedSharding(mesh, spec_of(k, a.shape, split)) for k, a in zip(operand_kinds, arg_shapes))
        results = tuple(NamedSharding(mesh, spec_of(k, r.shape, split)) for k, r in zip(result_kinds, result_shapes))
        return split, args, results

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes, result_shape)[2]

    def partition(mesh, arg_shapes, result_shape):
        split, args, results = shardings(mesh, arg_shapes, result_shape)
        global_shapes = [r.shape for r in result_shape]
        dtypes = [r.dtype for r in result_shape]
        num_q_heads = _size_along(operand_kinds[0], arg_shapes[0].shape, HEADS)
        rows = _size_along(operand_kinds[0], arg_shapes[0].shape, SEQUENCE)

        def lower(*operands):
            if dropout_seed is not None and (split.batch or split.heads):
                operands = list(operands)
                operands[dropout_seed] = _with_origin(operands[dropout_seed], split, operand_kinds[0], operands[0],
                                                      num_q_heads)
            if split.rows:
                local_rows = _size_along(operand_kinds[0], operands[0].shape, SEQUENCE)
                outs = rows_fn(jax.lax.axis_index(split.rows) * local_rows, rows, *operands)
            else:
                outs = fn(*operands)
            # a part of a sum may come in a wider dtype (rows_fn's float32 dK, dV), rounded once summed
            return tuple(_summed(k, shape, split, x).astype(dtype)
                         for k, shape, dtype, x in zip(result_kinds, global_shapes, dtypes, outs))

        return mesh, lower, results, args

    wrapped = custom_partitioning(fn)
    wrapped.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=_sharding_rule(operand_kinds, result_kinds),
    )
    return wrapped
