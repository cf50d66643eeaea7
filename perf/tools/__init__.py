"""The benchmarks' implementations. Users run them through perf/'s entry points (perf/README.md), each of which
dispatches its first argument to one of these modules (`dispatch`); helpers shared by several live here too
(`limits`: wall-clock bounds and reports written as they go)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dispatch(prog: str, doc: str, table: dict[str, tuple[str, str]], argv: list[str] | None = None) -> int:
    """Run `prog NAME [ARGS]`: NAME picks a module of perf.tools from `table` (name -> (module, what it measures
    against what)), whose main() then parses ARGS (`prog NAME --help` shows its options)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        width = max(map(len, table))
        lines = [doc.strip(), "", f"usage: {prog} NAME [options]   ({prog} NAME --help: its options)", ""]
        lines += [f"  {name:<{width}}  {what}" for name, (_, what) in table.items()]
        known = not argv or argv[0] in ("-h", "--help")
        print("\n".join(lines), file=sys.stdout if known else sys.stderr)
        if not known:
            print(f"\n{prog}: unknown benchmark {argv[0]!r}", file=sys.stderr)
        return 0 if known else 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(f"perf.tools.{table[argv[0]][0]}")
    sys.argv = [f"{prog} {argv[0]}", *argv[1:]]
    rc = module.main()
    return rc if isinstance(rc, int) else 0
