"""The judge benchmark (MJ-Bench protocol): the command, recorded answers, data and metrics."""
