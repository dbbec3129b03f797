"""Flash attention through libejkernel's FFI handlers (native CPU and CUDA), with a custom VJP.

The forward returns (out, lse); the backward takes both cotangents, so gradients through
the log-sum-exp are exact too. Absent optional operands travel as zero-element
placeholders and the `operands` bit mask tells the handler which are real. Each call's last
result is its workspace (uint8, sized by the C++ registry entry, 0 bytes on the CPU), so XLA
owns every byte a kernel touches and the CUDA calls can live in command buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ... import _native
from .. import _partition
from .._partition import BATCH, HEADS, KEYS, SEQUENCE, WHOLE, Kind
from ._validate import AttentionArgs, signature_of

OP = "flash_attention"

logger = logging.getLogger("ejkernel")

# Bits of the `operands` attribute (csrc/flash_attention/ffi_common.h).
_HAS_BIAS, _HAS_MASK, _HAS_AUX, _HAS_CU_SEQLENS, _HAS_SEGMENT_IDS, _HAS_DLSE, _NO_BIAS_GRAD = 1, 2, 4, 8, 16, 32, 64


@dataclasses.dataclass(frozen=True)
class _Static:
    platform: str
    softmax_scale: float
    causal: bool
    window_left: int
    window_right: int
    logits_soft_cap: float
    dropout_prob: float
    operands: int
    block_q: int
    block_k: int
    num_threads: int
    num_warps: int
    num_stages: int
    deterministic: bool
    backward: bool
    signature: str  # the call's AttentionArgs.signature() as JSON (its workspace: _workspace)

    def attributes(self, operands: int) -> dict[str, Any]:
        return dict(
            softmax_scale=np.float32(self.softmax_scale),
            causal=self.causal,
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            logits_soft_cap=np.float32(self.logits_soft_cap),
            dropout_prob=np.float32(self.dropout_prob),
            operands=np.int64(operands),
            block_q=np.int64(self.block_q),
            block_k=np.int64(self.block_k),
            num_threads=np.int64(self.num_threads),
            num_warps=np.int64(self.num_warps),
            num_stages=np.int64(self.num_stages),
            deterministic=self.deterministic,
        )


def _placeholder(x: Any, dtype: Any) -> Any:
    return jnp.zeros((0,), dtype) if x is None else x


def _dbias_dtype(bias: Any, q: Any) -> str:
    """The dtype the backward writes dbias in: a bf16/f16 bias's own where it has a plane per
    (batch, q head), so each element is written once and rounded once; float32 where it is a
    sum, rounded once afterwards. Decided on the whole call: a part of it (a shard_map shard
    that shares the bias with other shards, or one device's part of a partitioned call) may
    hold one batch row, yet its gradient is summed with the other parts'."""
    own_planes = tuple(bias.shape[:2]) == (q.shape[0], q.shape[2])
    half = jnp.dtype(bias.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    shared_by_shards = bool(_varying_axes(q) - _varying_axes(bias))
    return jnp.dtype(bias.dtype if own_planes and half and not shared_by_shards else jnp.float32).name


def _optional_operands(bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed) -> list[Any]:
    return [
        _placeholder(bias, jnp.float32),
        _placeholder(mask, jnp.bool_),
        _placeholder(aux, jnp.float32),
        _placeholder(cu_q, jnp.int32),
        _placeholder(cu_k, jnp.int32),
        _placeholder(seg_q, jnp.int32),
        _placeholder(seg_kv, jnp.int32),
        jnp.zeros((), jnp.uint32) if seed is None else seed,
    ]


def _varying_axes(x: Any) -> frozenset[str]:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # newer JAX spells it `vma`
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _vary_like(x: Any, *likes: Any) -> Any:
    """Marks `x` as varying over the manual mesh axes its inputs `likes` vary over (inside
    shard_map). FFI results carry no such axes; left invariant, shard_map would treat every
    shard's result as the same value, and custom_vjp needs cotangents typed like primals."""
    wanted = frozenset().union(*(_varying_axes(like) for like in likes if like is not None))
    missing = tuple(sorted(wanted - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _cotangent_like(ct: Any, primal: Any, *inputs: Any) -> Any:
    """Types an FFI-computed cotangent like its primal inside shard_map: summed over the axes
    the computation varied on but the primal does not (a replicated bias, say), and marked
    varying over the primal's own axes."""
    extra = tuple(sorted(frozenset().union(*(_varying_axes(x) for x in inputs if x is not None)) - _varying_axes(primal)))
    if extra:
        ct = jax.lax.psum(_vary_like(ct, *inputs), extra)
    return _vary_like(ct, primal)


def _workspace(static: _Static, pass_: str, q: Any, k: Any, bias: Any, mask: Any) -> jax.ShapeDtypeStruct:
    """The workspace result of a call on these operands. Its shapes are read from the operands,
    not from the static: a call folded under vmap or partitioned over devices runs on other
    shapes than the call traced."""
    signature = {**json.loads(static.signature), **signature_of(q, k), "deterministic": static.deterministic}
    for name, x in (("bias_shape", bias), ("mask_shape", mask)):
        if name in signature:
            signature[name] = list(x.shape)
    return jax.ShapeDtypeStruct((_native.workspace_bytes(OP, static.platform, pass_, signature),), jnp.uint8)


# Positions in _optional_operands' list (which follows q, k, v in the forward; q, k, v, out,
# dout, lse, dlse in the backward).
_BIAS, _MASK, _AUX, _CU_Q, _CU_K, _SEG_Q, _SEG_KV, _SEED = 0, 1, 2, 3, 4, 5, 6, 7
# How operands' and results' dims follow batch and heads when a call is split over devices.
_Q_LIKE = Kind((BATCH, SEQUENCE, HEADS, None))  # q, out, dout [batch, seq_q, q heads, head_dim]
_KV_LIKE = Kind((BATCH, KEYS, HEADS, None))  # k, v [batch, seq_k, kv heads, head_dim]
_STATS = Kind((BATCH, HEADS, SEQUENCE))  # lse, dlse [batch, q heads, seq_q]
_DENSE = Kind((BATCH, HEADS, None, None))  # bias, mask [batch|1, q heads|1, seq_q, seq_k]
_PER_HEAD = Kind((HEADS,))  # sinks [q heads]
_ROWS = Kind((BATCH, None))  # segment ids [batch, seq]
_OPTIONAL_KINDS = [_DENSE, _DENSE, _PER_HEAD, WHOLE, WHOLE, _ROWS, _ROWS, WHOLE]


def _mapped(args: list[Any], in_batched: list[bool], axis_size: int, i: int) -> Any:
    """args[i] with the mapped axis first: as it is where vmap maps it, else broadcast."""
    return args[i] if in_batched[i] else jnp.broadcast_to(args[i], (axis_size, *args[i].shape))


def _folded(static: _Static, operands: int, axis_size: int, in_batched: list[bool], args: list[Any],
            rows: list[int], first_optional: int) -> list[Any] | None:
    """A vmapped call as one call over axis_size * batch rows: its arguments, or
    None where folding would change the result (dropout draws by batch row, packed sequences
    have one row) or copy a bias or mask for every mapped element. args[i] for i in `rows` is
    [batch, ...]; the optional operands start at first_optional; every other argument (the
    sinks included) must be unbatched."""
    if static.dropout_prob > 0.0 or operands & _HAS_CU_SEQLENS:
        return None
    batch = args[rows[0]].shape[int(in_batched[rows[0]])]
    per_row = list(rows)
    if operands & _HAS_SEGMENT_IDS:
        per_row += [first_optional + _SEG_Q, first_optional + _SEG_KV]
    folded = list(args)
    for i in per_row:
        x = _mapped(args, in_batched, axis_size, i)
        folded[i] = x.reshape(axis_size * batch, *x.shape[2:])
    dense = [(first_optional + _BIAS, _HAS_BIAS), (first_optional + _MASK, _HAS_MASK)]
    for i, bit in dense:
        if not operands & bit:
            continue
        if in_batched[i]:
            if args[i].shape[1] != batch:  # a [1, ...] operand of a batch > 1 would be copied per row
                return None
            folded[i] = args[i].reshape(axis_size * batch, *args[i].shape[2:])
        elif args[i].shape[0] != 1:  # the same [batch, ...] operand for every mapped element
            return None
    handled = set(per_row) | {i for i, bit in dense if operands & bit}
    if any(b and i not in handled for i, b in enumerate(in_batched)):
        return None
    return folded


def _folded_packed(static: _Static, operands: int, axis_size: int, in_batched: list[bool], args: list[Any],
                   rows: list[int], stats: list[int], first_optional: int) -> list[Any] | None:
    """A vmapped call on packed sequences (batch 1) as one call over the mapped elements' rows
    laid end to end: element n's sequences, then one sequence of its padding rows without keys
    and one of its padding keys without rows (cum_seqlens start at 0, so padding is at the
    end), so that each row sees what it saw alone. args[i] for i in `rows` is [1, seq, heads,
    dim], for i in `stats` [1, heads, seq_q]. None with dropout (rows are hashed by packed
    index), sinks (padding rows would see them) or a bias or mask (planes would have to be
    made block-diagonal)."""
    if static.dropout_prob > 0.0 or operands & (_HAS_AUX | _HAS_BIAS | _HAS_MASK):
        return None
    cu_q, cu_k = first_optional + _CU_Q, first_optional + _CU_K
    if any(b and i not in {*rows, *stats, cu_q, cu_k} for i, b in enumerate(in_batched)):
        return None

    mapped = functools.partial(_mapped, args, in_batched, axis_size)
    folded = list(args)
    for i in rows:
        x = mapped(i)
        folded[i] = x.reshape(1, axis_size * x.shape[2], *x.shape[3:])
    for i in stats:
        x = mapped(i)[:, 0]
        folded[i] = x.transpose(1, 0, 2).reshape(1, x.shape[1], axis_size * x.shape[2])
    sq, sk = args[rows[0]].shape[-3], args[rows[1]].shape[-3]
    for i, length, queries in ((cu_q, sq, True), (cu_k, sk, False)):
        cu = mapped(i)
        start = jnp.arange(axis_size, dtype=jnp.int32)[:, None] * length
        # The padding rows' sequence ends the element's rows; the padding keys' ends its keys.
        padding = [start + length, start + length] if queries else [start + cu[:, -1:], start + length]
        ends = jnp.concatenate([start + cu[:, 1:], *padding], axis=1).reshape(-1)
        folded[i] = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    return folded


def _folded_heads(static: _Static, operands: int, axis_size: int, in_batched: list[bool], args: list[Any],
                  rows: list[int], keys: list[int], stats: list[int], first_optional: int,
                  bias_grad: bool = False, forward: bool = False) -> tuple[list[Any], int] | None:
    """A vmapped call as one call over axis_size * heads heads: its arguments and the number of
    head groups the fold keeps whole (_fold_heads), or None. For calls whose rows cannot fold
    into the batch because of their sinks (one per head: mapped sinks are element n's heads'
    own; shared ones repeat) or their packed sequences, and for forwards whose keys and values
    the elements share. A `forward` of mapped queries over shared keys and values: every
    key/value head's group holds the elements' q heads of that group in turn, so the call
    reads the shared keys as they are, with GQA groups axis_size times larger. Otherwise
    element n's q heads (and its key/value heads) are the n-th run of them (one group), so
    that GQA groups stay whole, and a shared q, k or v is copied per element as the batch fold
    copies it (a backward owes each element its own dK and dV anyway). args[i] for i in `rows`
    is [batch, seq_q, heads, dim], in `keys` [batch, seq_k, kv heads, dim], in `stats` [batch,
    heads, seq_q]. A bias or mask folds where it is mapped with a plane per head, or shared and
    broadcast over the heads (not where the call returns the bias's gradient, `bias_grad`: it
    would sum the elements'). None with dropout (masks are drawn by head), other biases or
    masks (their planes would be copied per element), or mapped segment ids or cum_seqlens."""
    if static.dropout_prob > 0.0:
        return None
    aux = first_optional + _AUX
    dense = [i for i, bit in ((first_optional + _BIAS, _HAS_BIAS), (first_optional + _MASK, _HAS_MASK))
             if operands & bit]
    if any(b and i not in {*rows, *keys, *stats, aux, *dense} for i, b in enumerate(in_batched)):
        return None
    shared_keys = forward and all(in_batched[i] for i in rows) and not any(in_batched[i] for i in keys)
    groups = args[keys[0]].shape[2] if shared_keys else 1
    mapped = functools.partial(_mapped, args, in_batched, axis_size)
    heads = args[rows[0]].shape[2 + int(in_batched[rows[0]])]
    folded = list(args)
    for i in dense:
        if in_batched[i] and args[i].shape[2] == heads:
            folded[i] = _fold_heads(args[i], 1, groups)
        elif in_batched[i] or args[i].shape[1] != 1 or (bias_grad and i == first_optional + _BIAS):
            return None
    for i in rows + ([] if shared_keys else keys):
        folded[i] = _fold_heads(mapped(i), 2, groups)
    for i in stats:
        if args[i].ndim > 1:  # a [0] placeholder stays
            folded[i] = _fold_heads(mapped(i), 1, groups)
    if operands & _HAS_AUX:
        folded[aux] = _fold_heads(mapped(aux), 0, groups)
    return folded, groups


def _fold_heads(x: Any, axis: int, groups: int = 1) -> Any:
    """[n, ...] with h heads at `axis` of the rest -> the rest with n * h heads there, in
    `groups` runs of h / groups heads of element 0, then of element 1, ...: with one group
    [n, b, s, h, d] -> [b, s, n * h, d] (axis 2), element n's heads the n-th run."""
    n, h = x.shape[0], x.shape[axis + 1]
    x = jnp.moveaxis(x, 0, axis)  # [..., n, h, ...]
    x = x.reshape(*x.shape[:axis], n, groups, h // groups, *x.shape[axis + 2:])
    x = jnp.swapaxes(x, axis, axis + 1)  # [..., groups, n, h / groups, ...]
    return x.reshape(*x.shape[:axis], n * h, *x.shape[axis + 3:])


def _unfold_heads(x: Any, axis_size: int, axis: int, groups: int = 1) -> Any:
    """_fold_heads undone: [b, s, n * h, d] -> [n, b, s, h, d] (axis 2)."""
    per_group = x.shape[axis] // (groups * axis_size)
    x = x.reshape(*x.shape[:axis], groups, axis_size, per_group, *x.shape[axis + 1:])
    x = jnp.swapaxes(x, axis, axis + 1)  # [..., n, groups, h / groups, ...]
    x = x.reshape(*x.shape[:axis], axis_size, groups * per_group, *x.shape[axis + 3:])
    return jnp.moveaxis(x, axis, 0)


def _unfold_packed(x: Any, axis_size: int) -> Any:
    """[1, n * seq, ...] -> [n, 1, seq, ...]"""
    return x.reshape(axis_size, 1, x.shape[1] // axis_size, *x.shape[2:])


def _unfold_packed_stats(x: Any, axis_size: int) -> Any:
    """[1, heads, n * seq] -> [n, 1, heads, seq]"""
    return x.reshape(x.shape[1], axis_size, x.shape[2] // axis_size).transpose(1, 0, 2)[:, None]


def _map_sequentially(fn, axis_size: int, in_batched: list[bool], args: list[Any]):
    """One call per mapped element (what the FFI call's own vmap does)."""
    batched = [i for i, b in enumerate(in_batched) if b]

    def one(xs):
        full = list(args)
        for i, x in zip(batched, xs):
            full[i] = x
        return fn(*full)

    outs = jax.lax.map(one, [args[i] for i in batched])
    return outs, jax.tree.map(lambda _: True, outs)


def _unfold(x: Any, axis_size: int) -> Any:
    return x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])


def _sink_grads(axis_size: int, in_batched: list[bool], args: list[Any], operands: int) -> jax.Array:
    """The sinks' gradient of each of axis_size mapped backward calls (args as the backward
    call's: q, k, v, out, dout, lse, dlse, *optional), [axis_size, heads] float32: a sink a
    with lse_i = log(exp(a) + ...) and no value moves lse_i by exp(a - lse_i) and out_i by
    -exp(a - lse_i) out_i, so d loss / d a = -sum_i exp(a - lse_i) (dout_i . out_i - dlse_i)
    (semantics.h; rows with lse -inf see nothing)."""
    mapped = functools.partial(_mapped, args, in_batched, axis_size)
    out, dout, lse = mapped(3), mapped(4), mapped(5)  # [n, batch, seq, heads, dim], [n, batch, heads, seq]
    aux = args[7 + _AUX].astype(jnp.float32)
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(aux[:, None] - lse))
    # One contraction (a reduction over the head dim alone ran ~10x slower on XLA CPU).
    grad = -jnp.einsum("nbshd,nbshd,nbhs->nh", dout.astype(jnp.float32), out.astype(jnp.float32), weight,
                       precision=jax.lax.Precision.HIGHEST)
    if operands & _HAS_DLSE:
        grad = grad + jnp.sum(weight * mapped(6), axis=(1, 3))
    return grad


def _forward_kernel(static: _Static):
    """The forward FFI call: (q, k, v, *optional) -> (out, lse)."""
    target = f"ejkernel_flash_attention_fwd_{static.platform}"

    def kernel(q, k, v, *optional):
        b, sq, hq, _ = q.shape
        out, lse, _ = jax.ffi.ffi_call(
            target,
            (
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, hq, sq), jnp.float32),
                _workspace(static, "forward", q, k, optional[_BIAS], optional[_MASK]),
            ),
        )(q, k, v, *optional, **static.attributes(static.operands))
        return out, lse

    return kernel


def _backward_kernel(static: _Static, operands: int, dbias_dtype: str, float32_keys: bool = False):
    """The backward FFI call: (q, k, v, out, dout, lse, dlse, *optional) -> (dq, dk, dv, dbias,
    daux), with the `operands` bits of this backward; float32_keys: dk and dv in float32,
    unrounded (a part of a sum to be rounded once)."""
    target = f"ejkernel_flash_attention_bwd_{static.platform}"
    wants_dbias = bool(operands & _HAS_BIAS) and not operands & _NO_BIAS_GRAD

    def kernel(q, k, v, out, dout, lse, dlse, *optional):
        bias, aux = optional[_BIAS], optional[_AUX]
        results = (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, jnp.float32 if float32_keys else k.dtype),
            jax.ShapeDtypeStruct(v.shape, jnp.float32 if float32_keys else v.dtype),
            jax.ShapeDtypeStruct(bias.shape, dbias_dtype) if wants_dbias
            else jax.ShapeDtypeStruct((0,), jnp.float32),
            jax.ShapeDtypeStruct(aux.shape, jnp.float32),
            _workspace(static, "backward", q, k, bias, optional[_MASK]),
        )
        *grads, _ = jax.ffi.ffi_call(target, results)(
            q, k, v, out, dout, lse, dlse, *optional, **static.attributes(operands)
        )
        return tuple(grads)

    return kernel


def _rows_call(static: _Static, operands: int, make_kernel, *, queries: list[int], keys: list[int],
               stats: list[int], out_rows: list[int], out_keys: list[int], out_stats: list[int]):
    """The call on part of the query's rows against all the keys, for a call whose rows stay
    split over devices (see _partition): rows_fn(first_row, rows, *args), or None where the
    call cannot take it.

    Without a causal or window bound the rows' positions do not matter and the part is the
    same call on fewer rows. With a causal bound (causal, or a window whose right side is 0),
    bottom-right alignment puts row i of the part at key i + seq_k - rows + first_row; the
    part runs as packed sequences, per batch row its rows with the keys up to where that
    alignment ends them, then one sequence of the remaining keys without rows, so that
    packed alignment (i + keys - part rows) lands there. Not with a bias or mask (their
    planes would have to be split by rows), packed sequences or segment ids of the caller's
    own, dropout (its masks are drawn by row), or a window bounded on the right. Results over
    the keys (dK, dV) are each device's rows' part of a sum: make_kernel returns them in
    float32, which the partitioned call sums and then rounds once.
    make_kernel(static) builds the FFI call; queries, keys, stats: the arguments of the
    query's rows ([batch, rows, heads, dim]), of the keys and of per-row statistics ([batch,
    heads, rows]), the optional operands following them; out_*: the same for the results."""
    if static.dropout_prob > 0.0 or operands & (_HAS_BIAS | _HAS_MASK | _HAS_CU_SEQLENS | _HAS_SEGMENT_IDS):
        return None
    if not static.causal and static.window_right != 0:
        if static.window_left != -1 or static.window_right != -1:
            return None
        kernel = make_kernel(static)
        return lambda first_row, rows, *args: kernel(*args)
    signature = json.loads(static.signature)
    signature["features"] = sorted({*signature["features"], "cum_seqlens"})
    if _native.unsupported_reason(OP, static.platform, signature) is not None:
        return None
    packed = dataclasses.replace(static, operands=static.operands | _HAS_CU_SEQLENS,
                                 signature=json.dumps(signature, sort_keys=True))
    kernel = make_kernel(packed)
    first_optional = max(queries + keys + stats) + 1

    def rows_fn(first_row, rows, *args):
        batch, part, _, _ = args[queries[0]].shape
        seq_k = args[keys[0]].shape[1]
        visible = jnp.clip(first_row + part + seq_k - rows, 0, seq_k).astype(jnp.int32)
        b = jnp.arange(batch, dtype=jnp.int32)[:, None]
        zero = jnp.zeros((1,), jnp.int32)
        args = list(args)
        args[first_optional + _CU_Q] = jnp.concatenate([zero, jnp.tile((b + 1) * part, (1, 2)).reshape(-1)])
        args[first_optional + _CU_K] = jnp.concatenate(
            [zero, jnp.concatenate([b * seq_k + visible, (b + 1) * seq_k], axis=1).reshape(-1)])
        for i in queries + keys:
            args[i] = args[i].reshape(1, -1, *args[i].shape[2:])
        for i in stats:
            args[i] = _packed_stats(args[i])
        outs = list(kernel(*args))
        for i in out_rows:
            outs[i] = outs[i].reshape(batch, part, *outs[i].shape[2:])
        for i in out_keys:
            outs[i] = outs[i].reshape(batch, seq_k, *outs[i].shape[2:])
        for i in out_stats:
            outs[i] = outs[i].reshape(outs[i].shape[1], batch, part).transpose(1, 0, 2)
        return tuple(outs)

    return rows_fn


def _packed_stats(x: Any) -> Any:
    """[batch, heads, rows] -> [1, heads, batch * rows]; a [0] placeholder stays."""
    return x if x.ndim == 1 else x.transpose(1, 0, 2).reshape(1, x.shape[1], -1)


# One function per static (which holds the call's shapes): bounded, so that a process seeing
# many shapes does not keep every one; an evicted entry is only rebuilt. Under jax.vmap a
# call runs once over the mapped elements' rows folded into its batch where that gives the
# same result (_folded; packed sequences end to end, _folded_packed), else over their heads
# (_folded_heads), else once per element; a forward whose keys the elements share folds over
# the heads first (no copy of the keys per element).
@functools.lru_cache(maxsize=1024)
def _forward_call(static: _Static):
    kernel = _forward_kernel(static)
    partitioned_kernel = _partition.partitioned(
        kernel, [_Q_LIKE, _KV_LIKE, _KV_LIKE, *_OPTIONAL_KINDS], [_Q_LIKE, _STATS],
        dropout_seed=3 + _SEED if static.dropout_prob > 0.0 else None,
        rows_fn=_rows_call(static, static.operands, _forward_kernel,
                           queries=[0], keys=[1, 2], stats=[], out_rows=[0], out_keys=[], out_stats=[1]))

    @jax.custom_batching.custom_vmap
    def call(q, k, v, *optional):
        return partitioned_kernel(q, k, v, *optional)

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *args):
        def run_folded_heads(folded, groups):
            out, lse = call(*folded)
            return (_unfold_heads(out, axis_size, 2, groups), _unfold_heads(lse, axis_size, 1, groups)), (True, True)

        if not (in_batched[1] or in_batched[2]):  # shared keys: no copy of them per element
            folded = _folded_heads(static, static.operands, axis_size, list(in_batched), list(args), [0], [1, 2], [],
                                   3, forward=True)
            if folded is not None:
                return run_folded_heads(*folded)
        if static.operands & _HAS_CU_SEQLENS:
            folded = _folded_packed(static, static.operands, axis_size, list(in_batched), list(args), [0, 1, 2], [], 3)
            if folded is not None:
                out, lse = call(*folded)
                return (_unfold_packed(out, axis_size), _unfold_packed_stats(lse, axis_size)), (True, True)
        folded = _folded(static, static.operands, axis_size, list(in_batched), list(args), [0, 1, 2], 3)
        if folded is not None:
            out, lse = call(*folded)
            return (_unfold(out, axis_size), _unfold(lse, axis_size)), (True, True)
        folded = _folded_heads(static, static.operands, axis_size, list(in_batched), list(args), [0], [1, 2], [], 3)
        if folded is not None:
            return run_folded_heads(*folded)
        return _map_sequentially(call, axis_size, in_batched, args)

    return call


