"""Record the real Mooncake wheel's public Python surface in tests/compat/mooncake_surface.json.

Run it in a virtualenv that has the real wheel and NOT tsukimi's shim (refresh after a wheel
upgrade, then run tests/compat/test_mooncake_surface.py and settle every new difference):

    PYTHONPATH= /work/main/.venv/bin/python scripts/mooncake_surface.py [OUT.json]

It walks `pkgutil.walk_packages(mooncake.__path__, "mooncake.")` and imports each module; a
module whose import fails is recorded with the reason (a GPU-only build, a missing optional
dependency). For the others it records the public names: classes (with their methods,
properties, attributes and enum members), functions, enum values and simple constants, each
with a kind and, for callables, the signature(s): `inspect.signature` where it works, else the
pybind11 docstring's first line (overloads give several). Names in a module's `__all__` are
public; without `__all__`, the names defined in that module (by `__module__`) that do not start
with `_`, plus simple constants. No docstrings, no annotations: names, kinds, defaults.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import pkgutil
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
Record = dict[str, JsonValue]

OUT = Path(__file__).resolve().parent.parent / "tests" / "compat" / "mooncake_surface.json"
DUNDERS = ("__call__", "__enter__", "__exit__", "__aenter__", "__aexit__", "__iter__", "__len__", "__getitem__")
SIMPLE = (int, float, str, bool, bytes, type(None))
KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "pos",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos_or_kw",
    inspect.Parameter.VAR_POSITIONAL: "var_pos",
    inspect.Parameter.KEYWORD_ONLY: "kw",
    inspect.Parameter.VAR_KEYWORD: "var_kw",
}
_ADDRESS = re.compile(r" (object )?at 0x[0-9a-f]+")


def normalize_default(text: str) -> str:
    """A default's repr without memory addresses (`<X object at 0x7f..>` -> `<X>`)."""
    return _ADDRESS.sub("", text)


def _split_top(text: str) -> list[str]:
    """Split a parameter list on the commas outside brackets."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>" and not (ch == ">" and text[i - 1] == "-"):
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return [*parts, tail] if tail else parts


def _doc_params(inner: str) -> list[Record]:
    params: list[Record] = []
    kind = "pos_or_kw"
    for part in _split_top(inner):
        if part == "*":
            kind = "kw"
            continue
        if part == "/":
            for param in params:
                param["kind"] = "pos"
            continue
        if part.startswith("**"):
            params.append({"name": part[2:].split(":")[0].strip(), "kind": "var_kw"})
            continue
        if part.startswith("*"):
            params.append({"name": part[1:].split(":")[0].strip(), "kind": "var_pos"})
            kind = "kw"
            continue
        head, _, default = part.partition(" = ")
        param: Record = {"name": head.split(":")[0].strip(), "kind": kind}
        if default:
            param["default"] = normalize_default(default.strip())
        params.append(param)
    return params


def doc_signatures(name: str, doc: str | None) -> list[list[Record]]:
    """The pybind11 signatures in `doc`: `name(a: T = d) -> R`, or its numbered overloads."""
    found: list[list[Record]] = []
    for line in (doc or "").splitlines():
        text = re.sub(r"^\d+\. ", "", line.strip())
        if not text.startswith(name + "("):
            continue
        depth = 0
        for i in range(len(name), len(text)):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                found.append(_doc_params(text[len(name) + 1 : i]))
                break
    overloaded = len(found) > 1 and [p["kind"] for p in found[0]] == ["var_pos", "var_kw"]
    return found[1:] if overloaded else found[:1]


def signatures(name: str, obj: Callable[..., object]) -> list[list[Record]]:
    """The callable's signature(s) as lists of {name, kind[, default]} (self/cls dropped)."""
    try:
        sig = inspect.signature(obj)
        sigs = [
            [
                {"name": p.name, "kind": KINDS[p.kind]}
                | ({} if p.default is p.empty else {"default": normalize_default(repr(p.default))})
                for p in sig.parameters.values()
            ]
        ]
    except (TypeError, ValueError):
        sigs = doc_signatures(name, getattr(obj, "__doc__", None))
    return [[p for p in s if p["name"] not in ("self", "cls")] for s in sigs]


def _value(obj: object) -> JsonValue:
    if isinstance(obj, bytes):
        return repr(obj)
    if isinstance(obj, SIMPLE):
        return obj  # type: ignore[return-value]
    return None


def _is_enum_value(obj: object) -> bool:
    return isinstance(obj, enum.Enum) or (
        hasattr(type(obj), "__members__") and type(type(obj)).__name__ == "pybind11_type"
    )


def _enum_name(obj: object) -> str:
    return f"{type(obj).__name__}.{getattr(obj, 'name', obj)}"


def _member_value(member: object) -> object:
    return member.value if isinstance(member, enum.Enum) else int(member)  # type: ignore[call-overload]


