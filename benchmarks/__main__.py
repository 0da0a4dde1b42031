"""`python -m benchmarks NAME [args]`: run one benchmark (a suite) or one of the tools beside them.

Without a name, or with -h, it lists them. A suite's own arguments follow its name
(`python -m benchmarks NAME --help` shows them).
"""

from __future__ import annotations

import importlib
import sys

from benchmarks.suites import SUITES
# Tools: the performance page from the records; the model of a dist_sync step from measured costs.
TOOLS = {"report": "benchmarks.report", "scaling_model": "benchmarks.scaling_model"}


def module_of(name: str) -> str:
    return TOOLS.get(name, f"benchmarks.suites.{name}")


def first_line(name: str) -> str:
    """A suite's summary: the first line of its module's docstring, read without importing it
    (some import TensorFlow)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent / (f"{name}.py" if name in TOOLS else f"suites/{name}.py")
    doc = path.read_text().split('"""')
    return doc[1].strip().splitlines()[0] if len(doc) > 2 else ""


def listing() -> str:
    lines = ["usage: python -m benchmarks NAME [args]   (python -m benchmarks NAME --help: its arguments)", "",
             "benchmarks:"]
    lines += [f"  {n:<22} {first_line(n)}" for n in SUITES]
    lines += ["", "tools:"] + [f"  {n:<22} {first_line(n)}" for n in TOOLS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUITES and name not in TOOLS:
        print(f"benchmarks: unknown benchmark {name!r}; choose from {', '.join((*SUITES, *TOOLS))}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(module_of(name))
    # the suite parses sys.argv as it did as a script; its usage line names the command
    sys.argv = [f"python -m benchmarks {name}", *rest]
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main())
