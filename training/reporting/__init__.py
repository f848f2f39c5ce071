"""The report of a run: report.md and its figures, read from the run directory alone."""
