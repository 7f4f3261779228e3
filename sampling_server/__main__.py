"""``python -m sampling_server``: the sampling server (see ``sampling_server.cli``)."""

import sys

from sampling_server.cli import main

sys.exit(main())
