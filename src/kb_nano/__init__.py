"""kb-nano: benchmark candidate LLM-inference kernels against PyTorch baselines.

The package holds the library behind the Snakemake workflow (``Snakefile`` at the
repository root) and the ``kb_nano`` command-line interface.
"""

__version__ = "0.1.0"
