"""Phases of a job on one node, the start_commands, signals and shutdown."""
