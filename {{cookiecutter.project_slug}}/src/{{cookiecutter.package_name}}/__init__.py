{{ cookiecutter.description | tojson }}

import sys

__version__ = "0.1.0"

# Every entry point imports this package first: before torch, fcntl or SIGUSR1 (POSIX only) are reached.
if sys.platform == "win32":
    sys.stderr.write("native Windows is not supported: run this project under WSL (docs/platforms.md)\n")
    raise SystemExit(2)
