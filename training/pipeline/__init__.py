"""The offline pipeline: its steps in order, the commands on one run, progress and pre-flight checks."""