def _in_wheel(owner: type) -> bool:
    return owner.__module__.startswith("mooncake")


def describe_class(cls: type) -> Record:
    """A class: its constructor, members (own and inherited from wheel classes), enum members."""
    record: Record = {"kind": "class"}
    members: dict[str, JsonValue] = {}
    if isinstance(cls, enum.EnumMeta) or hasattr(cls, "__members__"):
        record["kind"] = "enum"
        members_map = cls.__members__  # type: ignore[attr-defined]
        record["members"] = {name: _value(_member_value(v)) for name, v in members_map.items()}
    else:
        init = cls.__init__  # type: ignore[misc]
        if init is not object.__init__:
            record["init"] = signatures("__init__", init)  # type: ignore[arg-type]
    enum_names = set(record.get("members") or {})  # type: ignore[arg-type]
    for owner in reversed([c for c in cls.__mro__ if _in_wheel(c)]):
        for name, raw in vars(owner).items():
            if (name.startswith("_") and name not in DUNDERS) or name in enum_names:
                continue
            members[name] = _describe_member(name, raw)
    record["attrs"] = dict(sorted(members.items()))
    return record


def _describe_member(name: str, raw: object) -> JsonValue:
    if isinstance(raw, property):
        return {"kind": "property", "readonly": raw.fset is None}
    if isinstance(raw, staticmethod):
        return {"kind": "staticmethod", "sigs": signatures(name, raw.__func__)}  # type: ignore[dict-item]
    if isinstance(raw, classmethod):
        return {"kind": "classmethod", "sigs": signatures(name, raw.__func__)}  # type: ignore[dict-item]
    if type(raw).__name__ == "builtin_function_or_method":  # a pybind11 static method
        return {"kind": "staticmethod", "sigs": signatures(name, raw)}  # type: ignore[dict-item,arg-type]
    if callable(raw) and not isinstance(raw, type):
        return {"kind": "method", "sigs": signatures(name, raw)}  # type: ignore[dict-item]
    if isinstance(raw, type):
        return {"kind": "class"}
    if _is_enum_value(raw):
        return {"kind": "enum_value", "value": _enum_name(raw)}
    return {"kind": "attribute", "value": _value(raw)}


def describe_module(module: ModuleType) -> Record:
    """A module's public names (see the module docstring for which)."""
    public = getattr(module, "__all__", None)
    names: dict[str, JsonValue] = {}
    for name, obj in sorted(vars(module).items()):
        if public is not None and name not in public:
            continue
        if public is None and name.startswith("_"):
            continue
        own = getattr(obj, "__module__", None) == module.__name__
        if isinstance(obj, ModuleType):
            continue
        if isinstance(obj, type):
            if own or public is not None:
                names[name] = (
                    describe_class(obj) if own else {"kind": "class", "from": f"{obj.__module__}.{obj.__qualname__}"}
                )
        elif _is_enum_value(obj):
            if own or public is not None or type(obj).__module__ == module.__name__:
                names[name] = {"kind": "enum_value", "value": _enum_name(obj)}
        elif callable(obj):
            if own or public is not None:
                names[name] = {"kind": "function", "sigs": signatures(name, obj)}  # type: ignore[dict-item]
        elif isinstance(obj, SIMPLE) and (public is not None or name.isupper()):
            names[name] = {"kind": "constant", "value": _value(obj)}
    return {"names": names}


def main(argv: list[str]) -> int:
    """Write the surface JSON (argv[1] or tests/compat/mooncake_surface.json); returns 0."""
    if any(type(finder).__name__ == "MooncakeFinder" for finder in sys.meta_path):
        raise SystemExit("tsukimi's shim is installed: run this without `tsukimi compat exec`")
    import mooncake

    if not mooncake.__file__ or "tsukimi" in mooncake.__file__:
        raise SystemExit(f"{mooncake.__file__} is not the real wheel")
    version = importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    modules: dict[str, JsonValue] = {"mooncake": describe_module(mooncake)}
    for info in pkgutil.walk_packages(mooncake.__path__, "mooncake.", onerror=lambda _name: None):
        if info.name.startswith(("mooncake.libasio", "mooncake.libetcd_wrapper")):
            continue  # NOTE: shared libraries shipped in the package, not Python modules
        try:
            module = importlib.import_module(info.name)
        except Exception as exc:  # NOTE: the reason is the record
            modules[info.name] = {"import_error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
            continue
        modules[info.name] = describe_module(module)
    surface = {"wheel": f"mooncake-transfer-engine-non-cuda {version}", "modules": modules}
    out = Path(argv[1]) if len(argv) > 1 else OUT
    out.write_text(json.dumps(surface, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {len(modules)} modules")
    return 0


if __name__ == "__main__":
    import importlib.metadata

    sys.exit(main(sys.argv))
