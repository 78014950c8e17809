"""Make a user's callable (``loss_fn``) something ``mindspore.jit`` can parse, or say why not.

``mindspore.jit`` compiles a Python function from its *source text*. For a lambda it reads the
whole source line and fails when the lambda shares it with other code, which is how lambdas
are written (``ScheduleMPipeTranspose(..., loss_fn=lambda out, y: ...)``): the error
("unmatched ')'") used to surface on the last rank at its first forward step. Here the lambda
is found in its file's syntax tree and rewritten as a named function of its own, in a file of
its own, with the lambda's globals and closure values as its globals; jit then parses that.
Anything without readable source is rejected when the schedule is built, with what to write.
"""

from __future__ import annotations

import ast
import atexit
import dis
import inspect
import itertools
import linecache
import shutil
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

_counter = itertools.count()
_directory: Path | None = None

_HOW_TO = (
    "define it with def at module level, e.g.\n"
    "    def loss_fn(output, labels):\n"
    "        return ((output - labels) ** 2).mean()\n"
    'and pass loss_fn=loss_fn (or use mode="pynative")'
)


def jit_parseable(fn: Callable[..., Any], what: str = "loss_fn") -> Callable[..., Any]:
    """``fn`` itself when jit can read its source; a lambda rewritten as a named function; else
    ``TypeError`` naming ``what`` and saying what to write instead."""
    code = getattr(fn, "__code__", None)
    if code is None:  # a Cell, a callable object, a builtin: jit handles them or says so itself
        return fn
    if not linecache.getlines(code.co_filename):
        raise TypeError(
            f"{what} {getattr(fn, '__qualname__', fn)!r} has no source file that mindspore.jit could "
            f"read (defined interactively or by exec?): {_HOW_TO}"
        )
    if fn.__name__ != "<lambda>":
        return fn
    node = _find_lambda(code)
    if node is None:
        raise TypeError(f"{what} is a lambda whose source could not be located for mindspore.jit: {_HOW_TO}")
    return _as_function(fn, node)


def _find_lambda(code: Any) -> ast.Lambda | None:
    """The lambda node of ``code``: the innermost lambda on its first line spanning every
    instruction position of its body."""
    source = "".join(linecache.getlines(code.co_filename))
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    spots = [
        (pos[0], pos[2])
        for ins, pos in zip(dis.get_instructions(code), code.co_positions(), strict=False)
        if ins.opname != "RESUME" and pos[0] is not None and pos[2] is not None
    ]
    candidates = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Lambda)
        and n.lineno == code.co_firstlineno
        and all((n.lineno, n.col_offset) <= s <= (n.end_lineno, n.end_col_offset) for s in spots)
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda n: (n.lineno, n.col_offset))  # innermost: starts last


def _as_function(fn: Callable[..., Any], node: ast.Lambda) -> Callable[..., Any]:
    """``def <name>(<lambda args>): return <lambda body>`` written to a file of its own."""
    global _directory
    index = next(_counter)
    name = f"lambda_loss_{index}"
    function = ast.FunctionDef(
        name=name,
        args=node.args,
        body=[ast.Return(node.body)],
        decorator_list=[],
        returns=None,
        type_params=[],
    )
    text = ast.unparse(ast.fix_missing_locations(ast.Module(body=[function], type_ignores=[]))) + "\n"
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix="graph-exec-jit-"))
        atexit.register(shutil.rmtree, _directory, ignore_errors=True)
    path = _directory / f"{name}.py"
    path.write_text(text, encoding="utf-8")
    # A module of its own: jit looks a function's global names up in the module it belongs to.
    module = types.ModuleType(f"graph_exec_jit_{name}")
    module.__dict__.update({k: v for k, v in fn.__globals__.items() if not k.startswith("__")})
    if fn.__closure__:
        module.__dict__.update(
            zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True)
        )
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    exec(compile(text, str(path), "exec"), module.__dict__)
    rewritten = module.__dict__[name]
    rewritten.__doc__ = f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}: {ast.unparse(node)}"
    return rewritten
