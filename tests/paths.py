"""Where the repository and the tests' own data are, for tests at any depth."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
