"""The type stub of the native module (``spattn/_native.pyi``) against the module itself: the same
public names, the same ``GraphCore`` members of the same kinds, the same parameters and defaults.
CPU only, no torch. The stub read is the one beside the imported module, so against an installed
wheel this also checks that the wheel ships it (with ``py.typed``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from spattn import _native

STUB = Path(_native.__file__).with_name("_native.pyi")


def _tree() -> ast.Module:
    assert STUB.is_file(), f"no type stub beside the native module: {STUB}"
    return ast.parse(STUB.read_text(encoding="utf-8"), filename=str(STUB))


def _declared(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """The names a module or class body of the stub declares, with their statements."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.setdefault(node.name, node)  # a property's setter repeats its name
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names[t.id] = node
    return names


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def _compare(what: str, runtime: set[str], stub: set[str]) -> None:
    missing = sorted(runtime - stub)
    extra = sorted(stub - runtime)
    assert not missing and not extra, (
        f"{what}: missing from the stub: {missing or 'none'}; "
        f"in the stub but not in the module: {extra or 'none'}"
    )


def _graphcore(tree: ast.Module) -> ast.ClassDef:
    node = _declared(tree.body).get("GraphCore")
    assert isinstance(node, ast.ClassDef), "the stub declares no class GraphCore"
    return node


def _decorators(node: ast.FunctionDef) -> set[str]:
    out = set()
    for d in node.decorator_list:
        if isinstance(d, ast.Name):
            out.add(d.id)
        elif isinstance(d, ast.Attribute):
            out.add(d.attr)
    return out


def _stub_params(node: ast.FunctionDef, drop_self: bool) -> list[tuple[str, object]]:
    """(name, default or inspect.Parameter.empty) of the stub's parameters."""
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + [
        ast.literal_eval(d) for d in a.defaults
    ]
    params = list(zip((p.arg for p in positional), defaults))
    params += [
        (p.arg, inspect.Parameter.empty if d is None else ast.literal_eval(d))
        for p, d in zip(a.kwonlyargs, a.kw_defaults)
    ]
    return params[1:] if drop_self else params


def _runtime_params(obj, drop_self: bool) -> list[tuple[str, object]] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # no __text_signature__
        return None
    params = [(p.name, p.default) for p in sig.parameters.values()]
    return params[1:] if drop_self else params


def _render(params: list[tuple[str, object]]) -> str:
    return ", ".join(n if d is inspect.Parameter.empty else f"{n}={d!r}" for n, d in params)


def test_stub_ships_with_py_typed():
    _tree()
    assert STUB.with_name("py.typed").is_file(), "no py.typed marker (PEP 561) in the package"


def test_module_names_match():
    declared = _declared(_tree().body)
    runtime = _public(dir(_native)) | {"__version__"}
    stub = _public(declared) | ({"__version__"} & declared.keys())
    _compare("spattn._native", runtime, stub)


def test_module_all_matches():
    declared = _declared(_tree().body)
    if "__all__" not in declared:
        pytest.skip("the stub declares no __all__")
    value = ast.literal_eval(declared["__all__"].value)  # type: ignore[attr-defined]
    _compare("spattn._native.__all__", set(_native.__all__), set(value))


def test_graphcore_members_match():
    stub = _public(_declared(_graphcore(_tree()).body))
    _compare("spattn._native.GraphCore", _public(dir(_native.GraphCore)), stub)


def test_graphcore_member_kinds_match():
    members = _declared(_graphcore(_tree()).body)
    wrong = []
    for name in sorted(_public(dir(_native.GraphCore)) & members.keys()):
        raw = inspect.getattr_static(_native.GraphCore, name)
        if isinstance(raw, staticmethod):
            kind = "staticmethod"
        elif inspect.isgetsetdescriptor(raw) or isinstance(raw, property):
            kind = "property"
        else:
            kind = "method"
        node = members[name]
        if isinstance(node, ast.FunctionDef):
            decorators = _decorators(node)
            declared = (
                "staticmethod"
                if "staticmethod" in decorators
                else "property"
                if "property" in decorators
                else "method"
            )
        else:
            declared = "property"  # an annotated attribute
        if kind != declared:
            wrong.append(f"{name} (a {kind}, declared as a {declared})")
    assert not wrong, f"GraphCore members of the wrong kind in the stub: {wrong}"


def test_signatures_match():
    tree = _tree()
    module = _declared(tree.body)
    cls = _declared(_graphcore(tree).body)
    pairs = [(f"{n}()", getattr(_native, n), module[n], False) for n in _public(dir(_native))
             if isinstance(module.get(n), ast.FunctionDef)]
    for name in _public(dir(_native.GraphCore)):
        node = cls.get(name)
        if not isinstance(node, ast.FunctionDef) or "property" in _decorators(node):
            continue
        static = "staticmethod" in _decorators(node)
        pairs.append((f"GraphCore.{name}()", getattr(_native.GraphCore, name), node, not static))
    wrong = []
    for label, obj, node, bound in sorted(pairs, key=lambda p: p[0]):
        runtime = _runtime_params(obj, drop_self=bound)
        if runtime is None:
            continue
        stub = _stub_params(node, drop_self=bound)
        if runtime != stub:
            wrong.append(f"{label}: module ({_render(runtime)}), stub ({_render(stub)})")
    assert not wrong, "parameters (name, default) differ:\n" + "\n".join(wrong)


def test_exception_base_matches():
    node = _declared(_tree().body).get("SpattnError")
    assert isinstance(node, ast.ClassDef), "the stub declares no class SpattnError"
    bases = [ast.unparse(b) for b in node.bases]
    assert bases == [_native.SpattnError.__base__.__name__], (
        f"SpattnError: stub bases {bases}, module {_native.SpattnError.__base__.__name__}"
    )


def test_spattn_error_is_spattns_and_pickles():
    import pickle

    import spattn

    assert spattn.SpattnError.__module__ == "spattn"
    err = pickle.loads(pickle.dumps(spattn.SpattnError("no device")))
    assert type(err) is spattn.SpattnError and err.args == ("no device",)
