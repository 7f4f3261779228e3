"""``prefetch``: a cache-line request from Numba code (``llvm.prefetch``).

Sampling and gathers read large arrays at random, one cache miss after another; asking
for the lines a few items ahead lets several misses be in flight at once.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Bytes per cache line.
LINE = 64


@intrinsic
def prefetch(typingctx: Any, arr: Any, idx: Any) -> Any:
    """Ask for the cache line of ``arr[idx]`` (1-D ``arr``; a hint: no fault, no result)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1):
        return None
    sig = types.void(arr, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arr_t = signature.args[0]
        ary = context.make_array(arr_t)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arr_t, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # read, high temporal locality, data cache
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen
