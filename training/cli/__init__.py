"""The `lapguard` command line: argument parsing and console output (no library code here)."""
