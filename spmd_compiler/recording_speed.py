"""Make make_fx's symbolic recording cheaper without changing what it records.

With a symbolic batch size (and sequence length) the recording of a step costs about 2.5 times the
same recording with static sizes, and the difference is not in the ops: every fake tensor an op
returns has symbolic sizes, so building it (its storage size, contiguity, numel) and tracking it
runs dozens of ``SymNode`` operations (``s0*2048``, ``Eq(s0*2048, 2048)``, ...) through Python,
the same few expressions again and again, layer after layer. Three changes, for the duration of one
recording only (:func:`faster_symbolic_recording`):

- **SymNode arithmetic is memoized.** ``add``, ``mul``, ``eq``, ... of two ``SymNode``s made
  outside the proxy tracer (inside fake kernels and fake tensor construction: the ones that record
  nothing in the graph) are a pure function of the operands' expressions, the ShapeEnv's
  replacements (keyed by its version counter), the operands' hints, types and summation flags.
  The memo returns a new ``SymNode`` with the result's expression and hint, as the operation would.
  Not memoized: operations under the proxy tracer (they record graph nodes), ``mod`` (it reads the
  ShapeEnv's value ranges, which guards refine), and everything while translation validation or
  structured tracing of expressions is on.
- **The free symbols of a size are memoized** where the fake tensor cache builds its key (it
  gathers the symbols of every symbolic size of every input: sympy recomputes them each time).
- **``node.meta["tensor_meta"]`` is not written.** make_fx calls it "best effort; prefer using
  val": it repeats every value's shape, strides and memory-format contiguity checks, which are
  symbolic work again. Nothing in the compiler reads it; ``meta["val"]`` is written as before.

On a 24-block GPT-2 this cut the recording's CPU time by about 30% (7.7 s to 5.3 s, the two
alternated in one process); the first call at world size 2 by 11-20% (docs/compile_time.md).
"""

from __future__ import annotations

import contextlib

import torch._logging._internal as logging_internal
from torch._subclasses._fake_tensor_utils import _CacheKeyState, _InputBackref, _PySymInputStub
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.sym_node import SymNode

# Binary SymNode operations whose result depends only on their operands (see the docstring)
PURE_BINARY = ("add", "sub", "mul", "int_floordiv", "eq", "ne", "gt", "lt", "le", "ge",
               "sym_max", "sym_min", "and_", "or_")


def _memoized(method: str, impl, memo: dict):
    def operation(self, other):
        env = self.shape_env
        if (env is None or type(other) is not SymNode or env._translation_validation_enabled
                or logging_internal.GET_DTRACE_STRUCTURED
                or proxy_tensor.get_proxy_mode() is not None):
            return impl(self, other)
        key = (method, id(env), env._replacements_version_counter, self._expr, other._expr,
               self.pytype, other.pytype, self._hint, other._hint,
               self._optimized_summation, other._optimized_summation)
        r = memo.get(key)
        if r is None:
            r = memo[key] = impl(self, other)
        return SymNode(r._expr, env, r.pytype, r._hint, r.constant, r.fx_node,
                       r._optimized_summation)

    return operation


def _convert_sym_int_memoized(memo: dict):
    def convert_sym_int(self, result, arg):  # torch's _CacheKeyState.convert_sym_int, memoized
        node_id = id(arg.node)
        if node_id in self.sym_node_lookup:
            result.append(_InputBackref(self.sym_node_lookup[node_id]))
            return
        self.sym_node_lookup[node_id] = len(result)
        expr = arg.node.expr
        symbols = memo.get(expr)
        if symbols is None:
            symbols = memo[expr] = frozenset(expr.free_symbols)
        self.known_symbols.update(symbols)
        if self.shape_env is None:
            self.shape_env = arg.node.shape_env
        result.append(_PySymInputStub(arg))

    return convert_sym_int


def _set_meta_without_tensor_meta(proxy, val):
    proxy.node.meta["val"] = proxy_tensor.extract_val(
        val, include_real=(proxy.node.op == "placeholder"))
    return proxy


@contextlib.contextmanager
def faster_symbolic_recording():
    """While recording: memoize pure SymNode arithmetic and the free symbols of sizes, and skip
    ``tensor_meta`` (see the module docstring). Restores torch's own functions on exit;
    re-entrant."""
    if getattr(SymNode, "_spmd_memoized", False):
        yield
        return
    memo: dict = {}
    saved = {m: getattr(SymNode, f"_{m}") for m in PURE_BINARY}
    saved_set_meta = proxy_tensor.set_meta
    saved_convert = _CacheKeyState.convert_sym_int
    try:
        _CacheKeyState.convert_sym_int = _convert_sym_int_memoized({})
        for m, impl in saved.items():
            setattr(SymNode, f"_{m}", _memoized(m, impl, memo))
        SymNode._spmd_memoized = True
        proxy_tensor.set_meta = _set_meta_without_tensor_meta
        yield
    finally:
        _CacheKeyState.convert_sym_int = saved_convert
        proxy_tensor.set_meta = saved_set_meta
        for m, impl in saved.items():
            setattr(SymNode, f"_{m}", impl)
        SymNode._spmd_memoized = False
