"""The package layout report: import cycles, private names used across modules, the largest modules, docstrings,
functions over 6 parameters and calls with more than 6 positional arguments (the public verbs exempt).

    python benchmarks/layout_report.py          # exit status 1 when any rule is broken

The rules and how imports are counted: ``tests/layout_rules.py`` (``tests/test_layout.py`` asserts the same rules).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import layout_rules as rules


def main() -> int:
    modules = rules.discover()
    found_cycles = rules.cycles(modules)
    private = rules.private_imports(modules)
    long = rules.long_modules(modules)
    undocumented = rules.missing_docstrings(modules)
    against = rules.stage_violations(modules)
    wide = rules.long_signatures(modules)
    calls = rules.long_calls(modules)
    edges = sum(len(m.edges) for m in modules.values())
    local = sum(1 for m in modules.values() for e in m.edges if e.where != "module level")

    print(f"dla_recipes layout: {len(modules)} modules, {sum(m.lines for m in modules.values())} lines, "
          f"{edges} imports between package modules ({local} of them inside a function or under TYPE_CHECKING)")
    sections = [
        (f"import cycles (strongly connected components of more than one module): {len(found_cycles)}",
         rules.describe_cycles(found_cycles, modules)),
        (f"private names used across modules: {len(private)}", private),
        (f"imports against the order of the stages: {len(against)}", against),
        (f"modules over {rules.MAX_LINES} lines: {len(long)}", long),
        (f"modules without a docstring: {len(undocumented)}", undocumented),
        (f"functions over {rules.MAX_PARAMS} parameters: {len(wide)}", wide),
        (f"calls with more than {rules.MAX_PARAMS} positional arguments: {len(calls)}", calls),
    ]
    for title, lines in sections:
        print(f"\n{title}")
        for line in lines:
            print(f"  {line}")
    print("\nlargest modules:")
    for module in sorted(modules.values(), key=lambda m: -m.lines)[:10]:
        print(f"  {module.lines:5d}  {module.file}")
    broken = [title.split(":")[0] for title, lines in sections if lines]
    print(f"\n{'FAILED: ' + '; '.join(broken) if broken else 'OK: every layout rule holds'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
