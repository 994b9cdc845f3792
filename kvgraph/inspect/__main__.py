"""`python -m kvgraph.inspect DIR`: the summary of a debug dump, as text, JSON or an HTML page.

Exit status 0, or 2 when DIR holds no dump (with a message saying why, no traceback).
"""

from __future__ import annotations

import argparse
import sys

from kvgraph.inspect import DumpError, html_report, load_dump, summary_json, text_report

USAGE_ERROR = 2  # argparse's status for bad arguments; a path with no dump is one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvgraph.inspect",
        description="Summarise a kvgraph debug dump (debug_dump_path, KVGRAPH_DEBUG_DUMP, "
                    "--debug-dump-path): stages and their timings, pieces, compile-cache hits "
                    "and misses, captured graphs and their memory, where the time went, and "
                    "every warning.")
    parser.add_argument("dump", metavar="DIR", help="the dump directory (or its parent of "
                        "rank_<r> directories)")
    parser.add_argument("--html", metavar="OUT.html", help="also write the summary as one "
                        "self-contained HTML page")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON "
                        "instead of text")
    args = parser.parse_args(argv)
    try:
        summaries = load_dump(args.dump)
    except DumpError as error:
        print(f"python -m kvgraph.inspect: {error}", file=sys.stderr)
        return USAGE_ERROR
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as page:
                page.write(html_report(summaries))
        except OSError as error:
            print(f"python -m kvgraph.inspect: cannot write {args.html}: {error}",
                  file=sys.stderr)
            return USAGE_ERROR
    _print(summary_json(summaries) if args.json else text_report(summaries))
    if args.html and not args.json:
        print(f"\nwrote {args.html}")
    return 0


def _print(text: str) -> None:
    """`text` on stdout, what its encoding cannot hold escaped (a dump's JSON strings may hold
    anything, lone surrogates included)."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding), end="")


if __name__ == "__main__":
    sys.exit(main())
