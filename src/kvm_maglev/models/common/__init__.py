"""Code both models share, imported by each model folder as a package; a Hub folder gets it inlined into its
modeling file (`kvm_maglev.models.hub_code`)."""
