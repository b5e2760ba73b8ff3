"""The layout's rules, read from the code: the apps reach methods only through the registry,
and what `flwr run` ships to nodes never needs the tools that stay home."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib

from fedbip_flwr.methods import names
from tests.helpers import ROOT

SHIPPED = ("fedbip_flwr", "client_app", "server_app")
APPS = [ROOT / "client_app" / "app.py", *sorted((ROOT / "server_app").glob("*.py"))]
APP_LINES = 100  # an app declares its entry points; the run itself is library code


def imported_modules(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


def test_the_apps_name_no_method():
    """The apps reach every method through the registry: no method name, no method module."""
    for path in APPS:
        text, imports = path.read_text(), imported_modules(path)
        for name in names():
            assert f'"{name}"' not in text, f"{path.name} names method {name}"
            module = f"fedbip_flwr.methods.{name.replace('-', '_')}"
            assert module not in imports, f"{path.name} imports {module}"


# The registry (method_settings.py, methods/) and FedBiP's own upload format may name methods.
NAMING_METHODS = {"method_settings.py", "payload.py"}


def test_no_shared_module_names_a_method():
    """Outside the registry and the methods, no string names a method: the shared layer asks
    the run's method (its settings, its hooks), never which one it is."""
    for path in sorted((ROOT / "fedbip_flwr").glob("*.py")):
        if path.name in NAMING_METHODS:
            continue
        strings = {
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        named = strings & set(names())
        assert not named, f"{path.name} names method(s) {sorted(named)}"


def test_the_apps_are_thin():
    for path in APPS:
        lines = len(path.read_text().splitlines())
        assert lines <= APP_LINES, f"{path.relative_to(ROOT)}: {lines} lines (at most {APP_LINES})"


def multi_round_checks(path) -> int:
    """How often ``path`` asks whether a method is a MultiRound (``isinstance(x, MultiRound)``)."""
    return sum(
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "isinstance"
        and "MultiRound" in ast.unparse(node.args[1])
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_one_place_parts_multi_round_methods_from_one_shot_ones():
    """A multi-round method's path splits from the one-shot path in fedbip_flwr/apps.py alone,
    so neither app nor any library module branches on the method's kind."""
    checks = {
        str(path.relative_to(ROOT)): n
        for package in (*SHIPPED, "fedbip_tools")
        for path in sorted((ROOT / package).rglob("*.py"))
        if (n := multi_round_checks(path))
    }
    assert checks == {"fedbip_flwr/apps.py": 1}


def test_what_nodes_run_never_imports_the_tools():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = project["tool"]["flwr"]["app"]["fab-include"]
    assert not [pattern for pattern in shipped if "fedbip_tools" in pattern]
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            tools = {name for name in imported_modules(path) if name.startswith("fedbip_tools")}
            assert not tools, f"{path.relative_to(ROOT)} imports {sorted(tools)}, which nodes lack"


# Public names of shipped modules that only the tools, scripts and tests call, each for a reason
# that keeps it beside what it belongs to; anything else tool-only lives in fedbip_tools.
SHIPPED_FOR_THE_TOOLS = {
    # the built-in world's splits stay with its one generator (their disjointness is its), and
    # the shipped models' training records name them
    "fedbip_flwr/shapes.py": {
        "public_corpus",
        "pretraining_corpus",
        "pretraining_words",
        "write_image_folder",
    },
    # `fedbip synthesize`: the external-synthesis workers beside the ServerApp, on its machines
    "fedbip_flwr/distributed.py": {"read_run_config", "open_run", "process_state"},
    # the payload file's reader, beside the format's decoder
    "fedbip_flwr/payload.py": {"load_payload"},
    # load_backbone's writer: one file format in one module
    "fedbip_flwr/classifier.py": {"save_backbone"},
    # the flat layout before the tables, the inverse of the moves beside it (MOVED): the
    # benchmark's cache keys are made in it
    "fedbip_flwr/config.py": {"earlier_layout"},
}


def _registered(node: ast.AST) -> bool:
    return any(ast.unparse(d) == "register" for d in getattr(node, "decorator_list", []))


def test_nothing_only_the_tools_use_ships_to_nodes():
    """Every public function and class of a shipped module is used by shipped code (a method
    registered by name counts: the registry creates it), or is listed above with its reason."""
    paths = [p for package in SHIPPED for p in sorted((ROOT / package).rglob("*.py"))]
    texts = {path: path.read_text() for path in paths}
    unused = {}
    for path, text in texts.items():
        for node in ast.parse(text).body:
            if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
                continue
            word = re.compile(rf"\b{node.name}\b")
            used_here = len(word.findall(text)) > 1
            used_elsewhere = any(word.search(t) for p, t in texts.items() if p != path)
            if not (used_here or used_elsewhere or _registered(node)):
                unused.setdefault(str(path.relative_to(ROOT)), set()).add(node.name)
    assert unused == SHIPPED_FOR_THE_TOOLS


def test_no_shipped_module_has_a_hidden_mode():
    """What a call does is in its arguments: no module switches behaviour through a context
    variable set somewhere up the stack."""
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            assert "contextvars" not in imported_modules(path), (
                f"{path.relative_to(ROOT)} uses contextvars"
            )


DATA_LAYER = ("dataset.py", "folders.py", "partitions.py", "shapes.py", "images.py", "specs.py")


def test_the_data_layer_takes_a_data_description_never_the_run_config():
    """What to load arrives as a DataDescription; no method knob can reach the data layer."""
    for name in DATA_LAYER:
        source = (ROOT / "fedbip_flwr" / name).read_text()
        assert "FedBiPConfig" not in source, f"{name} names FedBiPConfig"


def test_no_test_module_imports_another():
    """Shared helpers live in tests/helpers.py, imported under one spelling."""
    for path in sorted((ROOT / "tests").glob("*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            assert not any(p.startswith("test_") or p == "conftest" for p in parts[:2]), (
                f"{path.name} imports {name}: shared helpers belong in tests/helpers.py"
            )
            assert parts[0] != "helpers", f"{path.name}: import it as tests.helpers"


def test_tests_load_scripts_one_way():
    """Scripts are modules only through tests.helpers.script: no test edits ``sys.path`` or
    builds its own loader, so no test's imports depend on another having run first."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name == "test_structure.py":  # this test names the spellings it forbids
            continue
        source = path.read_text()
        for spelling in ("sys.path", "syspath_prepend", "spec_from_file_location"):
            assert spelling not in source, (
                f"{path.name} loads code with {spelling}: use tests.helpers.script"
            )


def package_imports(path, module: str, modules: set[str]) -> set[str]:
    """Which of ``modules`` the file ``path`` (module ``module``) imports anywhere in it,
    inside functions too, relative imports resolved; ``from package import name`` counts as
    the submodule ``name`` where one exists, else as the package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) + 1 - node.level]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            }
    return (found & modules) - {module}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order, the first repeated), or []."""
    state: dict[str, str] = {}  # "open" while on the path below, "done" when fully explored
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_library_has_no_import_cycle():
    """fedbip_flwr's modules import one way: every import counts, one inside a function too
    (a lazy import hides a cycle from Python, not from the structure). A package's own
    ``__init__`` importing its submodules is no cycle: importing a submodule runs it first."""
    paths = {}
    for path in sorted((ROOT / "fedbip_flwr").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {module: package_imports(path, module, set(paths)) for module, path in paths.items()}
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


SHARED_SAMPLING = ("synthesis.py", "concepts.py", "shared_concepts.py", "sampler.py")


def test_the_shared_sampling_code_knows_no_method_upload():
    """Synthesis conditions on :class:`~fedbip_flwr.shared_concepts.Concepts`, whichever
    method's upload carried them: the sampling layer imports no method and no method's upload
    format."""
    for name in SHARED_SAMPLING:
        path = ROOT / "fedbip_flwr" / name
        found = {
            m
            for m in imported_modules(path) | {f"fedbip_flwr.{n}" for n in _relative(path)}
            if m.startswith(("fedbip_flwr.payload", "fedbip_flwr.methods"))
        }
        assert not found, f"{name} imports {sorted(found)}"


def _relative(path) -> set[str]:
    """The modules ``from .x import ...`` names in ``path`` (one level: fedbip_flwr's own)."""
    return {
        node.module
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    }


def test_a_clientapp_imports_nothing_only_the_server_uses():
    """Every simulated client imports its app on its own core before it computes: matplotlib
    (the server's report, about 0.4 s) must not be among what it loads (a fresh process)."""
    audit = "import sys, client_app.app; print(sorted(m for m in sys.modules if 'matplotlib' in m))"
    done = subprocess.run(
        [sys.executable, "-c", audit], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
