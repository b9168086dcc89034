"""The one source of what every model folder needs; `python -m kvm_maglev.models.sync_shared` copies each
module flat into the model folders that use it (a Hub folder holds one flat level of modules)."""