@functools.lru_cache(maxsize=1024)
def _backward_call(static: _Static, operands: int, dbias_dtype: str):
    wants_dbias = bool(operands & _HAS_BIAS) and not operands & _NO_BIAS_GRAD
    kernel = _backward_kernel(static, operands, dbias_dtype)
    partitioned_kernel = _partition.partitioned(
        kernel, [_Q_LIKE, _KV_LIKE, _KV_LIKE, _Q_LIKE, _Q_LIKE, _STATS, _STATS, *_OPTIONAL_KINDS],
        [_Q_LIKE, _KV_LIKE, _KV_LIKE, dataclasses.replace(_DENSE, summed=True),
         dataclasses.replace(_PER_HEAD, summed=True)],
        dropout_seed=7 + _SEED if static.dropout_prob > 0.0 else None,
        rows_fn=_rows_call(static, operands,
                           lambda rows_static: _backward_kernel(rows_static, rows_static.operands | operands,
                                                                dbias_dtype, float32_keys=True),
                           queries=[0, 3, 4], keys=[1, 2], stats=[5, 6], out_rows=[0], out_keys=[1, 2], out_stats=[]))

    @jax.custom_batching.custom_vmap
    def call(*args):
        return partitioned_kernel(*args)

    @call.def_vmap
    def call_vmap(axis_size, in_batched, *args):
        rows = [0, 1, 2, 3, 4, 5] + ([6] if operands & _HAS_DLSE else [])  # else dlse is a placeholder
        if operands & _HAS_CU_SEQLENS:
            folded = _folded_packed(static, operands, axis_size, list(in_batched), list(args), [0, 1, 2, 3, 4],
                                    rows[5:], 7)
            if folded is not None:
                dq, dk, dv, dbias, daux = call(*folded)
                grads = (_unfold_packed(dq, axis_size), _unfold_packed(dk, axis_size), _unfold_packed(dv, axis_size),
                         dbias, daux)
                return grads, (True, True, True, False, False)
        # The gradient of a bias that the mapped elements share is a sum over rows, and vmap
        # wants one per element: the kernel has to see a copy of the bias per element. Where
        # each element has one batch row (per-example gradients), that copy is the size of
        # the per-element gradient and folds; otherwise the call runs per element.
        fold_batched, fold_args = list(in_batched), list(args)
        shared_dbias = wants_dbias and not in_batched[7 + _BIAS]
        if shared_dbias and args[7 + _BIAS].shape[0] == 1 and args[0].shape[int(in_batched[0])] == 1:
            fold_args[7 + _BIAS] = _mapped(args, in_batched, axis_size, 7 + _BIAS)
            fold_batched[7 + _BIAS] = True
            shared_dbias = False
        folded = None if shared_dbias else _folded(static, operands, axis_size, fold_batched, fold_args, rows, 7)
        if folded is None:
            folded = _folded_heads(static, operands, axis_size, fold_batched, fold_args, [0, 3, 4], [1, 2], [5, 6],
                                   7, bias_grad=wants_dbias)
            if folded is None:
                return _map_sequentially(call, axis_size, in_batched, args)
            dq, dk, dv, dbias, daux = call(*folded[0])
            grads = (*(_unfold_heads(x, axis_size, 2) for x in (dq, dk, dv)),
                     _unfold_heads(dbias, axis_size, 1) if wants_dbias else dbias,
                     _unfold_heads(daux, axis_size, 0) if operands & _HAS_AUX else daux)
            return grads, (True, True, True, wants_dbias, bool(operands & _HAS_AUX))
        dq, dk, dv, dbias, daux = call(*folded)
        if operands & _HAS_AUX:  # shared sinks (mapped ones do not fold): the folded sum is split
            daux = _sink_grads(axis_size, in_batched, args, operands)
        grads = (_unfold(dq, axis_size), _unfold(dk, axis_size), _unfold(dv, axis_size),
                 _unfold(dbias, axis_size) if wants_dbias else dbias, daux)
        return grads, (True, True, True, wants_dbias, bool(operands & _HAS_AUX))

    return call


