import sys
from pathlib import Path

# The status tests' shared helpers (status_cli.py, fake_api.py) live here and are imported by
# bare name from the test modules in the subfolders.
sys.path.insert(0, str(Path(__file__).parent))
