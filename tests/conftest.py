import os

import torch

# Deterministic, single-threaded CPU math: equal results run to run, and the
# suite leaves the machine's second core to the other process.
torch.manual_seed(0)
torch.set_num_threads(int(os.environ.get("AUTOSAC_TEST_THREADS", "1")))