@functools.lru_cache(maxsize=1024)
def _attention_fn(static: _Static):
    def forward(q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed):
        optional = _optional_operands(bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed)
        out, lse = _forward_call(static)(q, k, v, *optional)
        inputs = (q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed)
        return _vary_like(out, *inputs), _vary_like(lse, *inputs)

    @jax.custom_vjp
    def attention(q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed):
        return forward(q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed)

    # Symbolic zeros: the forward learns which inputs are differentiated, the backward which
    # outputs' cotangents are zero. A bias that nothing differentiates (a fixed positional
    # bias, say) gets no dbias: its [B|1, H|1, Sq, Sk] gradient is the backward's costliest part.
    def attention_fwd(*primals):
        q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed = (
            None if p is None else p.value for p in primals)
        out, lse = forward(q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed)
        # The flag travels as the residuals' structure (None or an empty array).
        bias_grad = None if bias is None or not primals[3].perturbed else jnp.zeros((0,), jnp.int8)
        return (out, lse), (q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed, out, lse, bias_grad)

    def attention_bwd(residuals, cotangents):
        if not static.backward:
            raise NotImplementedError(
                f"flash_attention on platform '{static.platform}' has no backward kernel; "
                "use platform='xla' (or the automatic choice) to differentiate"
            )
        q, k, v, bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed, out, lse, bias_grad = residuals
        dout, dlse = cotangents
        if isinstance(dout, SymbolicZero):
            dout = jnp.zeros(out.shape, q.dtype)
        operands = static.operands
        if isinstance(dlse, SymbolicZero):
            dlse = _placeholder(None, jnp.float32)
        else:
            operands |= _HAS_DLSE
        wants_dbias = bias_grad is not None  # never without a bias
        if bias is not None and not wants_dbias:
            operands |= _NO_BIAS_GRAD
        optional = _optional_operands(bias, mask, aux, cu_q, cu_k, seg_q, seg_kv, seed)
        dbias_dtype = _dbias_dtype(bias, q) if wants_dbias else "float32"
        dq, dk, dv, dbias, daux = _backward_call(static, operands, dbias_dtype)(
            q, k, v, out, dout.astype(q.dtype), lse, dlse.astype(jnp.float32), *optional
        )
        inputs = (q, k, v, bias, aux, dout, dlse)
        return (
            _cotangent_like(dq, q, *inputs),
            _cotangent_like(dk, k, *inputs),
            _cotangent_like(dv, v, *inputs),
            # summed across shards in the kernel's float32 where it is a sum, then rounded once
            _cotangent_like(dbias, bias, *inputs).astype(bias.dtype) if wants_dbias else None,
            None,
            None if aux is None else _cotangent_like(daux, aux, *inputs).astype(aux.dtype),
            None,
            None,
            None,
            None,
            None,
        )

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    return attention


