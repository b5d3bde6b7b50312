"""Models: the configs kb-nano derives shapes from, and golden tensors captured from a model run.

Modules: :mod:`~kb_nano.models.configs` (model references: short keys of
``config/models/models.yaml``, vendored Hugging Face ``config.json`` files, local paths;
loading a config and the kernel-relevant facts of it), :mod:`~kb_nano.models.golden`
(``kb_nano capture-golden``: real inputs of the data-dependent operators, written to
``results/golden/{model}/``), :mod:`~kb_nano.models.golden_inputs` (a kernel scenario's
inputs built from those files) and :mod:`~kb_nano.models.golden_summary` (what
``capture-golden`` prints about them).

Imports nothing: importing a submodule loads only it (the Snakefile imports
:mod:`~kb_nano.models.configs` at parse time; it must stay torch-free).
"""
