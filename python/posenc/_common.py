"""Argument normalisation shared by the Python front ends: the type of a Python argument
(int, real, tensor, dtype), which the op cannot see. Value checks belong to the ops."""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
from typing import Any, Iterator

import torch
from torch import Tensor

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _TracedSizeError(TypeError):
    """_int_arg's refusal of a traced size (its message says why and what to do): callers that
    word their own TypeError for a wrong type let this one through."""


def _int_arg(fn: str, name: str, value: Any) -> int:
    """value as an int64 (Python or numpy integer, not bool): TypeError naming it for another
    type, ValueError outside int64. Only the type is normalised here: the op checks the
    value. Under torch.jit.trace a tensor is refused: a size there is a 0-dim tensor (x.shape[1]),
    and the graph would hold this call's value as a constant, silently wrong at other sizes."""
    if isinstance(value, Tensor) and torch.jit.is_tracing():
        raise _TracedSizeError(
            f"{fn}: expected {name} to be an int, got a tensor under torch.jit.trace ({value!r}: a size such as "
            f"x.shape[1] is a 0-dim tensor there, and the trace would hold this call's value as a constant, wrong "
            f"at other sizes); pass an int to trace this one value, or export with torch.export, which keeps "
            f"sizes symbolic")
    if not isinstance(value, bool):
        try:
            # An int as it is: under torch.compile possibly a dynamic one, which operator.index
            # would specialise (a graph per value); _in_int64 leaves a dynamic one unchecked.
            number = value if isinstance(value, (int, torch.SymInt)) else operator.index(value)
        except TypeError:
            pass
        else:
            return _in_int64(fn, name, number)
    raise TypeError(f"{fn}: expected {name} to be an int, got {value!r}")