# Head dims are padded up to at most this (the largest any native kernel is built for).
_MAX_PADDED_HEAD_DIM = 256


def _with_head_dim(signature: dict[str, Any], head_dim: int) -> dict[str, Any]:
    return {**signature, "head_dim": head_dim}


@functools.lru_cache(maxsize=4096)
def _padded_head_dim(platform: str, signature_json: str) -> int | None:
    """The smallest larger head dim the native `platform` takes this call at, where it does
    not take the call's own (the C++ entry's rule, asked for each multiple of 8); None where
    it takes its own or none. Cached: a call unsupported for another reason asks 32 times."""
    signature = json.loads(signature_json)
    head_dim = signature["head_dim"]
    if _native.unsupported_reason(OP, platform, signature) is None:
        return None
    for padded in range((head_dim // 8 + 1) * 8, _MAX_PADDED_HEAD_DIM + 1, 8):
        if _native.unsupported_reason(OP, platform, _with_head_dim(signature, padded)) is None:
            return padded
    return None


def native_signature(platform: str, args: AttentionArgs) -> dict[str, Any]:
    """The registry signature of the call the native `platform` runs for `args`: its own, or,
    where the kernels are not built for its head dim, the same at the next head dim they take
    (flash_attention_native then zero-pads query, key and value to it)."""
    signature = args.signature()
    padded = _padded_head_dim(platform, json.dumps(signature, sort_keys=True))
    return signature if padded is None else _with_head_dim(signature, padded)


def _zero_padded(args: AttentionArgs, head_dim: int) -> AttentionArgs:
    """Query, key and value with zero columns up to `head_dim`: they add nothing to q.k, and
    V's give output columns of zeros (dropped after the call); the softmax scale stays the
    call's (1/sqrt of the true head dim by default)."""

    def pad(x):
        return jnp.pad(x, ((0, 0),) * 3 + ((0, head_dim - x.shape[-1]),))

    return dataclasses.replace(args, query=pad(args.query), key=pad(args.key), value=pad(args.value))


def flash_attention_native(
    platform: str,
    args: AttentionArgs,
    *,
    block_q: int,
    block_k: int,
    num_threads: int = 0,
    num_warps: int = 0,
    num_stages: int = 0,
    backward: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Runs the native kernel of `platform` ("cpu" or "cuda"); returns (out, lse). A head dim
    the platform's C++ entry does not take (on CUDA one that is not a multiple of 8: the kernels
    run the others up to 256 as they are) runs zero-padded to the next one it does
    (native_signature)."""
    _native.ensure_ffi_targets(OP, platform)
    signature = native_signature(platform, args)  # the padded arrays' own where it pads
    head_dim, padded = args.query.shape[-1], signature["head_dim"]
    if padded != head_dim:
        logger.debug("flash_attention on %s: head_dim %d runs zero-padded to %d", platform, head_dim, padded)
        args = _zero_padded(args, padded)
    operands = (
        (_HAS_BIAS if args.bias is not None else 0)
        | (_HAS_MASK if args.attention_mask is not None else 0)
        | (_HAS_AUX if args.softmax_aux is not None else 0)
        | (_HAS_CU_SEQLENS if args.cum_seqlens_q is not None else 0)
        | (_HAS_SEGMENT_IDS if args.q_segment_ids is not None else 0)
    )
    window_left, window_right = args.sliding_window or (-1, -1)
    static = _Static(
        platform=platform,
        softmax_scale=args.softmax_scale,
        causal=args.causal,
        window_left=window_left,
        window_right=window_right,
        logits_soft_cap=args.logits_soft_cap or 0.0,
        dropout_prob=args.dropout_prob,
        operands=operands,
        block_q=block_q,
        block_k=block_k,
        num_threads=num_threads,
        num_warps=num_warps,
        num_stages=num_stages,
        deterministic=args.deterministic,
        backward=backward,
        signature=json.dumps(signature, sort_keys=True),
    )
    out, lse = _attention_fn(static)(
        args.query,
        args.key,
        args.value,
        args.bias,
        args.attention_mask,
        args.softmax_aux,
        args.cum_seqlens_q,
        args.cum_seqlens_k,
        args.q_segment_ids,
        args.kv_segment_ids,
        args.dropout_seed,
    )
    return (out[..., :head_dim], lse) if padded != head_dim else (out, lse)
