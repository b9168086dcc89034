"""What the package adds to its models beyond the code a Hub folder ships: saving the generated code files, carrying
the model card, saved caches and the row-block training loss.

This layer sits above `kvm_maglev.models`, which imports nothing from it: `classes` subclasses each model's classes
with the mixins here (`kvm_maglev.KVMForCausalLM` and the rest are those), so a folder's generated code is the
models' own modules, with no network and no file writes.
"""
