"""Where things are, for tests at any depth of tests/ (conftest.py puts tests/ on sys.path)."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
