"""pytest-benchmark suites: `pytest bench/suites --benchmark-only` (not collected by the test run)."""
