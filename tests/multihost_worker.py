"""One process of the multi-process training test (tests/test_train_multihost.py).

Runs `jax-twell train` with the arguments given, as the process that JAX_PROCESS_ID /
JAX_NUM_PROCESSES / JAX_COORDINATOR_ADDRESS describe (or alone without them), and writes
to the JSON file named by JAX_TWELL_ROWS_LOG, for every training step, which rows of the
step's global batch this process loaded. Exits with the command's status.
"""

import json
import os
import sys

import numpy as np


def main() -> int:
    from jax_twell import cli
    from jax_twell.train import data

    loaded: dict[int, list[int]] = {}
    batch_at = data.batch_at

    def recording_batch_at(tokens, step, *, seed, batch_size, seq_len, rows=slice(None)):
        loaded.setdefault(int(step), []).extend(np.arange(batch_size)[rows].tolist())
        return batch_at(tokens, step, seed=seed, batch_size=batch_size, seq_len=seq_len, rows=rows)

    data.batch_at = recording_batch_at
    status = cli.main(sys.argv[1:])
    with open(os.environ["JAX_TWELL_ROWS_LOG"], "w") as fh:
        json.dump(loaded, fh)
    return status


if __name__ == "__main__":
    sys.exit(main())
