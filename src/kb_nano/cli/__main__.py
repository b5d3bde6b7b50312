"""``python -m kb_nano.cli``: the ``kb_nano`` command."""

import sys

from kb_nano.cli import main

sys.exit(main())
