"""Research scripts, run as `python -m experiments.<name>` from the repository root; their notes are in
experiments/notes/. The package never imports them."""
