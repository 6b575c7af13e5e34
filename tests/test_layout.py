"""The package layout rules of the redesign (issue 16), read from the source with ``ast``: no import cycle between
package modules (function-local imports included), no private name used across modules, no module over 400 lines,
a docstring at the top of every module, no function over 6 parameters and no call with more than 6 positional
arguments (the public verbs exempt). The rules and how imports are counted: ``layout_rules.py``; the same report
for a person: ``benchmarks/layout_report.py``."""

from __future__ import annotations

import itertools

import layout_rules as rules
import pytest


@pytest.fixture(scope="module")
def modules():
    return rules.discover()


def test_the_package_is_found(modules):
    assert "dla_recipes" in modules and "dla_recipes.testing" in modules, sorted(modules)


def test_no_import_cycle(modules):
    found = rules.cycles(modules)
    assert not found, "import cycles between package modules:\n" + "\n".join(rules.describe_cycles(found, modules))


def test_no_private_name_across_modules(modules):
    found = rules.private_imports(modules)
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_imports_run_down_the_stages(modules):
    found = rules.stage_violations(modules)
    assert not found, "imports against the order of the stages (layout_rules.STAGES):\n" + "\n".join(found)


def test_no_module_over_the_line_limit(modules):
    found = rules.long_modules(modules)
    assert not found, f"modules over {rules.MAX_LINES} lines:\n" + "\n".join(found)


def test_every_module_starts_with_a_docstring(modules):
    found = rules.missing_docstrings(modules)
    assert not found, "modules without a docstring:\n" + "\n".join(found)


def test_no_function_over_the_parameter_limit(modules):
    found = rules.long_signatures(modules)
    assert not found, (f"functions over {rules.MAX_PARAMS} parameters (group what travels together in a small "
                       "frozen record):\n" + "\n".join(found))


def test_no_call_over_the_positional_limit(modules):
    found = rules.long_calls(modules)
    assert not found, (f"calls with more than {rules.MAX_PARAMS} positional arguments (name them):\n"
                       + "\n".join(found))


# -- the rules themselves, on a small made-up package -----------------------------------------------------------------

FAKE = {
    "__init__.py": '"""Re-exports."""\nfrom . import _compat\nfrom .core import run\n',
    "_compat.py": '"""Side effect."""\n',
    "core.py": '"""Core."""\nfrom .stage import helper\n\ndef run():\n    return helper()\n',
    "stage/__init__.py": '"""A stage."""\nfrom .step import helper\n',
    "stage/step.py": (
        '"""A step."""\nfrom __future__ import annotations\nfrom typing import TYPE_CHECKING\n'
        'from .. import errors\nfrom ..errors import _secret\n\nif TYPE_CHECKING:\n    from ..util import Thing\n\n'
        'def helper():\n    from dla_recipes import run  # back to the package __init__: a cycle\n'
        '    import dla_recipes.errors as e\n    return e._CODE, errors._CODE, errors.__name__\n'
    ),
    "errors.py": '"""Errors."""\n_secret = 1\n_CODE = 2\n',
    "util.py": "x = 1\n" * 5,
}


@pytest.fixture
def fake(tmp_path):
    for name, text in FAKE.items():
        path = tmp_path / "dla_recipes" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return rules.discover(tmp_path, "dla_recipes")


def test_edges_resolve_relative_and_absolute_imports(fake):
    edges = {(e.source, e.target) for m in fake.values() for e in m.edges}
    assert ("dla_recipes", "dla_recipes._compat") in edges  # from . import _compat: the submodule
    assert ("dla_recipes", "dla_recipes.core") in edges
    assert ("dla_recipes.core", "dla_recipes.stage") in edges  # a name of stage/__init__.py
    assert ("dla_recipes.stage", "dla_recipes.stage.step") in edges
    assert ("dla_recipes.stage.step", "dla_recipes.errors") in edges  # from .. import errors (level 2)
    assert ("dla_recipes.stage.step", "dla_recipes.util") in edges  # under TYPE_CHECKING: counted
    assert ("dla_recipes.stage.step", "dla_recipes") in edges  # function-local, absolute, a name of __init__
    # from .. import errors takes a submodule: no edge to the package __init__ from that statement
    lines = {e.line for e in fake["dla_recipes.stage.step"].edges if e.target == "dla_recipes"}
    assert lines == {11}


