"""The differences between the wheel's recorded surface (mooncake_surface.json, written by
scripts/mooncake_surface.py) and tsukimi's facade, as (module, name, what) triples.

A difference is what would break a caller written against the wheel: a missing module or
name, another kind (a method where the wheel has a property...), a call the wheel accepts that
the facade does not bind (positionally, by keyword, with only the required arguments), a
literal default that differs, a read-only property the wheel lets you set, another enum member
or constant value. Extra names, extra optional parameters and more permissive signatures in
the facade are not differences. `name` is "*" for a whole module, else `Class` or
`Class.member`, or a module-level name.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from tsukimi.compat.mooncake import shim

SURFACE = Path(__file__).with_name("mooncake_surface.json")
Record = dict[str, object]
Params = list[dict[str, str]]
Difference = tuple[str, str, str]
_PLACEHOLDER = object()


def load_surface() -> dict[str, Record]:
    """The recorded modules: name -> {"names": ...} or {"import_error": reason}."""
    modules: dict[str, Record] = json.loads(SURFACE.read_text())["modules"]
    return modules


def facade_module(name: str) -> ModuleType | None:
    """The facade's module for wheel module `name`, as the shim would serve it (None: absent)."""
    try:
        if shim.MooncakeFinder().find_spec(name) is None:
            return None
    except ModuleNotFoundError:  # NOTE: a submodule of a package the facade lacks
        return None
    return importlib.import_module(shim.TARGET + name.removeprefix("mooncake"))


def differences(modules: dict[str, Record]) -> Iterator[Difference]:
    """Every difference between the recorded wheel modules and the facade (see the module)."""
    for module_name, record in sorted(modules.items()):
        if "import_error" in record:
            if facade_module(module_name) is None:
                yield module_name, "*", f"missing (the wheel's import fails here too: {record['import_error']})"
            continue
        module = facade_module(module_name)
        if module is None:
            yield module_name, "*", "missing module"
            continue
        names: dict[str, Record] = record["names"]  # type: ignore[assignment]
        for name, entry in sorted(names.items()):
            if not hasattr(module, name):
                yield module_name, name, "missing"
                continue
            for what in _compare(getattr(module, name), entry, module_name):
                yield module_name, (f"{name}.{what[0]}" if what[0] else name), what[1]


def _compare(obj: object, entry: Record, module_name: str) -> Iterator[tuple[str, str]]:
    kind = entry["kind"]
    if kind in ("class", "enum"):
        if not isinstance(obj, type):
            yield "", f"not a class ({type(obj).__name__})"
            return
        if "from" in entry:
            yield from _same_class(obj, str(entry["from"]))
            return
        yield from _compare_class(obj, entry)
    elif kind == "function":
        if not callable(obj):
            yield "", "not callable"
            return
        for what in _compare_sigs(obj, entry["sigs"], drop_self=False):  # type: ignore[arg-type]
            yield "", what
    elif kind == "enum_value":
        if _enum_text(obj) != entry["value"]:
            yield "", f"value {_enum_text(obj)} != {entry['value']}"
    elif kind == "constant" and obj != entry["value"] and repr(obj) != entry["value"]:
        yield "", f"value {obj!r} != {entry['value']!r}"


def _same_class(obj: type, origin: str) -> Iterator[tuple[str, str]]:
    module_name, _, qualname = origin.rpartition(".")
    source = facade_module(module_name)
    if source is None or getattr(source, qualname, None) is not obj:
        yield "", f"not the facade's {origin}"


def _compare_class(cls: type, entry: Record) -> Iterator[tuple[str, str]]:
    if entry["kind"] == "enum":
        members = {m.name: m.value for m in cls} if issubclass(cls, enum.Enum) else {}
        if members != entry["members"]:
            yield "", f"enum members {members} != {entry['members']}"
    if "init" in entry:
        for what in _compare_sigs(cls, entry["init"], drop_self=False):  # type: ignore[arg-type]
            yield "__init__", what
    attrs: dict[str, Record] = entry["attrs"]  # type: ignore[assignment]
    for name, member in sorted(attrs.items()):
        raw = inspect.getattr_static(cls, name, _PLACEHOLDER)
        if raw is _PLACEHOLDER and name in _fields(cls):
            continue  # NOTE: an instance attribute (a dataclass field) reads as the wheel's property
        if raw is _PLACEHOLDER:
            yield name, "missing"
            continue
        for what in _compare_member(cls, name, raw, member):
            yield name, what


