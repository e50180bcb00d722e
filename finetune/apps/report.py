"""`finetune report OUTPUT_DIR`: a run folder's curves and final metrics, as PNG, markdown and JSON.

The report itself is finetune/ship/report.py's (the push of a training run writes it too, for the model card);
this is the command around it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from finetune.ship.report import ReportError, find_state, metric_groups, method_of, series, summary, write_report

__all__ = ["ReportArgs", "ReportError", "find_state", "metric_groups", "method_of", "series", "summary",
           "write_report", "check_args", "main"]


@dataclass
class ReportArgs:
    """The run to report on"""

    output_dir: str | None = field(default=None, metadata={"help": "A run's --output_dir (or one of its checkpoints).",
                                                            "positional": True, "required": True})
    report_dir: str | None = field(default=None, metadata={"help": "Where to write the report (default: OUTPUT_DIR/report)."})


def check_args(parsed) -> list[str]:
    from finetune.config.training import writable_problem

    args: ReportArgs = parsed.args
    if args.output_dir is None:
        return []  # reported as required
    where = Path(args.report_dir) if args.report_dir else Path(args.output_dir) / "report"
    # The report is staged beside where it goes.
    problem = writable_problem("--report_dir" if args.report_dir else "OUTPUT_DIR", where.resolve().parent)
    return [problem] if problem else []


def main(argv: list[str] | None = None) -> None:
    import sys

    from finetune.config.parser import Command

    cmd = Command("finetune report", {"args": ReportArgs},
                  description="Write OUTPUT_DIR/report/: loss, learning-rate and throughput curves (PNG), the final "
                              "metrics as markdown and JSON.")
    args: ReportArgs = cmd.parse_or_exit(argv, check_args).args
    try:
        print(write_report(args.output_dir, args.report_dir))
    except ReportError as e:
        print(f"finetune report: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
