"""Build and install the patched runtime into this interpreter's environment: `make setup` runs it before
the package is installed, so it puts the repository on the path and runs specee_edge/build_runtime.py, the
code behind `specee-edge build-runtime` (its docstring lists the options and the environment it reads)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specee_edge.build_runtime import err_console, main  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
