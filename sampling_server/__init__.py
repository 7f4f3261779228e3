"""The sampling server: partition store, samplers, servicer, peer client, CLI.

Importing the package sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already
sets it. The parallel Numba kernels run on GNU OpenMP, whose threads spin at every
barrier under the default policy; on a machine whose cores are also busy with other
work (trainers, gRPC threads, other jobs) a spinning thread waits for a partner that is
not scheduled, and a batch took 2x (one competing process on 2 cores) to 60x (a typed
batch on a loaded machine) longer. With passive waiting an idle machine is as fast
(``benchmarks/hetero.py``; the runs: ``git show 62cafe7:docs/benchmarks.md``). OpenMP
reads the variable once, when its runtime loads, which is why it is set here, before
Numba or torch start it.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
