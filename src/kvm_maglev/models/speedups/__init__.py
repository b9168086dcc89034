"""The models' optional speed-ups, each computing what a plain torch path of the models computes (and tested against
it): oneDNN linears (onednn_linear), the block that turns speed-ups on (runtime_switch), KVM's Triton decoding kernel
(decode_kernel_kvm), KVM's fold computed ahead while decoding (paced_fold_kvm), KVM's prompt pieces over their key
sets merged by log-sum-exp (merged_attention_kvm), Maglev's one-query ring attention (runtime_maglev).

No model module imports them by name: each is picked in one place, its seam (`models/common/seams.py`), so a Hub
folder's generated code carries none of them; it uses an installed kvm_maglev's only where `VERSION` is the one it
recorded."""

from hashlib import sha256
from pathlib import Path

from ... import __version__

# the package's version and a digest of these modules' source: what a generated file records and must find again
# (the version alone is not bumped with every change of these modules)
VERSION = __version__ + "+" + sha256(b"".join(path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py")))
                                     ).hexdigest()[:16]
