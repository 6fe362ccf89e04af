"""Product tools run as `python scripts/<name>.py` (building the testbed weights, benchmarks, the judge comparison,
fusing a run). A package only so that experiments can import a builder (`from scripts.build_testbed import ...`);
scripts never import experiments."""
