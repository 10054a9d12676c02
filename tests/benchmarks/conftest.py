"""The benchmarks' helper modules, imported as the benchmark scripts import them (benchmarks/ on sys.path)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