def _integer(value: Any) -> Any:
    """value as an int (a Python or numpy integer, not bool), or None for anything else (a
    tensor, a float, a string): the front ends' test of an int argument, whose TypeError
    names it. An int or SymInt is returned as it is: under torch.compile a Python int may be
    a dynamic one, which operator.index would specialise (a recompile per value)."""
    if isinstance(value, bool) or isinstance(value, Tensor):
        return None
    if isinstance(value, (int, torch.SymInt)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return None


def _in_int64(fn: str, name: str, number: Any) -> Any:
    """An int (of ``_integer`` or ``_int_arg``) checked to fit in int64 (ValueError naming it otherwise; the
    op's schema would refuse it with "expected int, found int"). A dynamic int is kept."""
    if isinstance(number, int) and not _INT64_MIN <= number <= _INT64_MAX:
        raise ValueError(f"{fn}: expected {name} to fit in int64, got {number}")
    return number


def _float_arg(fn: str, name: str, value: Any) -> float:
    """value (a real number: Python, numpy or a one-element tensor; not bool or str) as a
    float, or TypeError naming it. Only the type is normalised here: the op checks the
    value (finite, positive, ...)."""
    if not isinstance(value, (bool, str, bytes)):
        try:
            return float(value)
        except OverflowError:  # an int past float's range: a number, its sign's infinity for the op's check
            return math.inf if value > 0 else -math.inf
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{fn}: expected {name} to be a real number, got {value!r}")


def _specialised(value: Any) -> float:
    """A number torch.compile made a symbol (a size or an argument that changed between calls,
    or dynamic=True) as its value, a constant of the graph (a guard on it: a recompile per
    value): .hex() needs the value. Outside torch.compile the number as a float."""
    return float.fromhex(float(value).hex())


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """torch.jit.trace's recording paused (its state is per thread), for what a trace keeps as
    a constant anyway: a check's reads of sizes (traced, a size is a 0-dim tensor, and a
    comparison of one warns that the trace may be wrong, though a check is no data flow: it
    holds for the example, as every Python branch of a trace does) and the host's constants.
    Never around a size that feeds an op (it would be fixed at the example's)."""
    if not torch.jit.is_tracing():
        yield
        return
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


def _static_shape(t: Tensor) -> torch.Size:
    """t.shape as ints, for a check, also under torch.jit.trace (_untraced)."""
    if not torch.jit.is_tracing():
        return t.shape
    with _untraced():
        return t.shape


def _static_numel(t: Tensor) -> int:
    """t.numel() as an int, for a check, also under torch.jit.trace (_untraced)."""
    if not torch.jit.is_tracing():
        return t.numel()
    with _untraced():
        return t.numel()


def _specialised_int(value: Any) -> int:
    """_specialised for an int, exactly over int64: its high and low 32 bits (floor division
    and remainder), each exact as a float, specialised apart."""
    return int(_specialised(value // 2**32)) * 2**32 + int(_specialised(value % 2**32))


def _refuse_captured_writes(fn: str, **written: Any) -> None:
    """Refuse an in-place write, inside a torch.func transform that differentiates (grad, vjp,
    jacrev, jvp, ...), into a tensor the transformed function captured rather than took as an
    input (or into a view of one): an op may have saved it for its gradient, which would then
    silently use the overwritten values. torch.func refuses such a write by ATen's in-place ops,
    but its check reads only schemas that return their first argument (posenc's in-place ops
    return nothing, or write several tensors); so each tensor to be written is put to that
    check by an in-place op on an empty view of it (no element written: a no-op where it
    passes). Outside torch.func transforms nothing is done, and under torch.compile neither
    (Dynamo's tracing reads a functorch interpreter stack always: the check would put its
    in-place op into every graph)."""
    if torch._C._functorch.peek_interpreter_stack() is None or torch.compiler.is_compiling():
        return
    for name, t in written.items():
        if not isinstance(t, Tensor) or t.dim() == 0:
            continue
        try:
            with torch.no_grad():  # the empty view's write is not the caller's: no graph, no leaf-view error
                t.narrow(-1, 0, 0).zero_()
        except RuntimeError as e:
            if "captured Tensor" not in str(e):
                raise
            raise RuntimeError(
                f"{fn}: would write {name} in place, a tensor captured by a torch.func transform (grad, vjp, "
                f"jacrev, jvp, ...) rather than passed to the transformed function: the transform cannot see the "
                f"write (a gradient could silently use the overwritten values), and torch.func refuses it as it "
                f"refuses ATen's in-place ops on captured tensors; pass {name} as an input of the transformed "
                f"function, or write into a clone of it") from None


def _bool_arg(fn: str, name: str, value: Any) -> bool:
    """value (a Python or numpy bool) as a bool, or TypeError naming it: bool() would take
    the string "False", 0.5 or a list as True."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")):
        return bool(value)
    raise TypeError(f"{fn}: expected {name} to be a bool, got {value!r}")


def _tensor_arg(fn: str, name: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: expected {name} to be a Tensor, got {type(value).__name__}")
    return value


def _optional_tensor_args(fn: str, **values: Any) -> None:
    """TypeError naming the first of ``values`` that is neither None nor a Tensor (the op's
    schema would refuse it with a RuntimeError naming the op, not the function)."""
    for name, value in values.items():
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{fn}: expected {name} to be a Tensor or None, got {type(value).__name__}")


_TABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _table_dtype(fn: str, dtype: Any) -> torch.dtype:
    """``dtype`` if a table can be made in it (TypeError otherwise)."""
    if dtype not in _TABLE_DTYPES:
        raise TypeError(f"{fn}: expected dtype to be float16, bfloat16, float32 or float64, got {dtype!r}")
    return dtype


def _real(fn: str, name: str, value: Any, expected: str) -> float:
    """A constructor's number (Python or numpy, not bool; no tensor) as a float (an int past
    float's range as its sign's infinity), or TypeError naming it as ``expected`` describes
    it. The caller checks the value (ValueError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: expected {name} to be {expected}, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _check_positive_int(fn: str, name: str, value: Any) -> int:
    """value as a positive int: TypeError for another type (torch's convention: nn.Linear(2.0,
    3) raises TypeError), ValueError for one <= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: expected {name} to be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{fn}: expected {name} to be a positive integer, got {value!r}")
    return int(value)


def _check_probability(fn: str, name: str, value: Any) -> float:
    number = _real(fn, name, value, "a probability in [0, 1]")
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{fn}: expected {name} to be a probability in [0, 1], got {value!r}")
    return number


def _written_forward(cls: type) -> Any:
    """The forward ``cls`` was written with (its own or the base's it inherits), or None when
    the one it has now was assigned later: a class's own function is named
    ``<class>.forward``, a function assigned to the class afterwards is not (unless it copies
    that name, as ``functools.wraps`` does: such a replacement, made before this is read, is
    taken for the original). Read eagerly (at import, or when a model is patched), never
    while torch.compile traces (its comparison of the names there is not Python's)."""
    for owner in cls.__mro__:
        forward = owner.__dict__.get("forward")
        if forward is not None:
            return forward if getattr(forward, "__qualname__", None) == f"{owner.__qualname__}.forward" else None
    return None


def _forward_as_written(module: torch.nn.Module, forward: Any) -> bool:
    """Whether a call of ``module`` runs ``forward`` (its class's as written: _written_forward):
    none set on the instance and none assigned to the class since. Under torch.compile this is
    read when a graph is made, and a forward set on the instance or assigned to the class
    later recompiles: ``module.forward`` is read first because torch.compile guards on that
    attribute, and not on a lookup in the instance's ``__dict__`` (a forward set on a child
    after compiling was ignored: the compiled module kept fusing its dropout)."""
    if forward is None:
        return False
    module.forward  # noqa: B018 - read for torch.compile's guard on it (above)
    return module.__dict__.get("forward") is None and type(module).forward is forward


def _runs_as_written(module: torch.nn.Module, forward: Any) -> bool:
    """Whether a call of ``module`` runs ``forward`` as written (_forward_as_written) and no
    hook, its own or global, forward or backward: only then may a fused op stand in for
    calling it (a hook would not see it run; another forward computes something else)."""
    return _forward_as_written(module, forward) and not (_own_hooks(module) or _global_hooks())


def _own_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has hooks of its own, forward or backward."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _global_hooks() -> bool:
    """Whether any global module hook is registered, forward or backward."""
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_backward_pre_hooks)
