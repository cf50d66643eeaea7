"""Fewer repeated patches in Triton's CPU interpreter: the kernel tests' main cost on a CPU.

A kernel launch in the interpreter (`GridExecutor`) swaps triton.language's builtins for interpreted ones, runs the
grid, then puts them back. Every call of a `@triton.jit` helper from inside a kernel (`InterpretedFunction.__call__`)
patches the language modules again, walking each with `inspect.getmembers`. While a launch runs, a helper that sees
only modules patched already skips that here; a helper that sees another (say `triton.language.core`, as
triton.language's own helpers such as `tl.sum`'s combine function do, where the kernel saw only `triton.language`)
is patched as shipped the first time in a launch, and since the shipped call never restores what it patched, not
again in that launch. What the kernels compute is unchanged: the interpreted builtins are the same functions either
way. Measured alone on a 2-core AMD EPYC: tests/kernels/test_gpu_hybrid.py's graph decode steps (tiny-dense) 18.3 ->
13.8 s, verify and MTP graphs 28.8 -> 22.2 s."""

from __future__ import annotations

import inspect


def _langs(fn, tl) -> frozenset:
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install():
    """Patch the interpreter (with TRITON_INTERPRET=1); returns the function that puts the shipped code back."""
    import triton.language as tl
    from triton.runtime import interpreter

    original_patch = interpreter._patch_lang
    original_call = interpreter.InterpretedFunction.__call__
    active: list[set] = []  # per running launch, the modules patched while it runs, innermost last
    langs_of: dict = {}  # per function, the language modules its globals hold (they do not change after import)

    def langs(fn) -> frozenset:
        found = langs_of.get(fn)
        if found is None:
            found = langs_of[fn] = _langs(fn, tl)
        return found

    class _Scope:  # a launch's patches (GridExecutor restores them when its grid is done)
        def __init__(self, scope, langs: set):
            self.scope, self.langs = scope, langs

        def restore(self):
            try:
                self.scope.restore()
            finally:
                active[:] = [a for a in active if a is not self.langs]

    def patch_lang(fn):  # called by GridExecutor only: the helpers' calls below go to original_patch
        scope, patched = original_patch(fn), set(langs(fn))
        active.append(patched)
        return _Scope(scope, patched)

    def call(self, *args, **kwargs):  # InterpretedFunction.__call__ as shipped, less the repeated patching
        used = langs(self.fn)
        if active and used <= active[-1]:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interpreter.InterpreterError(repr(e)) from e
        if active:  # the shipped call patches them and never restores them: patched for the rest of the launch
            active[-1] |= used
        interpreter._patch_lang = original_patch
        try:
            return original_call(self, *args, **kwargs)
        finally:
            interpreter._patch_lang = patch_lang

    interpreter._patch_lang = patch_lang
    interpreter.InterpretedFunction.__call__ = call

    def restore() -> None:
        interpreter._patch_lang = original_patch
        interpreter.InterpretedFunction.__call__ = original_call

    return restore
