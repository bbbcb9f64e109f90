import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# A standalone script run by ctest (it exits at import time), not a pytest module.
collect_ignore = ["ccalloc_torch_test.py"]


def pytest_configure(config):
    # scripts/torch-check runs the test files side by side on one GPU, then these alone.
    config.addinivalue_line(
        "markers", "whole_device: fills or reads the device's memory; run with no other process on it")