def _fields(cls: type) -> set[str]:
    """Instance attributes: those a class declares (annotations along its MRO), or, for a
    class made without arguments, those a fresh instance has."""
    names = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    try:
        instance = cls()
    except Exception:  # NOTE: a class that needs arguments: declared names only
        return names
    return names | set(getattr(instance, "__dict__", {})) | {n for n in dir(instance) if not n.startswith("_")}


def _compare_member(cls: type, name: str, raw: object, member: Record) -> Iterator[str]:
    kind = member["kind"]
    if kind == "property":
        if not isinstance(raw, property):
            if callable(raw):
                yield "a method, not a property"
            return  # NOTE: a plain attribute reads and writes as the property does
        if not member["readonly"] and raw.fset is None:
            yield "read-only (the wheel's can be set)"
    elif kind in ("method", "staticmethod", "classmethod"):
        if not callable(raw) and not isinstance(raw, (staticmethod, classmethod)):
            yield f"not a {kind}"
            return
        yield from _compare_sigs(getattr(cls, name), member["sigs"], drop_self=kind == "method")  # type: ignore[arg-type]
    elif kind == "enum_value":
        if _enum_text(getattr(cls, name)) != member["value"]:
            yield f"value {_enum_text(getattr(cls, name))} != {member['value']}"
    elif kind == "attribute" and member["value"] is not None and getattr(cls, name) != member["value"]:
        yield f"value {getattr(cls, name)!r} != {member['value']!r}"


def _enum_text(obj: object) -> str:
    return f"{type(obj).__name__}.{getattr(obj, 'name', obj)}"


def _compare_sigs(func: Callable[..., object], sigs: list[Params], drop_self: bool) -> Iterator[str]:
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return  # NOTE: a builtin without a signature (e.g. a C type's __init__) binds anything
    if drop_self:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    for params in sigs:
        problem = _binds(sig, params)
        if problem:
            yield f"{problem} (wheel: {_render(params)}; facade: {sig})"


def _binds(sig: inspect.Signature, params: Params) -> str:
    """Why `sig` does not accept a call the wheel's `params` accept ("" when it does)."""
    plain = [p for p in params if p["kind"] not in ("var_pos", "var_kw")]
    if len(plain) < len(params):
        return ""  # NOTE: the wheel's own (*args, **kwargs): nothing to hold the facade to
    positional = [p for p in plain if p["kind"] in ("pos", "pos_or_kw")]
    required = [p for p in positional if "default" not in p]
    calls = {
        "all positionally": (len(positional), {}),
        "only the required ones": (
            len(required),
            {p["name"]: 0 for p in plain if p["kind"] == "kw" and "default" not in p},
        ),
        "by keyword": (
            len([p for p in positional if _anonymous(p) or p["kind"] == "pos"]),
            {p["name"]: 0 for p in plain if not _anonymous(p) and p["kind"] != "pos"},
        ),
    }
    for label, (count, keywords) in calls.items():
        try:
            bound = sig.bind(*([0] * count), **keywords)
        except TypeError as exc:
            return f"a call with the arguments {label} fails: {exc}"
        for index, name in enumerate(bound.arguments):
            named = index < count and index < len(positional) and not _anonymous(positional[index])
            if (
                named
                and name != positional[index]["name"]
                and sig.parameters[name].kind != inspect.Parameter.VAR_POSITIONAL
            ):
                return f"positional argument {index} is {name!r}, the wheel's {positional[index]['name']!r}"
    for p in plain:
        default = p.get("default")
        ours = sig.parameters.get(p["name"])
        if default is None or ours is None or ours.default is inspect.Parameter.empty:
            continue
        literal = _literal(default)
        if literal is not _PLACEHOLDER and literal != ours.default:
            return f"default of {p['name']!r} is {ours.default!r}, the wheel's {default}"
    return ""


def _anonymous(param: dict[str, str]) -> bool:
    name = param["name"]
    return name.startswith("arg") and name[3:].isdigit()  # NOTE: pybind11's unnamed arguments


def _literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _PLACEHOLDER


def _render(params: Params) -> str:
    return "(" + ", ".join(p["name"] + (f"={p['default']}" if "default" in p else "") for p in params) + ")"
