"""``mmcache`` under torchrun, with faults injected for tests (the tests start this script).

Environment: ``FAULT=raise`` makes rank 1 raise after decoding its first chunk, ``FAULT=die``
makes it exit at once without a word (as a killed process would); ``UNPROBED=name`` makes the
header probe fail for files of that name, so their size is learnt only by decoding (the
overflow path). These need ``--workers 0``: decoding then runs in the rank's own process.
``FAULT=hang`` makes rank 1 hang, for ever, where it would send its decoded share to rank 0
(``torch.distributed.gather_object``), as a rank stuck on a dead filesystem would.
"""

import os
import sys

import mmcache._layout as layout
import mmcache._workers as workers
from mmcache.cli import main

fault, unprobed = os.environ.get("FAULT"), os.environ.get("UNPROBED")
if unprobed:
    real_probe = layout.probe_size
    layout.probe_size = lambda p, *exif: (
        None if os.path.basename(p) == unprobed else real_probe(p, *exif)
    )
if fault == "hang" and os.environ.get("RANK") == "1":
    import threading

    import torch.distributed

    torch.distributed.gather_object = lambda *args, **kwargs: threading.Event().wait()
elif fault and os.environ.get("RANK") == "1":
    real_decode = workers._decode_here

    def failing_decode(jobs, data_path, opts):
        for results in real_decode(jobs, data_path, opts):
            yield results  # some records are written: the failure comes mid-decode
            if fault == "die":
                os._exit(3)
            raise OSError("injected failure")

    workers._decode_here = failing_decode
sys.exit(main(sys.argv[1:]))
