"""Stand-in for Colab's `google.colab` package, for tests/test_notebooks_run.py only: the kernel that runs
notebooks/colab.ipynb finds it first on its PYTHONPATH. It has only what the notebook uses."""
