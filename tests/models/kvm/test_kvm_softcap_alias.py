"""`final_logit_softcapping` (transformers' name, read by TRL's fused log-prob head) is KVM's `logit_softcap`,
with transformers' None for off where the stored field uses 0 (TRL would read a 0 as a cap of 1)."""

from kvm_maglev.models.kvm import KVMConfig

TINY = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, rotary_dim=8, chunk_size=4,
            window_chunks=2)


def test_alias_maps_zero_to_none_and_writes_logit_softcap():
    config = KVMConfig(**TINY)
    assert config.logit_softcap == 0.0 and config.final_logit_softcapping is None
    config.final_logit_softcapping = 7.0
    assert config.logit_softcap == 7.0 and config.final_logit_softcapping == 7.0
    config.final_logit_softcapping = None
    assert config.logit_softcap == 0.0
    saved = KVMConfig(**TINY, logit_softcap=3.0).to_dict()
    assert "final_logit_softcapping" not in saved and saved["logit_softcap"] == 3.0


def test_old_config_key_loads_and_new_key_is_accepted():
    assert KVMConfig.from_dict({**TINY, "logit_softcap": 9.0}).final_logit_softcapping == 9.0
    assert KVMConfig(**TINY, final_logit_softcapping=5.0).logit_softcap == 5.0
