"""Where the repository is, for tests that read its files (profiles, prompts, the README, units).

One place, so a test module's depth under tests/ never decides what ``parents[n]`` means.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
