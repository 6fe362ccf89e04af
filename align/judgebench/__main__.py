"""`python -m align.judgebench`: the judge benchmark command (the code lives in `align/judgebench/benchmark.py`)."""

from align.judgebench import benchmark

benchmark.main()
