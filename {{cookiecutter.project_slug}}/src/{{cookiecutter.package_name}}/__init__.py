{{ cookiecutter.description | tojson }}

import sys

__version__ = "0.1.0"

# First of all, before torch and before anything imports fcntl or asks for SIGUSR1 (POSIX only): every
# entry point (train.py, predict.py, the launcher, the notebooks' helpers) imports this package first.
if sys.platform == "win32":
    sys.stderr.write("native Windows is not supported: run this project under WSL (docs/platforms.md)\n")
    raise SystemExit(2)
