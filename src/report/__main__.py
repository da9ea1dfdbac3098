"""``python -m dsdebug.report``: regenerate a run's report, compare two runs, or index a sweep.

    python -m dsdebug.report RUN_DIR                 # RUN_DIR/report.html + report.md
    python -m dsdebug.report RUN_A RUN_B [--out DIR] # RUN_A/compare_<RUN_B name>/compare.html + .md
    python -m dsdebug.report SWEEP_DIR               # SWEEP_DIR/sweep_index.html + .md

A path that is neither a run dir nor a sweep dir is one ``error: ...`` line and exit code 2.
Needs no torch/lightning import: it starts in about a second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsdebug.report.sweep import _RUN_FILES, is_sweep_dir

EXIT_BAD_INPUT = 2
_VALID = ("a run dir (logs/train/runs/<time>/ with config_resolved.yaml, metrics.json, history.jsonl, "
          "findings.jsonl or crash.json), a plain Lightning run's dir with a findings.jsonl in a folder below it, "
          "or a sweep dir (logs/train/multiruns/<time>/ with job dirs 0/, 1/, ...)")


class BadInput(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        raise BadInput(f"{message}; usage: python -m dsdebug.report RUN_DIR | RUN_A RUN_B [--out DIR] | SWEEP_DIR")


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in _RUN_FILES)


def holds_findings(path: Path) -> bool:
    """A plain Lightning project's dir: a findings.jsonl in a folder below it (a logger's version_<n>/)."""
    from dsdebug.report.load import findings_files

    return path.is_dir() and bool(findings_files(path))


def _check(arg: str, name: str) -> Path:
    path = Path(arg)
    if not path.exists():
        raise BadInput(f"{name} '{arg}' does not exist; valid: {_VALID}")
    if not path.is_dir():
        raise BadInput(f"{name} '{arg}' is a file, not a directory; valid: {_VALID}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m dsdebug.report", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", metavar="DIR", help="RUN_DIR, RUN_A RUN_B, or SWEEP_DIR")
    parser.add_argument("--out", help="output dir of a comparison (default: RUN_A/compare_<RUN_B name>/)")
    run_report: Path | None = None
    try:
        args = parser.parse_args(argv)
        if len(args.paths) > 2:
            raise BadInput(f"got {len(args.paths)} paths; valid: RUN_DIR, RUN_A RUN_B, or SWEEP_DIR")
        if len(args.paths) == 2:
            a, b = (_check(p, n) for p, n in zip(args.paths, ("RUN_A", "RUN_B")))
            for path, name in ((a, "RUN_A"), (b, "RUN_B")):
                if not (is_run_dir(path) or holds_findings(path)):
                    raise BadInput(f"{name} '{path}' is not a run dir (none of {', '.join(_RUN_FILES)}); "
                                   "valid: two run dirs")
            out = Path(args.out) if args.out else a / f"compare_{b.resolve().name}"
            if out.exists() and not out.is_dir():
                raise BadInput(f"--out '{out}' is a file; valid: a directory (created if missing)")
            from dsdebug.report.compare import compare

            written = compare(a, b, out)
        else:
            if args.out:
                raise BadInput("--out applies to a comparison (two run dirs) only")
            path = _check(args.paths[0], "DIR")
            if is_run_dir(path):
                from dsdebug.report.render import write_report

                written, run_report = write_report(path), path
            elif is_sweep_dir(path):
                from dsdebug.report.sweep import sweep_index

                written = sweep_index(path)
            elif holds_findings(path):  # findings below it only (a plain project's logger folder)
                from dsdebug.report.render import write_report

                written, run_report = write_report(path), path
            else:
                raise BadInput(f"'{path}' is neither a run dir nor a sweep dir; valid: {_VALID}")
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # unwritable dir, full disk: what was there before is untouched (atomic writes)
        print(f"error: cannot write the report: {exc.strerror or exc} ({exc.filename}); valid: a writable "
              "directory", file=sys.stderr)
        return EXIT_BAD_INPUT
    for path in written:
        print(path)
    if run_report is not None:  # say where the findings came from (never an all-clear without a file)
        from dsdebug.report.load import findings_files

        files = findings_files(run_report)
        print(f"findings: {len(files)} file(s) read: {', '.join(map(str, files))}" if files else
              f"findings: no findings.jsonl in {args.paths[0]} or below it: the report makes no claim about them",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
