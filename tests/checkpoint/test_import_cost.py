"""Fixed costs of a short run: what importing the trainer pulls in."""

import subprocess
import sys


def test_the_trainer_does_not_import_torch_distributed_checkpoint_until_fsdp_needs_it():
    # torch.distributed.checkpoint takes about a second to import; only sharded (fsdp)
    # saves and loads use it, so a single-process run must not pay for it.
    code = ("import sys; import sailfin.trainer.core.trainer, sailfin.checkpoint.dcp_io; "
            "from sailfin import Trainer; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip() == "[]"
