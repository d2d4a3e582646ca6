"""``python -m retmask <command>`` (also ``torchrun ... -m retmask detect``)."""

import sys

from retmask.cli import main

sys.exit(main())
