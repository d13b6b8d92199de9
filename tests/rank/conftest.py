import sys
from pathlib import Path

# The rank tests' shared workers (helpers.py, dist_setups.py, ...) live here and are imported
# by bare name from the test modules in the subfolders and from spawned rank processes.
sys.path.insert(0, str(Path(__file__).parent))
