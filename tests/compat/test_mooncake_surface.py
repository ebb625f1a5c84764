"""The Mooncake wheel's whole Python surface against tsukimi's facade.

tests/compat/mooncake_surface.json records the real wheel's modules, classes, functions,
signatures and constants (scripts/mooncake_surface.py writes it from an installed wheel; see
that script for how to refresh it). Every difference the facade shows (surface_diff.py says
what counts) must be a row of `tsukimi.compat.mooncake.gaps.DIFFERENCES` naming the reason,
every row must still be a difference, and docs/compat.md must show each row. No master, no
wheel needed: the facade's modules are imported as the shim serves them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat.surface_diff import differences, facade_module, load_surface
from tsukimi.compat.mooncake import gaps

pytestmark = pytest.mark.timeout(60)
DOC = Path(__file__).resolve().parents[2] / "docs" / "compat.md"


@pytest.fixture(scope="module")
def found() -> list[tuple[str, str, str]]:
    return list(differences(load_surface()))


def test_every_difference_is_listed_with_its_reason(found: list[tuple[str, str, str]]) -> None:
    unlisted = [f"{module} {name}: {what}" for module, name, what in found if gaps.covering(module, name) is None]
    assert not unlisted, "implement these, or add them to gaps.DIFFERENCES with the reason:\n" + "\n".join(unlisted)


def test_every_listed_difference_is_still_one(found: list[tuple[str, str, str]]) -> None:
    covered = {gaps.covering(module, name) for module, name, _ in found}
    stale = sorted(set(gaps.DIFFERENCES) - covered)
    assert not stale, f"no longer differences (drop them from gaps.DIFFERENCES and docs/compat.md): {stale}"


def test_docs_show_the_table() -> None:
    doc = DOC.read_text()
    missing = [row for row in gaps.markdown().splitlines() if row not in doc]
    assert not missing, "docs/compat.md lacks these rows (paste gaps.markdown()):\n" + "\n".join(missing)


def test_the_recorded_surface_is_the_wheel_s_and_readable() -> None:
    modules = load_surface()
    assert {"mooncake", "mooncake.store", "mooncake.engine", "mooncake.mooncake_config"} <= set(modules)
    store = modules["mooncake.store"]["names"]
    assert store["ReplicateConfig"]["kind"] == "class"  # type: ignore[index]
    assert "import_error" in modules["mooncake.pg"]  # a GPU build's module, recorded with its reason


def test_the_shim_serves_every_module_the_facade_has() -> None:
    assert facade_module("mooncake").__name__ == "tsukimi.compat.mooncake"  # type: ignore[union-attr]
    assert facade_module("mooncake.store").__name__ == "tsukimi.compat.mooncake.store"  # type: ignore[union-attr]
    assert facade_module("mooncake.reshard.weight") is None


def test_the_comparison_finds_what_a_caller_would_hit() -> None:
    param = {"name": "key", "kind": "pos_or_kw"}
    surface: dict[str, dict[str, object]] = {
        "mooncake.store": {
            "names": {
                "NoSuchName": {"kind": "function", "sigs": [[]]},
                "ObjectDataType": {"kind": "enum", "attrs": {}, "members": {"UNKNOWN": 0, "KVCACHE": 7}},
                "MooncakeDistributedStore": {
                    "kind": "class",
                    "attrs": {
                        "is_exist": {"kind": "method", "sigs": [[param]]},
                        "remove": {
                            "kind": "method",
                            "sigs": [[param, {"name": "force", "kind": "pos_or_kw", "default": "True"}]],
                        },
                        "get": {"kind": "method", "sigs": [[{"name": "name", "kind": "pos_or_kw"}]]},
                        "put": {"kind": "property", "readonly": False},
                    },
                },
            }
        },
        "mooncake.nowhere": {"names": {}},
    }
    found = {(module, name): what for module, name, what in differences(surface)}  # type: ignore[arg-type]
    assert set(found) == {
        ("mooncake.nowhere", "*"),
        ("mooncake.store", "NoSuchName"),
        ("mooncake.store", "ObjectDataType"),
        ("mooncake.store", "MooncakeDistributedStore.remove"),
        ("mooncake.store", "MooncakeDistributedStore.get"),
        ("mooncake.store", "MooncakeDistributedStore.put"),
    }
    assert "default of 'force'" in found["mooncake.store", "MooncakeDistributedStore.remove"]
    assert "'key', the wheel's 'name'" in found["mooncake.store", "MooncakeDistributedStore.get"]
