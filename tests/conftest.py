import os
import sys

# tests import the flat top-level modules (model, parallel, ...) from the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
