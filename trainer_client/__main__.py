"""``python -m trainer_client``: the trainer (same as ``python -m trainer_client.train``)."""

import sys

from trainer_client.train import main

sys.exit(main())
