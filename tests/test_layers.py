"""The structure check (`python -m tsukimi.testing.layers`): the real tree has no import cycle, no
upward import, and no product module importing the tooling (testing, bench); on small made-up
packages, each rule catches what it should."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tsukimi.testing.layers import build_graph, check_layers, main

REPO = Path(__file__).resolve().parents[1]


def test_the_package_has_no_cycle_and_no_upward_import() -> None:
    problems = check_layers()
    assert not problems, "\n".join(map(str, problems))


def test_the_command_runs_on_the_package() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tsukimi.testing.layers"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("layers OK")


def _package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


CLEAN = {
    "__init__.py": "from pkg.cli import main\n",
    "errors.py": "class Oops(Exception): ...\n",
    "cli.py": "import pkg.transfer\nfrom pkg import errors\n\ndef main() -> None: ...\n",
    "transfer/__init__.py": "from pkg.transfer.engine import Engine\n",  # re-exports: not a cycle
    "transfer/engine.py": "from ..errors import Oops\nfrom . import wire\n\nclass Engine: ...\n",
    "transfer/wire.py": "import os\nimport numpy\n",
}


def test_a_sound_package_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    package = _package(tmp_path, CLEAN)
    assert check_layers(package) == []
    assert main([str(package)]) == 0
    assert capsys.readouterr().out.startswith("layers OK: 6 modules, 6 imports")


def test_imports_resolve_to_submodules_else_to_the_package(tmp_path: Path) -> None:
    graph = build_graph(_package(tmp_path, CLEAN))
    edges = {(e.importer, e.imported) for e in graph.edges}
    assert edges == {
        ("pkg", "pkg.cli"),
        ("pkg.cli", "pkg.transfer"),
        ("pkg.cli", "pkg.errors"),  # `from pkg import errors` names the submodule
        ("pkg.transfer", "pkg.transfer.engine"),
        ("pkg.transfer.engine", "pkg.errors"),  # relative, two levels
        ("pkg.transfer.engine", "pkg.transfer.wire"),  # `from . import wire`
    }


def test_a_cycle_hidden_in_functions_and_type_checking_is_reported(tmp_path: Path) -> None:
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "store/__init__.py": "",
            "store/a.py": "def f():\n    from . import b\n",
            "store/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.store.a import A\n",
        },
    )
    [problem] = check_layers(package)
    assert problem.kind == "cycle"
    assert str(problem) == "cycle: pkg.store.a -> pkg.store.b -> pkg.store.a  [pkg/store/a.py:2, pkg/store/b.py:3]"


def test_a_name_from_a_package_init_is_an_edge_to_the_init(tmp_path: Path) -> None:
    files = {**CLEAN, "cli.py": "from pkg import __version__\n"}
    problems = check_layers(_package(tmp_path, files))
    assert [str(p) for p in problems] == ["cycle: pkg -> pkg.cli -> pkg  [pkg/__init__.py:1, pkg/cli.py:1]"]


def test_an_upward_import_is_reported_with_its_line(tmp_path: Path) -> None:
    files = {**CLEAN, "config.py": "import os\n\ndef dtype():\n    from pkg.transfer.engine import Engine\n"}
    problems = check_layers(_package(tmp_path, files))
    assert [str(p) for p in problems] == [
        "layer: pkg/config.py:4 pkg.config imports pkg.transfer.engine (config, layer 0 -> transfer, layer 2)"
    ]


def test_a_name_in_no_layer_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    package = _package(tmp_path, {**CLEAN, "gadgets/__init__.py": "", "gadgets/knob.py": "from pkg import cli\n"})
    problems = check_layers(package)
    assert [p.kind for p in problems] == ["unknown"]
    assert "'gadgets' is in no layer" in problems[0].message and "LAYERS" in problems[0].message
    assert main([str(package)]) == 1
    assert capsys.readouterr().out.splitlines()[1].startswith("  unknown: 'gadgets' is in no layer")


TOOLED = {  # the real order: integrations below testing, the tooling above the product
    **CLEAN,
    "__main__.py": "from pkg.cli import main\n",
    "cli.py": "from pkg.bench import run\nfrom pkg.testing.kit import check\n\ndef main() -> None: ...\n",
    "demo.py": "from pkg.bench import run\n",
    "serving/__init__.py": "",
    "serving/worker.py": "from pkg.transfer.engine import Engine\n",
    "integrations/__init__.py": "from pkg.serving import worker\n",
    "testing/__init__.py": "",
    "testing/kit.py": "from pkg.integrations import worker\n\ndef check() -> None: ...\n",
    "testing/ports.py": "import socket\n",
    "bench/__init__.py": "from pkg.testing.kit import check\n\ndef run() -> None: ...\n",
    "bench/clock.py": "import time\n",
}
NEVER = "(the product never imports {}: only bench, cli, demo, lab, testing may)"


def test_the_tooling_uses_the_product_and_cli_and_demo_dispatch_to_it(tmp_path: Path) -> None:
    assert check_layers(_package(tmp_path, TOOLED)) == []


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        (  # a lower layer: an upward import too, reported once, as the product importing the tooling
            "serving/worker.py",
            "import os\nfrom pkg.testing.ports import free\n",
            "pkg/serving/worker.py:2 pkg.serving.worker imports pkg.testing.ports " + NEVER.format("testing"),
        ),
        (  # inside a function
            "integrations/__init__.py",
            "def f():\n    from pkg.bench import clock\n",
            "pkg/integrations/__init__.py:2 pkg.integrations imports pkg.bench.clock " + NEVER.format("bench"),
        ),
        (  # the top layer is no licence: the package's own __init__ is the product
            "__init__.py",
            "from pkg.cli import main\nimport pkg.testing.ports\n",
            "pkg/__init__.py:2 pkg imports pkg.testing.ports " + NEVER.format("testing"),
        ),
    ],
)
def test_the_product_importing_the_tooling_is_reported(tmp_path: Path, name: str, text: str, problem: str) -> None:
    problems = check_layers(_package(tmp_path, {**TOOLED, name: text}))
    assert [str(p) for p in problems] == [f"tooling: {problem}"]