def test_cycles_are_found_with_a_chain(fake):
    found = rules.cycles(fake)
    assert [c for c, _ in found] == [["dla_recipes", "dla_recipes.core", "dla_recipes.stage", "dla_recipes.stage.step"]]
    chain = found[0][1]
    assert chain[0].source == chain[-1].target == "dla_recipes"
    assert all(a.target == b.source for a, b in itertools.pairwise(chain))


def test_private_names_are_found(fake):
    found = "\n".join(rules.private_imports(fake))
    assert "imports the private name _secret of dla_recipes.errors" in found
    assert "`e._CODE` reads the private name _CODE of dla_recipes.errors" in found
    assert "`errors._CODE` reads the private name _CODE of dla_recipes.errors" in found
    assert "_compat" not in found and "__name__" not in found
    assert len(rules.private_imports(fake)) == 3


def test_lines_and_docstrings_are_checked(fake):
    assert rules.long_modules(fake, limit=4) == ["dla_recipes/stage/step.py: 13 lines (limit 4)",
                                                  "dla_recipes/core.py: 5 lines (limit 4)",
                                                  "dla_recipes/util.py: 5 lines (limit 4)"]
    assert rules.missing_docstrings(fake) == ["dla_recipes/util.py: no module docstring"]


def test_an_import_up_the_stages_is_found(modules):
    """The stage rule can fail: the plan importing the face (``api``) is reported, naming both stages."""
    from dataclasses import replace

    build = modules["dla_recipes.plan.build"]
    up = rules.Edge(build.name, "dla_recipes.api", build.file, 1, "module level", "from ..api import attribute")
    broken = {**modules, build.name: replace(build, edges=[*build.edges, up])}
    assert [line for line in rules.stage_violations(broken) if line.startswith("plan -> face")]
    assert not rules.stage_violations(modules)


WIDE = """\"\"\"Planted.\"\"\"
def wide(a, b, c, d, e, f, g):
    return a


def narrow(a, b, c, d, e, *, f):
    return wide(a, b, c, d, e, f, 7)


class Thing:
    def method(self, a, b, c, d, e, f):  # self is not counted: 6
        return narrow(a, b, c, d, e, f=f)

    def spread(self, a, *args, **kwargs):  # *args and **kwargs count: 3
        return narrow(*args, a, b=1, c=2, d=3, e=4, f=5)


def keywords(a, b, c, d, e, *, f, g):  # keyword-only parameters count: 7
    return a


def attribute(a, b, c, d, e, f, g, h):  # a public verb: exempt by its qualified name
    return a
"""


def test_long_signatures_and_calls_are_found(modules):
    """The parameter rule can fail: a planted module's functions over 6 parameters and its call with 7 positional
    arguments are reported, naming the file and line; a public verb (``PUBLIC_VERBS``) is not."""
    import ast
    from dataclasses import replace

    api = modules["dla_recipes.api"]
    planted = {api.name: replace(api, tree=ast.parse(WIDE))}  # the planted module alone
    signatures = rules.long_signatures(planted)
    assert signatures == ["dla_recipes/api.py:2: wide has 7 parameters (limit 6)",
                          "dla_recipes/api.py:18: keywords has 7 parameters (limit 6)"], signatures
    assert rules.long_calls(planted) == [
        "dla_recipes/api.py:7: a call of wide with 7 positional arguments (limit 6)"], rules.long_calls(planted)
    assert "attribute has 8" in "\n".join(rules.long_signatures(planted, exempt=()))
