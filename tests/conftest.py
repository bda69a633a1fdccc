import logging
import os

import torch

# Two cores here: more threads than cores only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))
logging.getLogger("transformers").setLevel(logging.ERROR)
