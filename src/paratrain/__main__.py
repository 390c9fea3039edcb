"""``python -m paratrain`` is the ``paratrain`` command."""

import sys

from paratrain.cli import main

sys.exit(main())
