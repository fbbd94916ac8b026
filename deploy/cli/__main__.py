"""``python -m vlkv.deploy.cli``: the ``vlkv`` command line."""

import sys

from vlkv.deploy.cli.main import main

sys.exit(main())
