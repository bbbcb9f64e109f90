import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# A standalone script run by ctest (it exits at import time), not a pytest module.
collect_ignore = ["ccalloc_torch_test.py"]
